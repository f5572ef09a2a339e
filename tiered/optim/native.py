"""The one-pass AdamW step built for this machine from C (adamw_one_pass.c), where a C compiler
is: the compiled (inductor) kernel's results, bit for bit, at 0.98x the parameters per second
of torch's fused kernel on fp32 gradients (median of seven runs, 0.90-1.11) where the compiled
one ran 0.73-0.93x (50 M parameters, 2 cores; bench/RESULTS.md, eighteenth session: the
weights streamed out from the registers), and built in a fraction of a second once where
inductor compiles for seconds in every process. With it, the compact-state kernels (adamw_compact.c; issue 21).

The library is built once per machine and compiler, with ``-march=native`` (or for the
instruction set $TIERED_KERNEL_ISA names: INSTRUCTION_SETS), into the user's
cache folder (``TIERED_CACHE``, as ``tiered node``'s rates), named by a hash of the source, the
flags, the compiler's version and the CPU's model and flags: a home folder shared by machines of
other CPUs builds one for each, never loading code for instructions a CPU lacks. Ranks that
build at once each write their own file and rename it into place. Where there is no compiler,
or a build fails, the compiled kernel serves, as before, with a warning saying why.

The call is a ctypes foreign call, which lets go of the GIL while the kernel runs (the training
thread keeps launching work meanwhile), on the caller's intra-op thread count (the CPU worker's).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import warnings
from typing import Callable

import torch

from ..core.version import cache_folder
from ..tiers.moments import kernel_defines

SOURCES = tuple(os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
                for name in ("adamw_one_pass.c", "adamw_compact.c"))
HEADERS = (os.path.join(os.path.dirname(os.path.abspath(__file__)), "adamw_kernel.h"),)
FLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
         "-ffp-contract=off", "-shared",
         "-fPIC")
"""See adamw_one_pass.c: no fused multiply-adds, so that the results are the compiled
kernel's (and compact.reference_step's); no errno from sqrtf, so that it vectorizes."""

INSTRUCTION_SETS = {
    "native": ("-march=native",),
    "portable": ("-march=x86-64",),
    "avx2": ("-march=x86-64-v3",),
    "avx512": ("-march=x86-64-v4",),
}
"""What each build targets: ``native`` this CPU (the default), the others a level of x86-64
that any CPU of it runs: SSE2 only (the C loop as the compiler vectorizes it for any x86-64),
AVX2 (the same loop, 8 lanes), AVX-512 (the loop of intrinsics). They give the same bits
(tests/optim/test_kernels_isa.py), so that a run's results do not depend on the CPU it lands on."""
ISA_ENV = "TIERED_KERNEL_ISA"
"""Names the instruction set the kernels are built for (see INSTRUCTION_SETS): a CPU's paths
tested on another that has them all (CI runs the AVX2 and portable ones on any CPU)."""
_NEEDS = {"portable": {"sse2"}, "avx2": {"avx2", "fma", "bmi2", "f16c", "movbe"},
          "avx512": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}}
"""The CPU flags (/proc/cpuinfo) each x86-64 level needs to run."""

_NAMES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}

NativeStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                       torch.Tensor], None]
"""(master, gradient, exp_avg, exp_avg_sq, weights, scalars): one step, in place."""


def native_step(grad_dtype: torch.dtype, weights_dtype: torch.dtype,
                isa: str | None = None) -> NativeStep | None:
    """The native kernel for gradients of ``grad_dtype`` and weights of ``weights_dtype``, or
    None where there is none (no compiler, a failed build, a pair it does not provide).
    ``isa``: the instruction set it is built for (INSTRUCTION_SETS; None: $TIERED_KERNEL_ISA,
    else native)."""
    return _native_step(grad_dtype, weights_dtype, kernel_isa(isa))


@functools.cache
def _native_step(grad_dtype: torch.dtype, weights_dtype: torch.dtype,
                 isa: str) -> NativeStep | None:
    library = _library(isa)
    name = f"one_pass_g{_NAMES.get(grad_dtype)}_w{_NAMES.get(weights_dtype)}"
    if library is None or not hasattr(library, name):
        return None
    function = getattr(library, name)
    function.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    function.restype = None

    def step(master, grad, exp_avg, exp_avg_sq, weights, scalars) -> None:
        function(master.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
                 weights.data_ptr(), master.numel(), scalars.data_ptr(), torch.get_num_threads())

    return step


CompactStep = Callable[..., None]
"""(master or None, weights_in, gradient, exp_avg, exp_avg_sq, weights_out, first, bounds,
run_scalars, key): compact.reference_step's arguments, the runs as a tensor
of bounds (int64, runs + 1) and one of scalars (fp32, runs x 9)."""


