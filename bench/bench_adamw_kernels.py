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
- ``one-pass``: tiered's compiled kernel, bf16 gradient in, bf16 weights out (28 bytes);
- with ``--c-kernel``, the same step written by hand in C (bench/kernels/adamw_one_pass.c, an
  experiment for issue 21, built here with gcc), with plain and with streaming stores of the
  weights; first checked to give the compiled kernel's bits.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import tempfile
import time

import torch

from tiered.optim.adamw import AdamWHyper, OnePassAdamW, _one_pass_scalars, adamw_step
from tiered.optim.workers import CpuWorker, optimizer_threads
from tiered.report import format_table

HYPER = AdamWHyper(1e-4, 0.9, 0.95, 1e-8, 0.1)


def states(numel: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    master = torch.randn(numel)
    return {"master": master, "exp_avg": torch.zeros(numel), "exp_avg_sq": torch.zeros(numel),
            "grad32": torch.randn(numel) * 1e-2, "grad16": (torch.randn(numel) * 1e-2).bfloat16(),
            "weights": master.bfloat16()}


def c_kernel(folder: str):
    """bench/kernels/adamw_one_pass.c built for this CPU, as a ctypes function (which lets go
    of the GIL while it runs, as the compiled kernel's C++ wrapper does)."""
    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels",
                          "adamw_one_pass.c")
    library = os.path.join(folder, "adamw_one_pass.so")
    subprocess.run(["gcc", "-O3", "-march=native", "-fopenmp", "-fno-math-errno",
                    "-ffp-contract=off", "-shared", "-fPIC", "-o", library, source], check=True)
    function = ctypes.CDLL(library).adamw_one_pass_bf16
    function.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
                                                 ctypes.c_int]
    return function


def kernels(one_pass: OnePassAdamW, c_function=None, threads: int = 1):
    step = torch.ones(())

    def fused(s):
        adamw_step(s["master"], s["grad32"], s["exp_avg"], s["exp_avg_sq"], step, HYPER)

    def fused_cast(s):
        adamw_step(s["master"], s["grad16"].float(), s["exp_avg"], s["exp_avg_sq"], step, HYPER)
        s["weights"].copy_(s["master"])

    def compiled(s):
        one_pass.step(s["master"], s["grad16"], s["exp_avg"], s["exp_avg_sq"], s["weights"],
                      step, HYPER, 1.0)

    runs = {"fused": (fused, 28), "fused+cast": (fused_cast, 36), "one-pass": (compiled, 28)}
    if c_function is None:
        return runs
    scalars = _one_pass_scalars(HYPER, 1.0, 1.0)

    def by_hand(stream: int):
        def run(s):
            c_function(*(s[k].data_ptr() for k in ("master", "grad16", "exp_avg", "exp_avg_sq",
                                                    "weights")),
                       s["master"].numel(), scalars.data_ptr(), threads, stream)
        return run

    runs["C"] = (by_hand(0), 28)
    runs["C, streaming stores"] = (by_hand(1), 28)
    return runs


def same_bits(runs: dict, numel: int = 1 << 20) -> bool:
    """Whether the hand-written kernels give the compiled one's results, bit for bit."""
    first = states(numel)
    results = []
    for name in ("one-pass", "C", "C, streaming stores"):
        data = {key: value.clone() for key, value in first.items()}
        runs[name][0](data)
        results.append(data)
    return all(torch.equal(results[0][key], other[key])
               for other in results[1:] for key in first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=50e6)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--c-kernel", action="store_true",
                        help="also the hand-written C kernel (needs gcc)")
    args = parser.parse_args()
    numel = int(args.params)
    worker = CpuWorker(args.threads or optimizer_threads(
        None, drives_gpu=torch.cuda.is_available(), ranks_on_node=1))
    one_pass = OnePassAdamW()
    worker.submit(lambda: one_pass.warm_up(torch.bfloat16, torch.bfloat16))
    worker.drain()
    folder = tempfile.TemporaryDirectory()
    runs = kernels(one_pass, c_kernel(folder.name) if args.c_kernel else None, worker.threads)
    if args.c_kernel:
        checked = []
        worker.submit(lambda: checked.append(same_bits(runs)))
        worker.drain()
        print(f"the C kernel gives the compiled kernel's bits: {checked[0]}")
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
