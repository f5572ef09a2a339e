"""What the tier and memory tests share: the block of direct I/O, the names of NVMe extent
files, DRAM blocks reserved from a tier, and the bytes a unit's shards take in DRAM."""
from __future__ import annotations

import re

import torch

from tiered.core.sizes import align_up
from tiered.device import CpuAccelerator
from tiered.placement.plan import StateKind
from tiered.tiers import DramTier, PinnedSlabSource
from tiered.tiers.dram import BLOCK_ALIGN

BLOCK = 4096
EXTENT_NAME = re.compile(r"extent-\d{5}\.bin")


def dram_blocks(sizes: dict, huge_pages: bool = False) -> tuple[DramTier, dict]:
    tier = DramTier(budget=None,
                    source=PinnedSlabSource(CpuAccelerator(), huge_pages=huge_pages))
    return tier, tier.reserve(sizes)


def shard_numels(model) -> list[int]:
    """Shard sizes from the model alone: the repeated blocks, then the root's parameters."""
    blocks = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    root = sum(p.numel() for p in model.parameters()) - sum(blocks)
    return blocks + [root]


def dram_block(numel: int, itemsize: int) -> int:
    return align_up(numel * itemsize, 4096)


def dram_bytes(flat, kinds: list[StateKind], compute: torch.dtype) -> int:
    """What a unit's states take in DRAM: each a whole number of 4 KiB blocks."""
    sizes = {StateKind.PARAM: compute.itemsize, StateKind.PARAM_NEXT: compute.itemsize,
             StateKind.GRAD: 4, StateKind.MASTER: 4, StateKind.EXP_AVG: 4,
             StateKind.EXP_AVG_SQ: 4}
    return sum(align_up(flat.shard_numel * sizes[kind], BLOCK_ALIGN) for kind in kinds)


def activations_on_nvme(path, dram_bytes: int | str) -> dict:
    """Policy overrides for ``activations.tier: nvme`` under ``path``: saved tensors past a
    DRAM block of ``dram_bytes`` (every one moves: ``min_bytes`` 0) go to the drive, through
    slots of 8 KiB (two requests of 4 KiB), so that a tiny model's tensors cross in pieces, and
    ten of them (reads ahead of 64 KiB, where the device has streams)."""
    return {"nvme": {"path": str(path), "block_size": 4096, "queue_depth": 2},
            "activations": {"tier": "nvme", "dram_bytes": dram_bytes, "nvme_bytes": "4MiB",
                            "min_bytes": 0, "prefetch_bytes": "64KiB"}}
