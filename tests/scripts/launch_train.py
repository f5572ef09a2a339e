"""Trains a small GPT for a few steps under ``tiered-launch``; run by tests/launch/test_launch.py.

    tiered-launch --policy P.yaml [--nproc-per-node N] tests/scripts/launch_train.py OUT_DIR [GO]

The policy comes from the launcher (``tiered.initialize(model)`` with no policy). Each rank trains
on its own slice of the same seeded global batch, then writes to OUT_DIR:
  init{rank}.pt   the model's state_dict before ``tiered.initialize`` (step 0)
  rank{rank}.pt   ``engine.full_state_dict()`` after training
  rank{rank}.json what the rank saw: rank, world size, OMP_NUM_THREADS, its policy, losses, and
                  the job the node's service holds its DRAM under (null without a service)
With GO (a path), each rank writes OUT_DIR/paused{rank} after its first step and waits for GO to
exist before the next: a test acts on the service while the job is live.
The engine is not closed: its NVMe run folder must go at a clean interpreter exit.
"""
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import tiered  # first: it quiets torch's warning about a missing numpy

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples"))
from gpt import GPT, next_token_loss  # noqa: E402

# Shared with the single-process reference in tests/launch/test_launch.py.
VOCAB, DIM, LAYERS, HEADS, SEQ = 64, 32, 2, 4, 16
BATCH, STEPS, SEED = 8, 3, 0


def build_model() -> GPT:
    torch.manual_seed(SEED)
    return GPT(VOCAB, DIM, LAYERS, HEADS, max_seq=SEQ, qkv_bias=False)


def global_batch(step: int) -> torch.Tensor:
    """The whole batch of a step, the same on every rank (and in the reference)."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def main() -> None:
    out = sys.argv[1]
    go = sys.argv[2] if len(sys.argv) > 2 else None
    model = build_model()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    engine, optimizer = tiered.initialize(model)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    per_rank = BATCH // world
    losses = []
    for step in range(STEPS):
        idx = global_batch(step)[rank * per_rank:(rank + 1) * per_rank].to(engine.device)
        loss = next_token_loss(engine(idx), idx)
        engine.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if go is not None and step == 0:
            open(os.path.join(out, f"paused{rank}"), "w").close()
            while not os.path.exists(go):
                time.sleep(0.05)
    state = engine.full_state_dict()
    torch.save(initial, os.path.join(out, f"init{rank}.pt"))
    torch.save(state, os.path.join(out, f"rank{rank}.pt"))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "world": world, "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                   "policy": engine.policy.to_dict(), "losses": losses,
                   "nvme_run_dir": engine.manager.nvme.run_dir if engine.manager.nvme else None,
                   "service_job": engine.service_job}, f)


if __name__ == "__main__":
    main()
