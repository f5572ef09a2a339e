"""The largest GPT a node can train, for each way of keeping the optimizer's states (issue 21).

    python bench/bench_capacity.py [--node bench/node_h100.json --nvme-budget 64GiB]

For each setting of ``optimizer.moments`` and ``optimizer.master`` it plans (``tiered plan``'s
planner, nothing allocated) GPTs of ``examples/gpt.py`` of width ``--dim`` with more and more
layers, and reports the most that fit the node's DRAM (from ``--node``: 7/8 of it, one rank)
and ``--nvme-budget`` of disk. The placement is the most capacious one: bf16 weights and
gradients (``accumulation_steps: 1``) in DRAM, optimizer states there too, spilled to NVMe
unit by unit where DRAM lacks room (``dram.spill: nvme``).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "examples"))

from tiered.core.report import format_table  # noqa: E402
from tiered.core.sizes import format_size, parse_size  # noqa: E402
from tiered.launch.plan_model import plan_model, read_node  # noqa: E402
from tiered.planning.planner import largest_true  # noqa: E402
from tiered.policy.config import Policy  # noqa: E402
from tiered.policy.kinds import Tier  # noqa: E402

from gpt import GPT  # noqa: E402

SETTINGS = [("fp32", "fp32"), ("bf16", "fp32"), ("int8", "fp32"), ("bf16", "bf16"),
            ("int8", "bf16")]


def policy(moments: str, master: str, nvme_budget: int) -> Policy:
    return Policy.from_dict({
        "compute_dtype": "bf16", "params": {"tier": "dram"}, "grads": {"tier": "dram"},
        "optimizer": {"tier": "dram", "accumulation_steps": 1, "moments": moments,
                      "master": master},
        "dram": {"spill": "nvme"}, "nvme": {"path": "/nonexistent", "budget": nvme_budget}},
        "bench_capacity")


def fits(layers: int, args, chosen: Policy, rates) -> tuple[bool, object]:
    with torch.device("meta"):
        model = GPT(50304, args.dim, layers, args.dim // 128, max_seq=2048, tied=False)
    report = plan_model(model, chosen, 1, rates)
    ok = all(report.needed[tier] <= budget for tier, budget in report.budgets.items()
             if budget is not None)
    return ok, (sum(p.numel() for p in model.parameters()), report)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--node", default=os.path.join(REPO, "bench", "node_h100.json"))
    parser.add_argument("--nvme-budget", default="64GiB")
    parser.add_argument("--dim", type=int, default=8192)
    args = parser.parse_args()
    rates = read_node(args.node)
    nvme_budget = parse_size(args.nvme_budget)
    rows = [["moments", "master", "largest GPT", "layers", "DRAM", "NVMe"]]
    for moments, master in SETTINGS:
        chosen = policy(moments, master, nvme_budget)
        fit = lambda layers: fits(layers, args, chosen, rates)[0]  # noqa: E731
        high = 1
        while fit(high):  # doubled until it does not fit; half of it does
            high *= 2
        low = largest_true(high // 2, high - 1, fit)
        params, report = fits(low, args, chosen, rates)[1]
        rows.append([moments, master, f"{params / 1e9:.1f} B", str(low),
                     format_size(report.needed[Tier.DRAM]), format_size(report.needed[Tier.NVME])])
        print(format_table(rows), flush=True)
    print(f"width {args.dim}; DRAM {format_size(report.budgets[Tier.DRAM])} (one rank), NVMe "
          f"{format_size(nvme_budget)}")


if __name__ == "__main__":
    main()
