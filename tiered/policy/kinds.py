"""The values a policy chooses among: the tiers, the compute, moment, master and frozen
weights' dtypes, the device. Plain enums, read by every layer that reads a policy (config.py holds the sections)."""
from __future__ import annotations

import enum

import torch

from ..core.errors import TieredError
from ..tiers.moments import FORMATS


class Tier(str, enum.Enum):
    HBM = "hbm"
    DRAM = "dram"
    NVME = "nvme"
    AUTO = "auto"
    """A policy's choice only, never where a state is: the planner places each unit's states
    (planner.py)."""


class ComputeDtype(str, enum.Enum):
    AUTO = "auto"
    """bf16 where the device computes it natively, else fp32 (device/bf16.py says why); a
    policy's choice only, made concrete once, at initialize (resolve_compute_dtype)."""
    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"

    @property
    def torch_dtype(self) -> torch.dtype:
        if self is ComputeDtype.AUTO:
            # Whatever asks has a policy no initialize resolved: its sizes would be guesses.
            raise TieredError("compute_dtype auto has no torch dtype until resolve_compute_dtype "
                              "makes it bf16 or fp32 for the device")
        return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[self.value]


class MomentsDtype(str, enum.Enum):
    """How AdamW's two moments are stored ([Note: compact states] in optim/compact.py); they are
    computed in fp32 either way."""

    FP32 = "fp32"
    BF16 = "bf16"
    """bf16, stochastically rounded: 2 bytes each."""
    INT8 = "int8"
    """8-bit codes of a float-like map (signed for the first moment, unsigned for the second)
    with an fp32 scale per block of 256: 1.016 bytes each."""

    @property
    def torch_dtype(self) -> torch.dtype:
        """What the tiers hold a moment in (int8: packed codes and scales, tiers/moments.py)."""
        return FORMATS[self.value].dtype


class MasterDtype(str, enum.Enum):
    """How the master weights are kept."""

    FP32 = "fp32"
    BF16 = "bf16"
    """No fp32 copy: the bf16 weights are the master, stochastically rounded."""


class FrozenDtype(str, enum.Enum):
    """How a unit of frozen parameters keeps its linear layers' weights ([Note: quantized
    frozen weights] in tiers/quantized.py)."""

    COMPUTE = "compute"
    """In the compute dtype, as every other weight."""
    INT8 = "int8"
    """torchao's weight-only int8: 1 byte per element and an fp32 scale per output row."""
    NF4 = "nf4"
    """QLoRA's NormalFloat4 (torchao): half a byte per element and about 1/64 byte of scales."""


class Device(str, enum.Enum):
    AUTO = "auto"  # CUDA (device LOCAL_RANK) when available, else the CPU
    CPU = "cpu"
    CUDA = "cuda"
