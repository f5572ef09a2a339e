"""The one-step delayed update (DPU) as its tests and their neighbours check it: a plain-PyTorch
reference of its exact rule, the engine trained under it, and their comparison.

With warm-up w: steps 1..w are ordinary; the gradient used at step w+1 is computed at theta_w;
for t >= w+2 the gradient used at step t is computed at theta_{t-2} and applied to theta_{t-1}.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch

import tiered

from gpt import next_token_loss
from helpers import REPO
from helpers_models import BATCH, OPTIM, ddp_gradients, make_model, token_batches

STEPS, WARMUP = 8, 2


def batches():
    return token_batches(STEPS)


def reference(max_grad_norm: float | None, world: int = 1):
    """theta_t after each step t, and the loss of each step, by the rule in the docstring.

    With ``world`` ranks the gradient is DDP's: the mean of the ranks' gradients, each over its
    share of the batch (summed in the same order the engine's reduction sums them, so that the
    comparison measures the rule and not the rounding of a different summation)."""
    master = make_model()
    compute = copy.deepcopy(master)
    optimizer = torch.optim.AdamW(master.parameters(), **OPTIM)
    thetas = [copy.deepcopy(master.state_dict())]
    losses = []
    for t, idx in enumerate(batches(), start=1):
        at = thetas[t - 1] if t <= WARMUP + 1 else thetas[t - 2]
        compute.load_state_dict(at)
        loss = next_token_loss(compute(idx), idx)
        grads = ddp_gradients(compute, idx, world)
        for param, grad in zip(master.parameters(), grads):
            param.grad = grad
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(master.parameters(), max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        thetas.append(copy.deepcopy(master.state_dict()))
        losses.append(loss.item())
    return thetas[-1], losses


def train_engine(policy: str, rank: int, world: int, nvme: str, max_grad_norm: float | None,
                 optimizer: dict | None = None, **overrides):
    """``optimizer``: more of its keys; ``overrides``: more policy sections (budgets, say)."""
    engine, optimizer = tiered.initialize(
        make_model(), os.path.join(REPO, "configs", f"{policy}.yaml"), compute_dtype="fp32",
        device="cpu", nvme={"path": nvme},
        optimizer=dict(OPTIM, max_grad_norm=max_grad_norm,
                       delayed_update={"enabled": True, "warmup_steps": WARMUP},
                       **(optimizer or {})), **overrides)
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    losses = []
    for idx in batches():
        loss = next_token_loss(engine(idx[rows]), idx[rows])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    state = engine.full_state_dict()  # finishes the pending update first
    engine.close()
    return state, losses


def assert_matches(state, losses, ref_state, ref_losses, world: int) -> None:
    for name in ref_state:
        torch.testing.assert_close(state[name], ref_state[name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name}: {m}")
    if world == 1:  # at two ranks each rank's loss is over its half of the batch
        for t, (ours, ref) in enumerate(zip(losses, ref_losses), start=1):
            assert ours == pytest.approx(ref, rel=1e-6), f"step {t}: forward at other weights"
