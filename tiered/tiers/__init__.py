"""The three tiers: device memory (HBM), pinned host memory (DRAM) and files on NVMe."""
from .dram import DramTier, PinnedSlabSource, SlabSource
from .hbm import HbmTier
from .nvme import NvmeShard, NvmeTier
from .usage import TierUsage

__all__ = ["DramTier", "HbmTier", "NvmeShard", "NvmeTier", "PinnedSlabSource", "SlabSource",
           "TierUsage"]
