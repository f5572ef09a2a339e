"""Rank 1 fails after ``tiered.initialize`` while rank 0 is still running; run by
tests/launch/test_launch.py under ``tiered-launch --nproc-per-node 2``.

    tiered-launch --nproc-per-node 2 --policy P.yaml --nvme DIR tests/scripts/launch_fail_rank1.py

torchrun then stops rank 0 with SIGTERM. Both ranks hold an NVMe run folder at that point; rank 1
must remove its own on the way out of its exception, rank 0 on SIGTERM (which tiered turns into
a clean exit). Rank 0 sleeps in short, interruptible naps, at most SLEEP_S in all, so a rank that
ignored SIGTERM shows up as a slow run (torchrun waits 30 s before SIGKILL) with a folder left.
"""
import os
import sys
import time

import torch
import torch.distributed as dist

import tiered  # first: it quiets torch's warning about a missing numpy

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples"))
from gpt import GPT  # noqa: E402

SLEEP_S = 120


def main() -> None:
    torch.manual_seed(0)
    model = GPT(64, 32, 2, 4, max_seq=16)
    engine, _ = tiered.initialize(model)
    rank = dist.get_rank()
    assert engine.manager.nvme is not None and os.path.isdir(engine.manager.nvme.run_dir)
    dist.barrier()  # both ranks' NVMe folders exist now
    if rank == 1:
        raise RuntimeError("launch_fail_rank1: rank 1 fails on purpose after initialize")
    deadline = time.monotonic() + SLEEP_S
    while time.monotonic() < deadline:
        time.sleep(0.1)
    print("launch_fail_rank1: rank 0 was never stopped", file=sys.stderr)


if __name__ == "__main__":
    main()
