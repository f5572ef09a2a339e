"""How a moment is laid out in memory, on disk and in a piece, by its dtype (issue 21).

An fp32 or bf16 moment is one element per parameter. An 8-bit moment (``optimizer.moments:
int8``; see [Note: compact states] in optim/compact.py) is packed: per block of QBLOCK
parameters, QBLOCK one-byte codes then the block's fp32 scale, so parameter i's code is byte
i // QBLOCK * QBLOCK_BYTES + i % QBLOCK, and a run of whole blocks is a run of bytes. The tiers
hold it as uint8, the only state dtype that means packed codes.
"""
from __future__ import annotations

import math

import torch

from .dram import BLOCK_ALIGN

QBLOCK = 256
"""Parameters per scale of an 8-bit moment."""
QBLOCK_BYTES = QBLOCK + 4

PACKED = torch.uint8


def packed_nbytes(numel: int) -> int:
    """Bytes of an 8-bit moment of ``numel`` parameters (a partial last block takes a whole
    one)."""
    return -(-numel // QBLOCK) * QBLOCK_BYTES


def stored_numel(dtype: torch.dtype, numel: int) -> int:
    """Elements of ``dtype`` a state of ``numel`` parameters is stored in."""
    return packed_nbytes(numel) if dtype is PACKED else numel


def stored_span(dtype: torch.dtype, start: int, numel: int) -> tuple[int, int]:
    """(first element, elements) of ``dtype`` that parameters [start, start + numel) of a state
    are stored in; with packed codes ``start`` starts a block."""
    if dtype is not PACKED:
        return start, numel
    assert start % QBLOCK == 0, f"a packed span starts on a block, not at {start}"
    return start // QBLOCK * QBLOCK_BYTES, packed_nbytes(numel)


def piece_granule(dtypes: list[torch.dtype]) -> int:
    """The parameters a piece of states of ``dtypes`` on NVMe starts on a multiple of: each
    state's piece must start on a 4 KiB block of its file (O_DIRECT). 1024 parameters for fp32
    states, 2048 for bf16 ones alone, 262144 (1024 blocks of 260 bytes) with packed codes."""
    granule = 1
    for dtype in dtypes:
        per_block = (math.lcm(BLOCK_ALIGN, QBLOCK_BYTES) // QBLOCK_BYTES * QBLOCK
                     if dtype is PACKED else BLOCK_ALIGN // dtype.itemsize)
        granule = math.lcm(granule, per_block)
    return granule
