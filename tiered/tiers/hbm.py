"""HBM: the compute device's memory.

Without CUDA the CPU plays the device, and this tier is budgeted and reported exactly as on a GPU,
so placement and budget tests run anywhere.
"""
from __future__ import annotations

import psutil
import torch

from .usage import TierUsage


def device_capacity(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return psutil.virtual_memory().total


class HbmTier:
    def __init__(self, device: torch.device, budget: int | None):
        self.device = device
        self.usage = TierUsage("hbm", device_capacity(device) if budget is None else budget)

    def empty(self, numel: int, dtype: torch.dtype, what: str) -> torch.Tensor:
        """A resident buffer held until :meth:`free`; counted against the budget."""
        nbytes = numel * dtype.itemsize
        self.usage.acquire(nbytes, what)
        try:
            return torch.empty(numel, dtype=dtype, device=self.device)
        except BaseException:
            # The allocator refused (out of memory): nothing is held, so nothing may stay counted.
            self.usage.release(nbytes)
            raise

    def free(self, tensor: torch.Tensor) -> None:
        self.usage.release(tensor.numel() * tensor.element_size())
