"""Trains a small model through the node's service and SIGKILLs itself where it is told; run by
tests/service/test_reattach.py.

    python reattach_train.py OUT CASE [POINT STEP]

CASE is a key of CASES (the optimizer's settings). POINT is where the last rank dies at step
STEP (1-based): SIGKILLed ``forward`` (inside a block's forward), ``backward`` (inside the last
micro-batch's backward), ``update`` (right after ``optimizer.step()`` returned, its update
running in the service) or ``save`` (inside ``save_checkpoint``, a checkpoint being every
step's end); or ``raise``: an exception ends it at that step's start, without
``engine.close()``. The tests call :func:`train` in their own process too. A run goes on from ``optimizer.steps_taken``, as the example's ``--resume`` does,
with the data of each step drawn from its number. The model has dropout (the RNG state
matters) and BatchNorm (so do its running statistics). At the end OUT gets the parameters,
buffers and what the run saw.
"""
import json
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch import nn

import tiered  # first: it quiets torch's warning about a missing numpy

VOCAB, DIM, SEQ, BATCH, MICRO, STEPS = 32, 32, 8, 4, 2, 5
CASES = {
    "plain": {},
    "accumulation": {"accumulation_steps": MICRO},
    "delayed": {"delayed_update": {"enabled": True, "warmup_steps": 1}},
    "scheduled": {},  # a LambdaLR made after initialize, stepped after each step()
    "nvme": {"delayed_update": {"enabled": True, "warmup_steps": 1}},  # weights and states
}


def policy(case: str) -> dict:
    """The policy's arguments: nvme.yaml for the NVMe case, its files in a folder beside the
    service's (the same for a relaunch, as the policy must be), else the default."""
    if case != "nvme":
        return {}
    root = os.path.join(os.path.dirname(os.environ["TIERED_SERVICE"]), "nvme")
    os.makedirs(root, exist_ok=True)
    here = os.path.dirname(os.path.abspath(__file__))
    return {"policy": os.path.join(here, "..", "..", "configs", "nvme.yaml"),
            "nvme": {"path": root}}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, DIM), nn.GELU(), nn.Dropout(0.2)) for _ in range(3))
        self.norm = nn.BatchNorm1d(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx):
        h = self.emb(idx)
        for block in self.blocks:
            h = h + block(h)
        return self.head(self.norm(h.transpose(1, 2)).transpose(1, 2))


def batch(step: int, micro: int, rank: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + micro)
    rows = BATCH // world
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)[rank * rows:(rank + 1) * rows]


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def train(out: str, case: str, point: str | None = None, kill_step: int = 0,
          lr: float = 0.01) -> dict:
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        point = None  # a restart by torchrun (--max-restarts) runs on to the end
    torch.manual_seed(0)
    model = Net()
    engine, optimizer = tiered.initialize(
        model, device="cpu", compute_dtype="fp32",
        optimizer={"lr": lr, "weight_decay": 0.1, **CASES[case]}, **policy(case))
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    first = optimizer.steps_taken + 1
    scheduler = None
    if case == "scheduled":  # made after initialize, brought to the step it resumes at
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + s))
        for _ in range(first - 1):
            scheduler.step()
    state = {"step": first, "micro": 0}

    def in_forward(module, args):
        if point == "forward" and state["step"] == kill_step and rank == world - 1:
            die()

    def in_backward(module, args, output):
        if (point == "backward" and state["step"] == kill_step and rank == world - 1
                and state["micro"] == MICRO - 1):
            output.register_hook(lambda grad: die())

    model.blocks[1].register_forward_pre_hook(in_forward)
    model.blocks[0].register_forward_hook(in_backward)
    if point == "save":
        from tiered.checkpoint import format as checkpoint_format
        write = checkpoint_format.Writer.write

        def write_then_die(self, tensor):
            write(self, tensor)
            if state["step"] == kill_step and rank == world - 1:
                die()
        checkpoint_format.Writer.write = write_then_die
    losses = []
    for step in range(first, STEPS + 1):
        state["step"] = step
        if point == "raise" and step == kill_step and rank == world - 1:
            raise RuntimeError(f"the script fails at step {step}")
        for micro in range(MICRO):
            state["micro"] = micro
            idx = batch(step, micro, rank, world)
            logits = engine(idx)
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten()) / MICRO
            engine.backward(loss)
            losses.append(loss.item())
        optimizer.step()
        if point == "update" and step == kill_step and rank == world - 1:
            die()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad()
        if point == "save":
            engine.save_checkpoint(os.path.join(out + ".checkpoints"))
    params = engine.full_state_dict()
    info = {"reattached": engine.reattached, "first": first, "losses": losses,
            "steps_taken": optimizer.steps_taken, "last_grad_norm": optimizer.last_grad_norm}
    engine.close()
    result = {"params": params, "info": json.dumps(info)}
    if rank == 0:
        torch.save(result, out)
    return result


if __name__ == "__main__":
    train(sys.argv[1], sys.argv[2], *((sys.argv[3], int(sys.argv[4])) if len(sys.argv) > 3
                                      else ()))
