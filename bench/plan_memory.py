"""What a policy places in each tier for the benchmark's GPT, full training against LoRA
fine-tuning, without allocating anything (the model is built on the meta device).

    python bench/plan_memory.py [--layers 32 --dim 2560 --lora 16 --policy configs/cpu.yaml]

Rows: every parameter trained; adapters with ``units.split_frozen`` off (each block one unit,
every parameter of it with masters, moments and gradient); adapters with it on (frozen halves
keep their weights alone). The model is bf16, as fine-tuning loads one, so frozen weights need
no fp32 masters.
"""
from __future__ import annotations

import argparse
import os

import torch
from bench_offload import build_model

HERE = os.path.dirname(os.path.abspath(__file__))


def plan_row(label: str, model, policy) -> list[str]:
    from tiered.engine.build import flat_units, memory_plan
    from tiered.policy.kinds import Tier

    flats = flat_units(model, policy, 0, 1, torch.device("cpu"))
    plan = memory_plan(policy, torch.device("cpu"), flats)
    trained = sum(p.numel for f in flats for p in f.spec.params if p.trainable)
    return [label, f"{sum(f.numel for f in flats) / 1e9:.3f}", f"{trained / 1e6:,.1f}",
            f"{plan.needed(Tier.DRAM) / 1e9:.2f}", f"{plan.needed(Tier.NVME) / 1e9:.2f}",
            f"{len(flats)}"]


def main() -> None:
    from tiered.core.report import format_table
    from tiered.policy.config import resolve

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--dim", type=int, default=2560)
    parser.add_argument("--lora", type=int, default=16, help="adapter rank")
    parser.add_argument("--policy", default=os.path.join(HERE, "..", "configs", "cpu.yaml"))
    parser.add_argument("--nvme", default="/tmp", help="nvme.path, for NVMe policies")
    args = parser.parse_args()

    def model(lora: bool):
        shape = argparse.Namespace(dim=args.dim, layers=args.layers, lora=args.lora if lora else 0)
        with torch.device("meta"):
            return build_model(shape).to(torch.bfloat16)

    rows = [["model", "params G", "trained M", "DRAM GB", "NVMe GB", "units"]]
    for label, lora, split in (("full training", False, True),
                               (f"LoRA {args.lora}, split_frozen off", True, False),
                               (f"LoRA {args.lora}, split_frozen on", True, True)):
        policy = resolve(args.policy, {"nvme": {"path": args.nvme}, "compute_dtype": "bf16",
                                       "units": {"split_frozen": split}})
        rows.append(plan_row(label, model(lora), policy))
    print(f"{args.layers} x {args.dim}, {os.path.relpath(args.policy)}")
    print(format_table(rows))


if __name__ == "__main__":
    main()
