"""Whether a device computes bf16 natively, which ``compute_dtype: auto`` asks.

Where it does not, bf16 is emulated and slow: on an AMD EPYC with AVX2 alone, PyTorch's bf16
matmul of 1024 x 128 by 128 x 512 took 17.4 ms against 1.2 ms in fp32, and the README's
example ran 13 times slower than in fp32. A CPU computes bf16 natively with AVX512-BF16 or
AMX (the kernel's ``avx512_bf16`` and ``amx_bf16`` flags), a GPU where
``torch.cuda.is_bf16_supported()`` says so (Ampere and later).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

CPUINFO_ENV = "TIERED_CPUINFO"
"""A file read in place of ``/proc/cpuinfo``: what ``compute_dtype: auto`` chooses on another
CPU (the tests fake a CPU with or without native bf16 through it, also in subprocesses)."""

CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""The flags of the instructions that compute bf16 on x86: any one is enough."""


@dataclass(frozen=True)
class Bf16Support:
    """Whether a device computes bf16 natively, and why, as a log line says it."""

    native: bool
    why: str


def cpu_flags() -> frozenset[str] | None:
    """This CPU's flags as the kernel lists them (the first processor's: the others are the
    same), or None where no cpuinfo can be read (not Linux)."""
    path = os.environ.get(CPUINFO_ENV) or "/proc/cpuinfo"
    try:
        with open(path, encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                name, _, value = line.partition(":")
                if name.strip() == "flags":
                    return frozenset(value.split())
    except OSError:
        return None
    return frozenset()


def bf16_support(device: torch.device) -> Bf16Support:
    """Whether ``device`` (the compute device; a simulated accelerator computes on the CPU)
    computes bf16 natively."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if torch.cuda.is_bf16_supported():
            return Bf16Support(True, f"{name} computes bf16")
        return Bf16Support(False, f"{name} has no native bf16")
    flags = cpu_flags()
    if flags is None:
        return Bf16Support(False, "this CPU's flags cannot be read, so no native bf16 is "
                                  "assumed")
    found = [flag for flag in CPU_BF16_FLAGS if flag in flags]
    if found:
        return Bf16Support(True, f"this CPU has {' and '.join(found)}")
    return Bf16Support(False, "this CPU has no native bf16: neither avx512_bf16 nor amx_bf16")
