"""Starting from pretrained weights: time and peak host memory of getting a GPT's safetensors
into training, tiered against plain PyTorch, measured in one run.

    python bench/bench_load.py [--layers 8 --dim 1024] [--dtype bf16] [--nvme DIR] [--device D]

The weights are written once (``--dtype``, one file per 1 GiB, on the CPU), then each mode runs
in its own process and reports its wall time (imports excluded) and peak resident memory
(``VmHWM``); the tiered modes run on ``--device`` (a GPU when there is one), the torch mode on
the CPU, where its model and AdamW state would be before training moves them:
- ``read``: the files read end to end, nothing else (the disk or page cache's pace);
- ``torch``: the model built in fp32, ``safetensors.torch.load_file`` and
  ``model.load_state_dict``, then gradients and AdamW's moments allocated (a step at lr 0): ready
  to train, as ``tiered.initialize`` leaves a model with every tier allocated;
- ``tiered:<policy>``: the model built under ``tiered.init`` and
  ``tiered.initialize(model, weights=DIR)`` with ``configs/<policy>.yaml`` (every unit read
  into its tiers, none initialized), in fp32 compute as torch's model is (and so that no mode
  compiles the bf16 AdamW kernel, seconds that have nothing to do with loading);
- ``tiered:<policy>+init``: the same without weights (every unit initialized), the cost the
  weights replace.
The files are in the page cache after writing them: ``read`` is then DRAM's pace, and a
mode's time is what it adds to reading them.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from bench_offload import REPO, build_model  # the benchmark GPT (examples/ on the path)


def write_weights(args, folder: str) -> int:
    """Write the model's weights as sharded safetensors (via tiered's export); returns bytes."""
    import torch

    import tiered

    with tiered.init(compute_dtype="fp32", device="cpu"):
        model = build_model(args)
    engine, _ = tiered.initialize(model)
    engine.save_pretrained(folder, dtype=getattr(torch, {"bf16": "bfloat16", "fp32": "float32"}[
        args.dtype]), max_shard_bytes=1 << 30)
    engine.close()
    return sum(os.path.getsize(os.path.join(folder, name)) for name in os.listdir(folder))


def peak_rss_gb() -> float:
    """This process's peak resident memory (``ru_maxrss`` would count the parent's from before
    the exec)."""
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return kib * 1024 / 1e9


def run_mode(args) -> None:
    import torch
    if args.mode.startswith("tiered"):
        import tiered
    else:
        from safetensors.torch import load_file
    start = time.perf_counter()
    if args.mode == "read":
        for name in sorted(os.listdir(args.weights)):
            with open(os.path.join(args.weights, name), "rb") as f:
                while f.read(64 << 20):
                    pass
    elif args.mode == "torch":
        model = build_model(args)
        for name in sorted(os.listdir(args.weights)):
            if name.endswith(".safetensors"):
                model.load_state_dict(load_file(os.path.join(args.weights, name)), strict=False)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
        for param in model.parameters():
            param.grad = torch.zeros_like(param)
        optimizer.step()  # allocates the moments; lr 0 leaves the weights
    else:
        policy, _, variant = args.mode.partition(":")[2].partition("+")
        with tiered.init(os.path.join(REPO, "configs", f"{policy}.yaml"),
                         nvme={"path": args.nvme}, device=args.device, compute_dtype="fp32"):
            model = build_model(args)
        engine, _ = tiered.initialize(model, weights=None if variant == "init" else args.weights)
        engine.close()
    seconds = time.perf_counter() - start
    print(json.dumps({"mode": args.mode, "s": seconds, "peak_rss_gb": peak_rss_gb()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--nvme", default=None, help="folder for nvme policies (default: a temp)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="the tiered modes' device (auto: CUDA when there is a GPU)")
    parser.add_argument("--modes", default="read,torch,tiered:cpu,tiered:cpu+init,tiered:nvme,"
                                            "tiered:nvme+init")
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--weights", help=argparse.SUPPRESS)
    parser.set_defaults(lora=0)  # build_model's: the full model, no adapters
    args = parser.parse_args()
    if args.mode:
        run_mode(args)
        return
    with tempfile.TemporaryDirectory() as scratch:
        args.nvme = args.nvme or scratch
        folder = os.path.join(scratch, "weights")
        size = write_weights(args, folder)
        results = []
        for mode in args.modes.split(","):
            cmd = [sys.executable, __file__, "--mode", mode, "--weights", folder, "--nvme",
                   args.nvme, "--layers", str(args.layers), "--dim", str(args.dim),
                   "--device", args.device]
            out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True).stdout
            results.append(json.loads(out.strip().splitlines()[-1]))
            print(f"{mode}: {results[-1]['s']:.2f} s", file=sys.stderr, flush=True)
    by_mode = {r["mode"]: r for r in results}
    print(f"{size / 1e9:.2f} GB of {args.dtype} weights ({args.layers} x {args.dim} GPT)\n")
    print("| mode | s | GB/s of weights | peak RSS GB | x vs torch |")
    print("| --- | --- | --- | --- | --- |")
    for r in results:
        ratio = by_mode["torch"]["s"] / r["s"] if "torch" in by_mode else float("nan")
        print(f"| {r['mode']} | {r['s']:.2f} | {size / r['s'] / 1e9:.2f} | "
              f"{r['peak_rss_gb']:.2f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
