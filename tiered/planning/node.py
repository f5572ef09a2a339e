"""The rates that decide a training step on this node, measured once and cached (issue 20).

A step of an offloaded model is bounded by one of a few rates: the CPU's AdamW pass over the
states in DRAM, the GPU's AdamW over those it holds, the pinned copies between host and device
(each way, and both at once, which share the link), and the NVMe drive's reads and writes. The
planner predicts a step from them, so they are measured here on this node, in seconds, and kept
in the user's cache folder (``$TIERED_CACHE``, else ``$XDG_CACHE_HOME/tiered``, else
``~/.cache/tiered``) under a key naming the machine and the library versions, so that another
GPU, core count or torch measures anew; ``remeasure`` redoes it. A rate the node cannot have (no
GPU, no NVMe path given) is None.

    tiered node [--nvme PATH] [--remeasure] [--json]
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import secrets
import shutil
import statistics
import time
from dataclasses import dataclass

import torch

from ..core import progress
from ..core.limits import total_memory, usable_cores
from ..core.report import format_table
from ..core.sizes import align_up, format_size
from ..core.version import __version__, cache_folder
from ..optim.adamw import AdamWHyper, OnePassAdamW
from ..policy.config import NvmePolicy
from ..tiers import bench_io
from ..tiers.aio import IoSettings
from ..tiers.dram import BLOCK_ALIGN, PinnedSlabSource
from ..tiers.nvme import check_nvme_path

CPU_PARAMS = 1 << 23
"""Parameters of the CPU AdamW measurement (8 Mi: 128 MiB of fp32 states, past any cache)."""
GPU_PARAMS = 1 << 26
COPY_BYTES = 256 << 20
NVME_BYTES = 256 << 20
REPEATS = 5


@dataclass(frozen=True)
class NodeRates:
    """What this node moves and computes per second (see the module note)."""

    machine: str
    """The machine and library versions the rates were measured with (the cache key's text)."""
    measured_at: float
    """When (seconds since the epoch)."""
    cpu_threads: int
    cpu_adamw_params_per_s: float
    """torch's fused AdamW on fp32 states in DRAM, with ``cpu_threads`` threads: the update of
    an fp32 run."""
    cpu_one_pass_params_per_s: float
    """tiered's one-pass AdamW (bf16 gradient in, bf16 weights out, fp32 states), the same
    threads: the update of a bf16 run (optim/adamw.py)."""
    gpu_adamw_params_per_s: float | None = None
    h2d_gbps: float | None = None
    """Pinned host to device, GB/s (1e9 bytes); ``d2h_gbps`` back; ``both_gbps`` the two
    directions at once, added up."""
    d2h_gbps: float | None = None
    both_gbps: float | None = None
    nvme_path: str | None = None
    nvme_write_gbps: float | None = None
    """O_DIRECT through tiered's I/O engine at the default queue depth and block size."""
    nvme_read_gbps: float | None = None
    hbm_bytes: int | None = None
    """The device's memory (``tiered plan`` budgets HBM by it for another node)."""
    dram_bytes: int | None = None
    """The node's memory (limits.total_memory: the host's, capped by its cgroups' limits)."""

    def table(self) -> str:
        def rate(value, unit):
            return "-" if value is None else f"{value:.3g} {unit}"

        rows = [("rate", "value"),
                ("CPU AdamW, fp32 (torch's fused)", rate(self.cpu_adamw_params_per_s / 1e9,
                                                         "G params/s")
                 + f" ({self.cpu_threads} threads)"),
                ("CPU AdamW, bf16 (one pass)", rate(self.cpu_one_pass_params_per_s / 1e9,
                                                    "G params/s")),
                ("GPU AdamW", rate(self.gpu_adamw_params_per_s and
                                   self.gpu_adamw_params_per_s / 1e9, "G params/s")),
                ("host to device (pinned)", rate(self.h2d_gbps, "GB/s")),
                ("device to host (pinned)", rate(self.d2h_gbps, "GB/s")),
                ("both ways at once", rate(self.both_gbps, "GB/s")),
                (f"NVMe write ({self.nvme_path or 'no path'})", rate(self.nvme_write_gbps, "GB/s")),
                ("NVMe read", rate(self.nvme_read_gbps, "GB/s")),
                ("device memory", "-" if self.hbm_bytes is None else format_size(self.hbm_bytes)),
                ("host memory", "-" if self.dram_bytes is None
                 else format_size(self.dram_bytes))]
        return f"{self.machine}\n{format_table(rows)}"


def node_rates(nvme_path: str | None = None, remeasure: bool = False, *,
               cpu_params: int = CPU_PARAMS, gpu_params: int = GPU_PARAMS,
               copy_bytes: int = COPY_BYTES, nvme_bytes: int = NVME_BYTES,
               threads: int | None = None) -> NodeRates:
    """This node's rates: from the cache when they were measured here with the same libraries
    (and NVMe path), else measured now (tens of seconds at the default sizes) and cached."""
    threads = threads or usable_cores()
    machine = _machine(threads, nvme_path)
    path = _cache_file(machine)
    if not remeasure:
        cached = _read(path, machine)
        if cached is not None:
            return cached
    with progress.phase("measuring the CPU's AdamW"):
        cpu_adamw = _cpu_adamw(cpu_params, threads)
    rates = NodeRates(machine, time.time(), threads, *cpu_adamw,
                      nvme_path=nvme_path, dram_bytes=total_memory())
    if torch.cuda.is_available():
        with progress.phase("measuring the GPU's copies and AdamW"):
            h2d, d2h, both = _copies(copy_bytes)
            gpu_adamw = _gpu_adamw(gpu_params)
        rates = dataclasses.replace(rates, gpu_adamw_params_per_s=gpu_adamw,
                                    h2d_gbps=h2d, d2h_gbps=d2h, both_gbps=both,
                                    hbm_bytes=torch.cuda.get_device_properties(
                                        torch.cuda.current_device()).total_memory)
    if nvme_path is not None:
        with progress.phase(f"measuring the drive at {nvme_path}"):
            write, read = _nvme(nvme_path, nvme_bytes)
        rates = dataclasses.replace(rates, nvme_write_gbps=write, nvme_read_gbps=read)
    _write(path, rates)
    return rates


def cached_node_rates(nvme_path: str | None = None) -> NodeRates | None:
    """The rates ``node_rates`` measured here for ``nvme_path``, if it has; never measures (an
    engine's plan report reads them: measuring takes tens of seconds). Without a path, those
    measured here with any (the newest, one with a drive's rates first): the CPU's and the
    GPU's rates are the node's whatever drive was measured beside them, and a plan that would
    fit with NVMe can then say how fast it would run."""
    threads = usable_cores()
    machine = _machine(threads, nvme_path)
    exact = _read(_cache_file(machine), machine)
    if exact is not None or nvme_path is not None:
        return exact
    try:
        names = sorted(os.listdir(cache_folder()))
    except OSError:
        return None
    here = []
    for name in names:
        if name.startswith("node-") and name.endswith(".json"):
            rates = _read(os.path.join(cache_folder(), name), None)
            if rates is not None and rates.machine == _machine(threads, rates.nvme_path):
                here.append(rates)
    return max(here, key=lambda rates: (rates.nvme_read_gbps is not None, rates.measured_at),
               default=None)


@dataclass(frozen=True)
class NodeMemory:
    """The memory of the node a plan is for: its device's (None: no GPU) and its host's."""

    hbm_bytes: int | None
    dram_bytes: int | None
    of: str
    """Whose: this node's, or a node file's."""


def this_node_memory() -> NodeMemory:
    """This node's memory, as ``tiered node`` records it: the same figures each time (the GPU's
    total memory, the host's capped by its cgroups'), not what is free at the moment."""
    hbm = (torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
           if torch.cuda.is_available() else None)
    return NodeMemory(hbm, total_memory(), "this node's")


def _cache_file(machine: str) -> str:
    return os.path.join(cache_folder(),
                        f"node-{hashlib.sha256(machine.encode()).hexdigest()[:16]}.json")


def _machine(threads: int, nvme_path: str | None) -> str:
    """What the rates depend on, as text: the cache's key."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next((line.split(":", 1)[1].strip() for line in info
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    nvme = os.path.realpath(nvme_path) if nvme_path else "no NVMe path"
    return (f"{platform.node()}: {cpu}, {threads} threads, {gpu}, {nvme}; torch "
            f"{torch.__version__}, tiered {__version__}")


def _read(path: str, machine: str | None) -> NodeRates | None:
    """The rates cached in ``path`` if measured on ``machine`` (None: on any)."""
    try:
        with open(path) as file:
            values = json.load(file)
        rates = NodeRates(**values)
    except (OSError, ValueError, TypeError):  # none, unreadable, or of another version's form
        return None
    return rates if machine is None or rates.machine == machine else None


def _write(path: str, rates: NodeRates) -> None:
    """Written aside and renamed: a reader sees the old file or the new one, whole."""
    staged = f"{path}.{secrets.token_hex(4)}"
    with open(staged, "w") as file:
        json.dump(dataclasses.asdict(rates), file, indent=1)
    os.replace(staged, path)


def _median_seconds(run, repeats: int = REPEATS, synchronize=lambda: None) -> float:
    run()  # warm-up: first touch, kernel selection
    synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _adamw_seconds(params: int, device: str, synchronize=lambda: None) -> float:
    weights = torch.zeros(params, device=device, requires_grad=True)
    weights.grad = torch.full_like(weights, 1e-3)
    optimizer = torch.optim.AdamW([weights], lr=1e-4, fused=True)
    return _median_seconds(optimizer.step, synchronize=synchronize)


def _cpu_adamw(params: int, threads: int) -> tuple[float, float]:
    """Parameters a second of torch's fused AdamW (fp32) and of the one-pass kernel (bf16
    gradient and weights), with ``threads`` threads."""

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fused = params / _adamw_seconds(params, "cpu")
        kernel = OnePassAdamW()
        kernel.warm_up(torch.bfloat16, torch.bfloat16)  # compiled here, not timed
        states = [torch.zeros(params) for _ in range(3)]
        grad = torch.full((params,), 1e-3, dtype=torch.bfloat16)
        weights = torch.empty(params, dtype=torch.bfloat16)
        hyper = AdamWHyper(1e-4, 0.9, 0.999, 1e-8, 0.0)
        step = torch.ones(())
        one_pass = params / _median_seconds(
            lambda: kernel.step(states[0], grad, states[1], states[2], weights, step, hyper,
                                1.0))
        return fused, one_pass
    finally:
        torch.set_num_threads(before)


def _gpu_adamw(params: int) -> float:
    return params / _adamw_seconds(params, "cuda", torch.cuda.synchronize)


def _copies(nbytes: int) -> tuple[float, float, float]:
    """Pinned host <-> device GB/s: each way alone, then both at once on two streams."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_back = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    device_out = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    sync = torch.cuda.synchronize
    h2d = nbytes / _median_seconds(lambda: device.copy_(host, non_blocking=True), synchronize=sync)
    d2h = nbytes / _median_seconds(lambda: host_back.copy_(device_out, non_blocking=True),
                                   synchronize=sync)
    up, down = torch.cuda.Stream(), torch.cuda.Stream()

    def both():
        with torch.cuda.stream(up):
            device.copy_(host, non_blocking=True)
        with torch.cuda.stream(down):
            host_back.copy_(device_out, non_blocking=True)

    both_seconds = _median_seconds(both, synchronize=sync)
    return h2d / 1e9, d2h / 1e9, 2 * nbytes / both_seconds / 1e9


def _nvme(path: str, nbytes: int) -> tuple[float, float]:
    """The I/O engine's write and read GB/s at its default settings, as ``tiered bench-io``
    measures them, in a folder of its own under ``path``, removed afterwards."""

    check_nvme_path(path)
    folder = os.path.join(path, f"tiered-node-{secrets.token_hex(3)}")
    os.mkdir(folder, 0o700)
    source = PinnedSlabSource()
    buffer = source(min(align_up(nbytes, BLOCK_ALIGN), bench_io.TRANSFER_BYTES))
    try:
        defaults = NvmePolicy()
        settings = IoSettings(defaults.block_size, defaults.queue_depth)
        point = bench_io.measure(folder, "node", settings, nbytes, buffer)
    finally:
        source.release(buffer)
        shutil.rmtree(folder, ignore_errors=True)
    return point.write_gbps, point.read_gbps
