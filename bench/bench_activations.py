"""Activations in DRAM (and on NVMe) against activations on the device, side by side in one run
(issue 34).

    python bench/bench_activations.py [--dim 256 --layers 4 --seq 1024 --batch 4 --steps 6]
        [--checkpointing] [--tile TOKENS] [--nvme PATH [--nvme-dram-bytes 32MiB]]
        [--device cpu|cuda]

The example's GPT trains ``--steps`` steps under configs/cpu.yaml in fp32, once with
``activations.tier: hbm`` and once with ``dram`` (every saved tensor of at least 1 MiB in a
DRAM block of ``--dram-bytes``), alternating the two runs' steps' timings after one warm-up
step each. It prints each run's median step, the bytes of saved tensors the device kept at the
peak of the last step's forward (what the engine's probe counts), the bytes copied to DRAM a
step, and whether the two runs' weights are equal bit for bit. On a CPU the device is the
host's memory, so the copy is the whole cost and none of it overlaps; on a GPU the copies run on
the offload stream beside the compute.

``--nvme PATH`` adds a run ``nvme``: ``activations.tier: nvme`` with a DRAM block of
``--nvme-dram-bytes``, what it cannot hold written to a file under PATH (``--nvme-bytes``) and
read back in backward; it prints the bytes written to the drive a step, and whether its weights
equal the hbm run's bit for bit too.

``--tile TOKENS`` adds a run ``hbm+tiled``: the MLPs and the loss computed TOKENS tokens
at a time (tiered.ops.long_sequence), whose forward keeps neither the MLPs' intermediates nor
the logits; its weights differ from the untiled run's by the rounding of the weight gradients'
sum order, printed as the largest difference relative to the weight's largest element.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "examples"))

import tiered  # noqa: E402
from gpt import GPT  # noqa: E402


def engine_for(args, run: str):
    tier, _, tiled = run.partition("+")
    torch.manual_seed(0)
    model = GPT(args.vocab, args.dim, args.layers, max(1, args.dim // 64), max_seq=args.seq)
    model.checkpointed = args.checkpointing
    if tiled:
        model.tile_sequence(mlp_tokens=args.tile, loss_tokens=args.tile)
    activations = {"tier": tier, "dram_bytes": args.dram_bytes}
    if tier == "nvme":
        activations.update(dram_bytes=args.nvme_dram_bytes, nvme_bytes=args.nvme_bytes)
    return tiered.initialize(model, os.path.join(REPO, "configs", "cpu.yaml"),
                             compute_dtype="fp32", device=args.device, activations=activations,
                             nvme={"path": args.nvme})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--dram-bytes", default="2GiB")
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--tile", type=int, default=0,
                        help="add a run with the MLPs and loss this many tokens at a time")
    parser.add_argument("--nvme", default=None,
                        help="add a run with what a DRAM block cannot hold in a file here")
    parser.add_argument("--nvme-dram-bytes", default="32MiB")
    parser.add_argument("--nvme-bytes", default="4GiB")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
            for _ in range(args.steps + 1)]
    names = (("hbm", "dram") + (("nvme",) if args.nvme else ())
             + (("hbm+tiled",) if args.tile else ()))
    runs = {name: engine_for(args, name) for name in names}
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for step, idx in enumerate(data):
        for name, (engine, optimizer) in runs.items():  # alternating: the same load on each
            idx_here = idx.to(engine.device)
            start = time.perf_counter()
            engine(idx_here, idx_here).backward()  # the model's next-token loss
            optimizer.step()
            optimizer.zero_grad()
            optimizer.synchronize()
            if step:  # the first step of each is its warm-up
                seconds[name].append(time.perf_counter() - start)
    states = {}
    print(f"GPT dim {args.dim} x {args.layers} layers, batch {args.batch} x {args.seq} tokens, "
          f"{'checkpointed' if args.checkpointing else 'no checkpointing'}, {args.device}")
    print(f"{'activations':<12} {'s/step':>8} {'device-kept peak':>17} {'to DRAM a step':>15} "
          f"{'to NVMe a step':>15}")
    for name, (engine, _) in runs.items():
        store = engine.runtime.activations
        written = store.spill.written_bytes if store.spill is not None else 0
        states[name] = engine.full_state_dict()
        print(f"{name:<12} {statistics.median(seconds[name]):>8.3f} "
              f"{engine.runtime.probe.last_activations / 2**20:>13.1f} MiB "
              f"{store.offloaded_bytes / len(data) / 2**20:>11.1f} MiB "
              f"{written / len(data) / 2**20:>11.1f} MiB")
        engine.close()
    for name in ("dram", "nvme") if args.nvme else ("dram",):
        equal = all(torch.equal(states["hbm"][k], states[name][k]) for k in states["hbm"])
        ratio = statistics.median(seconds[name]) / statistics.median(seconds["hbm"])
        print(f"{name} / hbm step: {ratio:.3f}; weights bit for bit equal: {equal}")
    if args.tile:
        ratio = statistics.median(seconds["hbm+tiled"]) / statistics.median(seconds["hbm"])
        apart = max(((states["hbm+tiled"][k] - v).abs().max() / v.abs().max()).item()
                    for k, v in states["hbm"].items())
        print(f"hbm+tiled / hbm step: {ratio:.3f}; weights apart by at most {apart:.1e} of "
              f"their largest element")


if __name__ == "__main__":
    main()
