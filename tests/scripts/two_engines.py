"""Two engines open at once in each rank's process (a DPO reference model beside its policy, a
notebook that builds again before closing), under ``tiered-launch``; run by
tests/service/test_service_launch.py.

    tiered-launch --policy P.yaml [--nproc-per-node N] tests/scripts/two_engines.py OUT_DIR

Both engines are built from launch_train.py's model and trained on its batches, their steps
interleaved, so each must end where PyTorch does alone: an engine that stepped on the other's
memory would not. Each rank writes OUT_DIR/first{rank}.pt and second{rank}.pt
(``full_state_dict()``) and OUT_DIR/jobs{rank}.json (the jobs the service holds them under).
"""
import json
import os
import sys

import torch
import torch.distributed as dist

import tiered  # first: it quiets torch's warning about a missing numpy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from launch_train import BATCH, STEPS, build_model, global_batch  # noqa: E402

from gpt import next_token_loss  # noqa: E402 (launch_train put examples/ on the path)


def main() -> None:
    out = sys.argv[1]
    engines = [tiered.initialize(build_model()) for _ in range(2)]
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    per_rank = BATCH // world
    for step in range(STEPS):
        idx = global_batch(step)[rank * per_rank:(rank + 1) * per_rank]
        for engine, optimizer in engines:
            loss = next_token_loss(engine(idx.to(engine.device)), idx.to(engine.device))
            engine.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    for (engine, _), name in zip(engines, ["first", "second"]):
        torch.save(engine.full_state_dict(), os.path.join(out, f"{name}{rank}.pt"))
    with open(os.path.join(out, f"jobs{rank}.json"), "w") as f:
        json.dump([engine.service_job for engine, _ in engines], f)
    for engine, _ in engines:
        engine.close()


if __name__ == "__main__":
    main()
