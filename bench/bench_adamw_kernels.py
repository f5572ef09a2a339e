"""The CPU update's kernels side by side, one run, same cores: parameters per second of each
against torch's fused AdamW on fp32 gradients (issue 21).

    python bench/bench_adamw_kernels.py [--params 50e6 --repeats 7]

Every kernel steps the same ``--params`` parameters (one shard, as a unit's), on a CPU worker
with the thread count the engine gives its own (``--threads`` to set it), alternating kernel by
kernel so that the machine's drift falls on all of them alike; the median of ``--repeats``:
- ``fused``: ``torch._fused_adamw_`` on fp32 master, gradient and moments (28 bytes a parameter
  of DRAM traffic: the gradient read, the master and moments read and written), then no cast;
- ``fused+cast``: the same with the bf16 gradient widened first and the bf16 weights written
  after, what a mixed-precision step costs without the one-pass kernel (36 bytes);
- ``one-pass (inductor)``: the one-pass step as inductor compiles it, bf16 gradient in, bf16
  weights out (28 bytes);
- ``one-pass (native)``: the same step built from C for this machine (tiered/optim/native.py),
  what tiered runs where a C compiler is; first checked to give the compiled kernel's bits.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from tiered.optim.adamw import AdamWHyper, OnePassAdamW, adamw_step
from tiered.optim.workers import CpuWorker, optimizer_threads
from tiered.report import format_table

HYPER = AdamWHyper(1e-4, 0.9, 0.95, 1e-8, 0.1)


def states(numel: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    master = torch.randn(numel)
    return {"master": master, "exp_avg": torch.zeros(numel), "exp_avg_sq": torch.zeros(numel),
            "grad32": torch.randn(numel) * 1e-2, "grad16": (torch.randn(numel) * 1e-2).bfloat16(),
            "weights": master.bfloat16()}


def kernels(compiled: OnePassAdamW, native: OnePassAdamW):
    step = torch.ones(())

    def fused(s):
        adamw_step(s["master"], s["grad32"], s["exp_avg"], s["exp_avg_sq"], step, HYPER)

    def fused_cast(s):
        adamw_step(s["master"], s["grad16"].float(), s["exp_avg"], s["exp_avg_sq"], step, HYPER)
        s["weights"].copy_(s["master"])

    def one_pass(kernel: OnePassAdamW):
        def run(s):
            kernel.step(s["master"], s["grad16"], s["exp_avg"], s["exp_avg_sq"], s["weights"],
                        step, HYPER, 1.0)
        return run

    return {"fused": (fused, 28), "fused+cast": (fused_cast, 36),
            "one-pass (inductor)": (one_pass(compiled), 28),
            "one-pass (native)": (one_pass(native), 28)}


def same_bits(runs: dict, numel: int = 1 << 20) -> bool:
    """Whether the native kernel gives the compiled one's results, bit for bit."""
    first = states(numel)
    results = []
    for name in ("one-pass (inductor)", "one-pass (native)"):
        data = {key: value.clone() for key, value in first.items()}
        runs[name][0](data)
        results.append(data)
    return all(torch.equal(results[0][key], results[1][key]) for key in first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=50e6)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    numel = int(args.params)
    worker = CpuWorker(args.threads or optimizer_threads(
        None, drives_gpu=torch.cuda.is_available(), ranks_on_node=1))
    compiled, native = OnePassAdamW(native=False), OnePassAdamW()
    for kernel in (compiled, native):
        worker.submit(lambda kernel=kernel: kernel.warm_up(torch.bfloat16, torch.bfloat16))
    worker.drain()
    runs = kernels(compiled, native)
    checked = []
    worker.submit(lambda: checked.append(same_bits(runs)))
    worker.drain()
    print(f"the native kernel gives the compiled kernel's bits: {checked[0]}")
    data = states(numel)
    seconds: dict[str, list[float]] = {name: [] for name in runs}

    def timed(name: str) -> None:
        start = time.perf_counter()
        runs[name][0](data)
        seconds[name].append(time.perf_counter() - start)

    for name in runs:  # once each untimed: first touches, lazy initialisation
        worker.submit(lambda name=name: runs[name][0](data))
    for _ in range(args.repeats):
        for name in runs:
            worker.submit(lambda name=name: timed(name))
    worker.drain()
    worker.close()
    base = numel / statistics.median(seconds["fused"])
    rows = [["kernel", "ms", "G params/s", "GB/s", "x fused"]]
    for name, (_, bytes_per_param) in runs.items():
        median = statistics.median(seconds[name])
        rows.append([name, f"{median * 1e3:.1f}", f"{numel / median / 1e9:.2f}",
                     f"{numel * bytes_per_param / median / 1e9:.1f}",
                     f"{numel / median / base:.2f}"])
    print(f"{numel / 1e6:.0f} M parameters, {worker.threads} threads, median of {args.repeats}")
    print(format_table(rows))


if __name__ == "__main__":
    main()
