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
  what tiered runs where a C compiler is; first checked to give the compiled kernel's bits;
- ``compact: ...``: the native step with compact states (optim/compact.py; issue 21): bf16 or
  8-bit moments with the fp32 master, and with the bf16 weights as the master; their column
  "x one-pass" is against the native one-pass kernel on fp32 states, the issue's measure.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from tiered.core.report import format_table
from tiered.optim import compact
from tiered.optim.adamw import AdamWHyper, OnePassAdamW, _one_pass_scalars, adamw_step
from tiered.optim.workers import CpuWorker, optimizer_threads
from tiered.tiers.moments import PACKED, QBLOCK_BYTES, stored_numel

HYPER = AdamWHyper(1e-4, 0.9, 0.95, 1e-8, 0.1)


COMPACT = {  # name: (fp32 master kept, moments' dtype, bytes of DRAM traffic a parameter)
    "compact: moments bf16": (True, torch.bfloat16, 2 + 8 + 8 + 2),
    "compact: moments int8": (True, torch.uint8, 2 + 8 + 4 * QBLOCK_BYTES / 256 + 2),
    "compact: bf16 + master bf16": (False, torch.bfloat16, 2 + 2 + 8 + 2),
    "compact: int8 + master bf16": (False, torch.uint8, 2 + 2 + 4 * QBLOCK_BYTES / 256 + 2),
}


def states(numel: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    master = torch.randn(numel)
    data = {"master": master, "exp_avg": torch.zeros(numel), "exp_avg_sq": torch.zeros(numel),
            "grad32": torch.randn(numel) * 1e-2,
            "grad16": (torch.randn(numel) * 1e-2).bfloat16(), "weights": master.bfloat16()}
    for name, (keeps_master, dtype, _) in COMPACT.items():
        size = stored_numel(PACKED, numel) if dtype is torch.uint8 else numel
        data[f"{name} master"] = master.clone() if keeps_master else None
        data[f"{name} weights"] = master.bfloat16()
        data[f"{name} exp_avg"] = torch.zeros(size, dtype=dtype)
        data[f"{name} exp_avg_sq"] = torch.zeros(size, dtype=dtype)
    return data


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

    def compact_kernel(name: str):
        def run(s):
            weights = s[f"{name} weights"]
            compact.compact_step(s[f"{name} master"], weights, s["grad16"], s[f"{name} exp_avg"],
                                 s[f"{name} exp_avg_sq"], weights, 0,
                                 [compact.Run(0, weights.numel(), scalars)], 1)
        return run

    scalars = _one_pass_scalars(HYPER, 1.0, 1.0)
    return {"fused": (fused, 28), "fused+cast": (fused_cast, 36),
            "one-pass (inductor)": (one_pass(compiled), 28),
            "one-pass (native)": (one_pass(native), 28),
            **{name: (compact_kernel(name), nbytes) for name, (_, _, nbytes) in COMPACT.items()}}


def same_bits(runs: dict, numel: int = 1 << 20) -> bool:
    """Whether the native kernel gives the compiled one's results, bit for bit."""
    first = {key: value for key, value in states(numel).items() if " " not in key}
    results = []
    for name in ("one-pass (inductor)", "one-pass (native)"):
        data = {key: None if value is None else value.clone() for key, value in first.items()}
        runs[name][0](data)
        results.append(data)
    return all(torch.equal(results[0][key], results[1][key]) for key in
               ("master", "exp_avg", "exp_avg_sq", "weights"))


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
    fused = statistics.median(seconds["fused"])
    one_pass = statistics.median(seconds["one-pass (native)"])
    rows = [["kernel", "ms", "G params/s", "B/param", "GB/s", "x fused", "x one-pass"]]
    for name, (_, bytes_per_param) in runs.items():
        median = statistics.median(seconds[name])
        rows.append([name, f"{median * 1e3:.1f}", f"{numel / median / 1e9:.2f}",
                     f"{bytes_per_param:.1f}", f"{numel * bytes_per_param / median / 1e9:.1f}",
                     f"{fused / median:.2f}", f"{one_pass / median:.2f}"])
    print(f"{numel / 1e6:.0f} M parameters, {worker.threads} threads, median of {args.repeats}")
    print(format_table(rows))


if __name__ == "__main__":
    main()
