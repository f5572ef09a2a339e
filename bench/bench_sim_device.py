"""What the simulated accelerator costs (issue 31): the same steps of a small GPT under a policy,
on the plain CPU and on the simulated device with its checks on (``TIERED_DEVICE=sim``, every
operator of the training thread tracked), side by side in one process.

    python bench/bench_sim_device.py [--policy cpu] [--steps 5] [--repeats 3]

Prints the best of ``--repeats`` runs of each, their ratio and how many operators the simulated
runs checked on each stream.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "examples"))

import tiered  # noqa: E402
from tiered.device import DEVICE_ENV, simulated_device  # noqa: E402

from gpt import GPT, next_token_loss  # noqa: E402


def run(policy: str, steps: int) -> float:
    """Seconds for ``steps`` steps of a 2-layer, 32-wide GPT (initialize and close not
    counted)."""
    torch.manual_seed(0)
    engine, optimizer = tiered.initialize(
        GPT(64, 32, 2, 2, max_seq=16), os.path.join(REPO, "configs", f"{policy}.yaml"),
        compute_dtype="fp32", device="cpu", nvme={"path": tempfile.gettempdir()})
    batches = [torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(step))
               for step in range(steps)]
    start = time.perf_counter()
    for idx in batches:
        next_token_loss(engine(idx), idx).backward()
        optimizer.step()
        optimizer.zero_grad()
    engine.full_state_dict()  # the last update done
    seconds = time.perf_counter() - start
    engine.close()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--policy", default="cpu", help="a configs/ policy: cpu, nvme, gpu")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    run(args.policy, 1)  # warm: the kernels built, torch's first calls made
    plain = min(run(args.policy, args.steps) for _ in range(args.repeats))
    os.environ[DEVICE_ENV] = "sim"
    sim = simulated_device()
    with sim.tracking():
        simulated = min(run(args.policy, args.steps) for _ in range(args.repeats))
    print(f"{args.steps} steps, {args.policy}.yaml: plain {plain:.3f} s, simulated and tracked "
          f"{simulated:.3f} s ({simulated / plain:.1f}x)")
    seen: dict[str, int] = {}
    for stream in sim._streams.values():
        seen[stream.name] = seen.get(stream.name, 0) + stream.count
    print(f"operators checked in the {args.repeats} simulated runs:",
          ", ".join(f"{name} {count}" for name, count in seen.items() if count))


if __name__ == "__main__":
    main()
