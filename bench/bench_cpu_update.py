"""How fast the CPU update runs alone, beside the DMA a training step does, and on huge pages.

    python bench/bench_cpu_update.py [--units 8 --unit-params 87e6 --repeats 3]

The delayed update's step on the GPU box is as long as the CPU's AdamW pass (bench/RESULTS.md),
and its per-unit time rose from about 16 ms to 20+ ms while a host-to-device copy ran. This
measures the one-pass kernel (tiered.optim.adamw, on a CPU worker with the engine's thread count)
over ``--units`` shards of ``--unit-params`` parameters, bf16 gradients and weights:
- on ordinary memory (as the DRAM tier allocates it by default: 4 KiB pages unless THP is
  "always") and on memory advised to use transparent huge pages (2 MiB), each pinned as the
  tier pins it when CUDA is present;
- alone, and while another thread copies pinned memory to the GPU (as gathers do) or back (as
  gradients leave), at whatever rate the link gives.
It prints the kernel's compile time first: run twice, the second shows whether inductor's disk
cache spares a later process the compile.
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from tiered.core.report import format_table
from tiered.optim.adamw import AdamWHyper, OnePassAdamW
from tiered.optim.workers import CpuWorker, optimizer_threads
from tiered.tiers.dram import PinnedSlabSource, huge_page_bytes

BYTES_PER_PARAM = 28
"""fp32 master and both moments read and written, the bf16 gradient read, bf16 weights written."""


def unit_states(source: PinnedSlabSource, numel: int) -> list[torch.Tensor]:
    """master, gradient, exp_avg, exp_avg_sq, weights of one unit, touched once."""
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.float32, torch.bfloat16]
    states = [source(numel * dtype.itemsize).view(dtype) for dtype in dtypes]
    for state in states:
        state.fill_(0.5)
    return states


class Copier:
    """A thread copying a pinned buffer to the GPU (or back) on a stream of its own until
    stopped: DMA traffic through DRAM, as gathers and gradient offloads make."""

    def __init__(self, direction: str, nbytes: int = 1 << 30):
        self.direction = direction
        self.source = PinnedSlabSource()
        self.host = self.source(nbytes)
        self.device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        self.copied = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._started = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.gbps = self.copied / (time.perf_counter() - self._started) / 1e9
        # Unregistered before it is freed: a later slab mapped over a still-registered range
        # fails to pin (cudaErrorHostMemoryAlreadyRegistered).
        torch.cuda.synchronize()
        self.source.release(self.host)

    def _run(self) -> None:
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            while not self._stop.is_set():
                if self.direction == "h2d":
                    self.device.copy_(self.host, non_blocking=True)
                else:
                    self.host.copy_(self.device, non_blocking=True)
                stream.synchronize()
                self.copied += self.host.numel()


def measure(worker: CpuWorker, kernel: OnePassAdamW, units: list[list[torch.Tensor]],
            repeats: int) -> float:
    """Median seconds per unit step over ``repeats`` passes over all units."""
    hyper = AdamWHyper(1e-4, 0.9, 0.95, 1e-8, 0.1)
    step = torch.ones(())
    times: list[float] = []

    def one_pass() -> None:
        for master, grad, exp_avg, exp_avg_sq, weights in units:
            start = time.perf_counter()
            kernel.step(master, grad, exp_avg, exp_avg_sq, weights, step, hyper, 1.0)
            times.append(time.perf_counter() - start)

    for _ in range(repeats):
        worker.submit(one_pass)
    worker.drain()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--units", type=int, default=8)
    parser.add_argument("--unit-params", type=float, default=87e6,
                        help="parameters per unit (a 32 x 2560 GPT's block has 78.7e6)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    numel = int(args.unit_params)
    cuda = torch.cuda.is_available()
    worker = CpuWorker(optimizer_threads(None, drives_gpu=cuda, ranks_on_node=1))
    kernel = OnePassAdamW()
    start = time.perf_counter()
    worker.submit(lambda: kernel.warm_up(torch.bfloat16, torch.bfloat16))
    worker.drain()
    from torch._dynamo.utils import counters  # whether inductor's caches served the compile

    cache = {key: value for key, value in counters["inductor"].items() if "cache" in key}
    print(f"compile s: {time.perf_counter() - start:.1f}; worker threads: {worker.threads}; "
          f"inductor cache counters: {cache}")

    rows = [["memory", "huge pages GiB", "beside", "ms per unit", "G params/s", "GB/s",
             "copy GB/s"]]
    for label, huge_pages in [("default pages", False), ("huge pages", True)]:
        source = PinnedSlabSource(huge_pages=huge_pages)
        units = [unit_states(source, numel) for _ in range(args.units)]
        # What the kernel really gave: the process's, but these units are nearly all of it.
        granted = f"{(huge_page_bytes() or 0) / 2**30:.1f}"
        for beside in ["nothing"] + (["h2d copy", "d2h copy"] if cuda else []):
            copy_gbps = ""
            if beside == "nothing":
                seconds = measure(worker, kernel, units, args.repeats)
            else:
                with Copier(beside.split()[0]) as copier:
                    seconds = measure(worker, kernel, units, args.repeats)
                copy_gbps = f"{copier.gbps:.1f}"
            rows.append([label, granted, beside, f"{seconds * 1e3:.1f}",
                         f"{numel / seconds / 1e9:.2f}",
                         f"{numel * BYTES_PER_PARAM / seconds / 1e9:.0f}", copy_gbps])
        for state in (state for unit in units for state in unit):
            source.release(state)  # unpinned before the memory goes
        del units
    print(format_table(rows))
    worker.close()


if __name__ == "__main__":
    main()
