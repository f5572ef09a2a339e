"""Each optimizer moment's format, in one place: what the tiers hold it in, how many elements
and bytes it takes, how a piece of it is laid out in memory and on disk, and how it is encoded
from fp32 and decoded back. The plan sizes states with it, the stream cuts pieces with it, the
checkpoint names and converts them with it, and optim/native.py builds the C kernels with its
constants (``kernel_defines``), so no other file knows a format's layout.

- ``fp32``: one fp32 element per parameter.
- ``bf16``: one bf16 element per parameter, written stochastically rounded (see [Note: compact
  states] in optim/compact.py for why).
- ``int8``: packed. Per block of QBLOCK parameters, QBLOCK one-byte codes then the block's fp32
  scale, so parameter i's code is byte i // QBLOCK * QBLOCK_BYTES + i % QBLOCK and a run of
  whole blocks is a run of bytes. A code is a tiny float (``CodeMap``), one map for the first
  moment and one for the second. The tiers hold it as uint8, the only state dtype that means
  packed codes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .dram import BLOCK_ALIGN

QBLOCK = 256
"""Parameters per scale of an 8-bit moment."""
QBLOCK_BYTES = QBLOCK + 4

PACKED = torch.uint8

MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class CodeMap:
    """An 8-bit float-like code: E exponent bits (bias ``bias``), 3 mantissa bits, perhaps a
    sign; (8 + M) 2^(E - bias - 3) for E > 0, M 2^(-bias - 2) for E = 0 (evenly spaced down to
    zero). ``max_code`` is the largest finite magnitude; ``nan_code`` stands for a NaN or
    infinity."""

    bias: int
    signed: bool
    max_code: int
    nan_code: int

    def values(self) -> torch.Tensor:
        """Each code's value, as fp32 (exact: small integers times powers of two)."""
        codes = torch.arange(256)
        magnitude = codes & 0x7F if self.signed else codes
        exponent, mantissa = magnitude >> 3, (magnitude & 7).double()
        value = torch.where(exponent > 0, (8 + mantissa) * torch.exp2(exponent - self.bias - 3.0),
                            mantissa * 2.0 ** (-self.bias - 2))
        if self.signed:
            value = torch.where(codes >= 0x80, -value, value)
        value[self.nan_code] = float("nan")
        return value.float()

    @property
    def largest(self) -> float:
        """The largest finite value: what a block's largest magnitude becomes."""
        return self.values()[self.max_code].item()


FIRST_MOMENT = CodeMap(bias=15, signed=True, max_code=0x7F, nan_code=0x80)
"""Signed, 1.875 down to 2^-17 (-0 is the NaN code)."""
SECOND_MOMENT = CodeMap(bias=31, signed=False, max_code=0xFE, nan_code=0xFF)
"""Unsigned, 1.75 down to 2^-33."""


@dataclass(frozen=True)
class MomentFormat:
    """One of ``optimizer.moments``' formats."""

    name: str
    """The policy's word for it, and a checkpoint's: fp32, bf16 or int8."""
    dtype: torch.dtype
    """What the tiers hold it in."""

    @property
    def packed(self) -> bool:
        return self.dtype is PACKED

    def decode(self, stored: torch.Tensor, numel: int, code_map: CodeMap) -> torch.Tensor:
        """The first ``numel`` parameters' values, as fp32 (``code_map``: the moment's, where
        packed)."""
        if not self.packed:
            return stored[:numel].float()
        codes, scales = _blocks(stored, numel)
        values = code_map.values().to(stored.device)[codes.long()] * scales[:, None]
        return values.reshape(-1)[:numel]

    def encode_into(self, stored: torch.Tensor, values: torch.Tensor, code_map: CodeMap,
                    r8: torch.Tensor) -> None:
        """Store fp32 ``values`` (packed: a whole number of blocks, but for a unit's last),
        rounded stochastically by the 8 random bits ``r8`` each where the format rounds."""
        if self.packed:
            _quantize_into(stored, values, code_map, r8)
        elif self.dtype is torch.bfloat16:
            stored[:values.numel()] = round_bf16_stochastic(values, r8 << 8)
        else:
            stored[:values.numel()] = values


FP32 = MomentFormat("fp32", torch.float32)
BF16 = MomentFormat("bf16", torch.bfloat16)
INT8 = MomentFormat("int8", PACKED)
FORMATS = {moment_format.name: moment_format for moment_format in (FP32, BF16, INT8)}
"""By the policy's name."""


def format_of(dtype: torch.dtype) -> MomentFormat:
    """The format of a moment held in ``dtype``."""
    for moment_format in FORMATS.values():
        if moment_format.dtype is dtype:
            return moment_format
    raise ValueError(f"no moment is held in {dtype}")


