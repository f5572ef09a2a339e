"""TiledLinear on the GPU: throughput against nn.Linear, and a layer larger than the HBM budget.

    python bench/bench_tiled.py throughput [--tokens 8192 --in 8192 --out 32768 --splits 1x4]
    python bench/bench_tiled.py big [--in 32768 --out 65536 --hbm 2GiB --tokens 1024 --steps 3]

``throughput`` times forward+backward of one layer (bf16, CUDA events, median of 20 after 5
warm-ups) for nn.Linear and TiledLinear with the given in x out splits (no engine: the cost of
tiling the math itself). ``big`` trains a model around one such layer through tiered with
``tiling.max_unit_bytes`` chosen to fit the HBM budget, prints step times and the memory report
and torch's peak of device memory (both must stay within the budget), then shows that the
untiled layer does not fit.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch
from torch import nn

import tiered
from tiered.core.sizes import format_size, parse_size


def time_fwd_bwd(layer: nn.Module, x: torch.Tensor, repeats: int = 20) -> float:
    upstream = torch.randn(*x.shape[:-1], layer.out_features, device=x.device, dtype=x.dtype)
    times = []
    for i in range(repeats + 5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        layer(x).backward(upstream)
        end.record()
        torch.cuda.synchronize()
        if i >= 5:
            times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def throughput(args) -> dict:
    in_splits, out_splits = (int(v) for v in args.splits.split("x"))
    x = torch.randn(args.tokens, args.in_features, device="cuda", dtype=torch.bfloat16,
                    requires_grad=True)
    linear = nn.Linear(args.in_features, args.out_features, device="cuda", dtype=torch.bfloat16)
    tiled = tiered.TiledLinear(args.in_features, args.out_features, True, in_splits, out_splits,
                               device="cuda", dtype=torch.bfloat16)
    flops = 6 * args.tokens * args.in_features * args.out_features
    result = {"tile_shape": [-(-args.out_features // out_splits),
                             -(-args.in_features // in_splits)]}
    for name, layer in (("nn.Linear", linear), ("TiledLinear", tiled)):
        seconds = time_fwd_bwd(layer, x)
        result[name] = {"s": seconds, "TFLOPS": flops / seconds / 1e12}
    result["ratio"] = result["TiledLinear"]["TFLOPS"] / result["nn.Linear"]["TFLOPS"]
    return result


class AroundOneLayer(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.big = nn.Linear(in_features, out_features)

    def forward(self, x):
        return self.big(x)


def big(args) -> dict:
    budget = parse_size(args.hbm)
    max_unit = budget // 16  # the working set holds about a dozen units' worth at once
    policy = dict(compute_dtype="bf16", hbm={"budget": budget},
                  tiling={"max_unit_bytes": max_unit})
    with tiered.init(policy):
        model = AroundOneLayer(args.in_features, args.out_features)
    engine, optimizer = tiered.initialize(model)
    times = []
    # The layer as it sits inside a network: its output's gradient comes from above (a loss
    # computed here in fp32 over 65536 outputs would alone hold 5 x 4 bytes per output).
    upstream = torch.randn(args.tokens, args.out_features, device="cuda", dtype=torch.bfloat16)
    for _ in range(args.steps):
        x = torch.randn(args.tokens, args.in_features, device="cuda", dtype=torch.bfloat16)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        engine(x).backward(upstream)
        optimizer.step()
        optimizer.zero_grad()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    report = engine.memory_report()
    allocated_peak = torch.cuda.max_memory_allocated()  # everything, initialize() included
    tiles = len(model.big.tiles)
    engine.close()
    untiled_fits = True
    try:
        with tiered.init(dict(policy, tiling={"max_unit_bytes": None})):
            plain = AroundOneLayer(args.in_features, args.out_features)
        tiered.initialize(plain)[0].close()
    except tiered.BudgetError as error:
        untiled_fits = False
        untiled_error = str(error)
    return {"tiles": tiles, "max_unit_bytes": max_unit, "step_s": times, "memory": report,
            "engine_hbm_peak_within_budget": report["hbm"]["peak"] <= budget,
            "torch_max_memory_allocated": allocated_peak,
            "all_device_memory_within_budget": allocated_peak <= budget,
            "untiled_fits": untiled_fits,
            "untiled_error": None if untiled_fits else untiled_error,
            "budget": format_size(budget)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["throughput", "big"])
    parser.add_argument("--in", dest="in_features", type=int, default=None)
    parser.add_argument("--out", dest="out_features", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--splits", default="1x4", help="in_splits x out_splits")
    parser.add_argument("--hbm", default="2GiB")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    if args.what == "throughput":
        args.in_features, args.out_features = args.in_features or 8192, args.out_features or 32768
        args.tokens = args.tokens or 8192
        print(json.dumps(throughput(args)))
    else:
        args.in_features, args.out_features = args.in_features or 32768, args.out_features or 65536
        args.tokens = args.tokens or 1024
        print(json.dumps(big(args)))


if __name__ == "__main__":
    main()