def native_compact_step(grad_dtype: torch.dtype, weights_dtype: torch.dtype, keeps_master: bool,
                        moments_dtype: torch.dtype, isa: str | None = None) -> CompactStep | None:
    """The compact-state kernel of adamw_compact.c for these dtypes (moments: fp32, bf16, or
    uint8 for 8-bit blocks), or None where there is none; ``isa`` as native_step's."""
    return _native_compact_step(grad_dtype, weights_dtype, keeps_master, moments_dtype,
                                kernel_isa(isa))


@functools.cache
def _native_compact_step(grad_dtype: torch.dtype, weights_dtype: torch.dtype,
                         keeps_master: bool, moments_dtype: torch.dtype,
                         isa: str) -> CompactStep | None:
    library = _library(isa)
    moments = {torch.float32: "f32", torch.bfloat16: "bf16", torch.uint8: "q8"}[moments_dtype]
    name = (f"compact_g{_NAMES.get(grad_dtype)}_w{_NAMES.get(weights_dtype)}_"
            f"p{'f32' if keeps_master else 'bf16'}_m{moments}")
    if library is None or not hasattr(library, name):
        return None
    function = getattr(library, name)
    function.argtypes = ([ctypes.c_void_p] * 6 + [ctypes.c_int64] * 2
                         + [ctypes.c_void_p] * 2 + [ctypes.c_int]
                         + [ctypes.c_uint32, ctypes.c_int])
    function.restype = None

    def step(master, weights_in, grad, exp_avg, exp_avg_sq, weights_out, first, bounds,
             run_scalars, key) -> None:
        function(0 if master is None else master.data_ptr(), weights_in.data_ptr(),
                 grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
                 weights_out.data_ptr(), grad.numel(), first, bounds.data_ptr(),
                 run_scalars.data_ptr(), bounds.numel() - 1, key,
                 torch.get_num_threads())

    return step


def kernel_isa(isa: str | None = None) -> str:
    """``isa``, else $TIERED_KERNEL_ISA, else ``native``: checked to be one this CPU runs."""
    chosen = isa or os.environ.get(ISA_ENV) or "native"
    if chosen not in INSTRUCTION_SETS:
        raise ValueError(f"{ISA_ENV}={chosen!r}: the kernels build for "
                         f"{', '.join(INSTRUCTION_SETS)}")
    if not runs_here(chosen):
        raise ValueError(f"{ISA_ENV}={chosen!r}: this CPU lacks "
                         f"{', '.join(sorted(_NEEDS[chosen] - _cpu_flags()))}, which it needs")
    return chosen


def runs_here(isa: str) -> bool:
    """Whether this CPU runs code built for ``isa``."""
    if isa == "native":
        return True
    return platform.machine() in ("x86_64", "AMD64") and _NEEDS[isa] <= _cpu_flags()


@functools.cache
def _library(isa: str) -> ctypes.CDLL | None:
    """The library built for ``isa``, loaded once per process; None (with a warning) where it
    cannot be built."""
    try:
        return ctypes.CDLL(build(isa))
    except (OSError, subprocess.SubprocessError) as error:
        warnings.warn(f"tiered: the native AdamW kernel could not be built ({error}); the "
                      f"compiled one steps instead")
        return None


def build(isa: str) -> str:
    """The path of the library built for ``isa`` (INSTRUCTION_SETS), building it once per
    machine and compiler; whether this CPU could run it is not asked (see runs_here)."""

    compiler = shutil.which(os.environ.get("CC") or "gcc") or shutil.which("cc")
    if compiler is None:
        raise OSError("no C compiler (gcc or cc, or $CC) on PATH")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             check=True, timeout=30).stdout.splitlines()[0]
    sources = []
    for source in (*SOURCES, *HEADERS):  # the library's name changes with any of them
        with open(source, "rb") as file:
            sources.append(file.read())
    flags = (*FLAGS, *INSTRUCTION_SETS[isa], *kernel_defines())
    key = hashlib.sha256(b"\0".join([*sources, " ".join(flags).encode(), version.encode(),
                                     _cpu().encode()])).hexdigest()[:16]
    folder = os.path.join(cache_folder(), "kernels")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"adamw_one_pass-{isa}-{key}.so")
    if not os.path.exists(path):
        building = f"{path}.{os.getpid()}.tmp"
        try:
            done = subprocess.run([compiler, *flags, "-o", building, *SOURCES],
                                  capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                raise OSError(f"{os.path.basename(compiler)} failed: "
                              f"{done.stderr.strip()[-500:]}")
            os.replace(building, path)  # whole, or not there: another rank may load it now
        finally:
            if os.path.exists(building):
                os.remove(building)
    return path


@functools.cache
def _cpu_flags() -> frozenset[str]:
    """This CPU's instruction-set flags, as /proc/cpuinfo lists them (none where it cannot be
    read)."""
    return frozenset(word for line in _cpu().splitlines() if line.startswith("flags")
                     for word in line.split(":", 1)[1].split())


def _cpu() -> str:
    """What ``-march=native`` builds for: the CPU's model and instruction-set flags."""
    try:
        with open("/proc/cpuinfo") as file:
            lines = [line for line in file
                     if line.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