def stored_numel(dtype: torch.dtype, numel: int) -> int:
    """Elements of ``dtype`` a state of ``numel`` parameters is stored in (packed codes: a
    partial last block takes a whole one)."""
    return -(-numel // QBLOCK) * QBLOCK_BYTES if dtype is PACKED else numel


def stored_span(dtype: torch.dtype, start: int, numel: int) -> tuple[int, int]:
    """(first element, elements) of ``dtype`` that parameters [start, start + numel) of a state
    are stored in; with packed codes ``start`` starts a block."""
    if dtype is not PACKED:
        return start, numel
    assert start % QBLOCK == 0, f"a packed span starts on a block, not at {start}"
    return start // QBLOCK * QBLOCK_BYTES, stored_numel(dtype, numel)


def stored_granule(dtype: torch.dtype) -> int:
    """Elements of ``dtype`` a piece of a stored state starts on a multiple of: a 4 KiB block
    of its extent (O_DIRECT), and with packed codes also a block of codes, so that each piece
    decodes alone."""
    granule = BLOCK_ALIGN // dtype.itemsize
    return math.lcm(granule, QBLOCK_BYTES) if dtype is PACKED else granule


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


def kernel_defines() -> tuple[str, ...]:
    """The packed format's constants as the C kernels are built with them (adamw_compact.c
    defines none of its own): the block, and each code map's bias, largest code, NaN code and
    largest value."""
    defines = [f"-DQBLOCK={QBLOCK}", f"-DQBLOCK_BYTES={QBLOCK_BYTES}"]
    for prefix, code_map in (("M", FIRST_MOMENT), ("V", SECOND_MOMENT)):
        defines += [f"-D{prefix}_BIAS={code_map.bias}", f"-D{prefix}_MAX_CODE={code_map.max_code}u",
                    f"-D{prefix}_NAN={code_map.nan_code}u",
                    f"-D{prefix}_LARGEST={code_map.largest!r}f"]
    return tuple(defines)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The fp32 tensor's bit patterns, as non-negative int64."""
    return x.view(torch.int32).long() & MASK32


def _as_int16(values: torch.Tensor) -> torch.Tensor:
    return (((values & 0xFFFF) ^ 0x8000) - 0x8000).to(torch.int16)


def round_bf16_stochastic(x: torch.Tensor, r16: torch.Tensor) -> torch.Tensor:
    """fp32 to bf16, rounded up with probability (dropped bits) / 2^16 by the random 16 bits
    ``r16`` (8 random bits shifted up: in steps of 1/256); a NaN stays a quiet NaN."""
    bits = _bits(x)
    rounded = torch.where(torch.isnan(x), (bits >> 16) | 0x40, (bits + r16) >> 16)
    return _as_int16(rounded).view(torch.bfloat16)


def round_bf16_nearest(x: torch.Tensor) -> torch.Tensor:
    """fp32 to bf16 to nearest even, as torch's cast, but a NaN kept with its sign and payload,
    as the kernel does."""
    bits = _bits(x)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return _as_int16(torch.where(torch.isnan(x), (bits >> 16) | 0x40, rounded)).view(
        torch.bfloat16)


def encode_codes(x: torch.Tensor, code_map: CodeMap, r8: torch.Tensor) -> torch.Tensor:
    """The codes of normalized fp32 values (magnitudes at most ``code_map.largest``, but for
    rounding), rounded up with a probability in steps of 1/256 by 8 random bits each, as
    int64."""
    bias = code_map.bias
    a = x.abs()
    smallest_normal = 2.0 ** (1 - bias)
    # Below the smallest normal code, a + 2^(1-bias) is an fp32 whose top 3 mantissa bits are
    # the evenly spaced code, its exponent one more than a normal code's offset says.
    below = a < smallest_normal
    shifted = _bits(torch.where(below, a + smallest_normal, a))
    offset = torch.where(below, 128 - bias, 127 - bias) << 3
    code = (((shifted + (r8 << 12)) >> 20) - offset).clamp(max=code_map.max_code)
    if code_map.signed:
        code = torch.where((x < 0) & (code > 0), code | 0x80, code)
    else:
        code = torch.where((a > 0) & (code == 0), 1, code)
    return torch.where(torch.isfinite(x), code, code_map.nan_code)


def divide(x: torch.Tensor, divisor: torch.Tensor) -> torch.Tensor:
    """``x / divisor`` divided, as the kernels do: torch multiplies by the reciprocal when the
    divisor is a one-element tensor or a Python number (on the CPU and on CUDA), which differs
    in the last bit."""
    return x / divisor.expand_as(x)


def _blocks(packed: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a packed 8-bit moment: its codes (blocks x 256, uint8) and scales (fp32)."""
    rows = packed[:stored_numel(PACKED, numel)].view(-1, QBLOCK_BYTES)
    return rows[:, :QBLOCK], rows[:, QBLOCK:].contiguous().view(torch.float32)[:, 0]


def _quantize_into(packed: torch.Tensor, x: torch.Tensor, code_map: CodeMap,
                   r8: torch.Tensor) -> None:
    numel = x.numel()
    pad = -numel % QBLOCK
    blocks = torch.nn.functional.pad(x, (0, pad)).view(-1, QBLOCK)
    r8 = torch.nn.functional.pad(r8, (0, pad)).view(-1, QBLOCK)
    finite = torch.where(torch.isfinite(blocks), blocks.abs(), 0.0)
    largest = finite.amax(dim=1)
    scales = divide(largest, torch.tensor(code_map.largest, device=largest.device))
    inverse = torch.where(scales > 0, (1.0 / scales).clamp(max=torch.finfo(torch.float32).max),
                          0.0)
    codes = encode_codes(blocks * inverse[:, None], code_map, r8).to(torch.uint8)
    rows = packed[:stored_numel(PACKED, numel)].view(-1, QBLOCK_BYTES)
    last = numel - (rows.shape[0] - 1) * QBLOCK  # a unit's last block may be partial: its
    rows[:-1, :QBLOCK] = codes[:-1]              # padding keeps what it held
    rows[-1, :last] = codes[-1, :last]
    rows[:, QBLOCK:] = scales.view(-1, 1).view(torch.uint8)
