"""The one-step delayed update (DPU) at its edges, against plain-PyTorch references of its rule
(docs/how-it-works.md, Optimizer): an LR scheduler and param groups under it, gradients kept across steps
(the next backward must not overwrite them before the update has read them), and fp16's loss
scale when the pending update is finished between a backward and its step."""
from __future__ import annotations

import copy
import os
import time

import pytest
import torch

import tiered
from tiered.optim.stepper import UnitStepper

from gpt import next_token_loss
from helpers import REPO, run_with_deadline
from helpers_models import GROUPS, OPTIM, SCHEDULES, make_model, token_batches, torch_groups

STEPS = 7


def dpu_reference(warmup: int, steps: int = STEPS, groups=None, schedules=None,
                  max_grad_norm: float | None = None, set_to_none: bool = True):
    """theta after ``steps`` steps of the DPU rule (warm-up ``warmup``), with torch's AdamW
    (fused, as the engine's kernel), an optional LambdaLR stepped after each optimizer step."""
    master = make_model()
    compute = copy.deepcopy(master)
    params = torch_groups(master, groups) if groups is not None else master.parameters()
    optimizer = torch.optim.AdamW(params, fused=True, **OPTIM)
    for group in optimizer.param_groups:
        group["betas"] = tuple(group["betas"])
    scheduler = (torch.optim.lr_scheduler.LambdaLR(optimizer, schedules)
                 if schedules is not None else None)
    thetas = [copy.deepcopy(master.state_dict())]
    for t, idx in enumerate(token_batches(steps), start=1):
        compute.load_state_dict(thetas[t - 1] if t <= warmup + 1 else thetas[t - 2])
        grads = torch.autograd.grad(next_token_loss(compute(idx), idx),
                                    list(compute.parameters()))
        for param, grad in zip(master.parameters(), grads):
            param.grad = grad.clone()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(master.parameters(), max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
        if scheduler is not None:
            scheduler.step()
        thetas.append(copy.deepcopy(master.state_dict()))
    return thetas[-1]


def dpu_engine(warmup: int, policy: str = "cpu", nvme: str | None = None, **optimizer):
    return tiered.initialize(
        make_model(), os.path.join(REPO, "configs", f"{policy}.yaml"), compute_dtype="fp32",
        device="cpu", nvme={"path": nvme},
        optimizer=dict(OPTIM, delayed_update={"enabled": True, "warmup_steps": warmup},
                       **optimizer))


def run_dpu(engine, optimizer, steps: int = STEPS, schedules=None,
            set_to_none: bool = True) -> dict:
    scheduler = (torch.optim.lr_scheduler.LambdaLR(optimizer, schedules)
                 if schedules is not None else None)
    for idx in token_batches(steps):
        next_token_loss(engine(idx), idx).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
        if scheduler is not None:
            scheduler.step()
    state = engine.full_state_dict()
    engine.close()
    return state


def assert_same(state: dict, reference: dict) -> None:
    assert list(state) == list(reference)
    for name in reference:
        torch.testing.assert_close(state[name], reference[name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("warmup", [0, 1])
def test_dpu_with_lr_scheduler_uses_the_lr_of_its_step_call(warmup, tmp_path):
    engine, optimizer = dpu_engine(warmup, nvme=str(tmp_path))
    state = run_dpu(engine, optimizer, schedules=[SCHEDULES[0]])
    assert_same(state, dpu_reference(warmup, schedules=[SCHEDULES[0]]))


@pytest.mark.parametrize("policy", ["nvme"])
def test_dpu_with_param_groups_and_schedules(policy, tmp_path):
    engine, optimizer = dpu_engine(1, policy, str(tmp_path), param_groups=GROUPS)
    state = run_dpu(engine, optimizer, schedules=SCHEDULES)
    assert_same(state, dpu_reference(1, groups=GROUPS, schedules=SCHEDULES))


def fp16_dpu_run(synchronize_before_step: bool):
    """fp16 under the delayed update, the loss scale growing after every good update (so that
    finishing each update changes it): the norms of the updates and the weights."""
    engine, optimizer = tiered.initialize(
        make_model(), "configs/cpu.yaml", compute_dtype="fp16", device="cpu",
        loss_scale={"initial_scale": 2.0**8, "growth_interval": 1},
        optimizer=dict(OPTIM, delayed_update={"enabled": True, "warmup_steps": 0}))
    norms = []
    for idx in token_batches(5):
        engine.backward(next_token_loss(engine(idx), idx))
        if synchronize_before_step:
            optimizer.synchronize()  # finishes the previous update, which grows the scale
        optimizer.step()
        optimizer.zero_grad()
        norms.append(optimizer.last_grad_norm)
    state = engine.full_state_dict()
    engine.close()
    return norms, state


def test_synchronize_between_backward_and_step_keeps_the_gradients_loss_scale():
    # The backward of step t+1 runs at the scale from before update t; finishing update t
    # early (synchronize(), engine.eval(), full_state_dict()) moves when it ends, not the
    # scale those gradients are unscaled by: the run must be the one without it, bit for bit.
    # (Before the fix, step() unscaled by the grown scale: every norm came out halved.)
    norms, state = fp16_dpu_run(synchronize_before_step=False)
    synced_norms, synced_state = fp16_dpu_run(synchronize_before_step=True)
    assert synced_norms == norms
    assert all(torch.equal(synced_state[k], state[k]) for k in state)


def dpu_reference_schedule(schedule) -> dict:
    """The DPU rule (warm-up 0) in PyTorch with gradients kept across steps as torch keeps
    them: ``schedule`` is, per step, whether a backward runs and what follows the step:
    ``None`` (no zero_grad), ``"none"`` (zero_grad()) or ``"zeros"`` (set_to_none=False)."""
    master = make_model()
    compute = copy.deepcopy(master)
    optimizer = torch.optim.AdamW(master.parameters(), fused=True, **OPTIM)
    thetas = [copy.deepcopy(master.state_dict())]
    for t, ((backward, zero), idx) in enumerate(zip(schedule, token_batches(len(schedule))),
                                               start=1):
        if backward:
            compute.load_state_dict(thetas[max(t - 2, 0)])
            grads = torch.autograd.grad(next_token_loss(compute(idx), idx),
                                        list(compute.parameters()))
            for param, grad in zip(master.parameters(), grads):
                param.grad = grad.clone() if param.grad is None else param.grad + grad
        optimizer.step()
        if zero is not None:
            optimizer.zero_grad(set_to_none=zero == "none")
        thetas.append(copy.deepcopy(master.state_dict()))
    return thetas[-1]


SCHEDULES_ACROSS_STEPS = {
    # step 2's gradient adds onto step 1's (no zero_grad between), then zero_grad()
    "accumulated across steps": [(True, None), (True, "none"), (True, "none"), (True, "none")],
    # step 2 applies the zeros of zero_grad(set_to_none=False), then zero_grad()
    "zeros applied": [(True, "zeros"), (False, "none"), (True, "none"), (True, "none")],
}


@pytest.mark.parametrize("name", list(SCHEDULES_ACROSS_STEPS))
def test_dpu_reads_gradients_kept_across_steps_before_the_next_backward_overwrites_them(
        name, monkeypatch):
    # Slow every unit's step (as test_failures does) so that backward catches up with the
    # update: the next backward must wait for the buffer, whatever put the gradient there.
    kernel = UnitStepper._kernel

    def slow_kernel(self, *args):
        time.sleep(0.05)
        return kernel(self, *args)

    monkeypatch.setattr(UnitStepper, "_kernel", slow_kernel)
    schedule = SCHEDULES_ACROSS_STEPS[name]

    def train() -> dict:
        engine, optimizer = dpu_engine(0)
        for (backward, zero), idx in zip(schedule, token_batches(len(schedule))):
            if backward:
                next_token_loss(engine(idx), idx).backward()
            optimizer.step()
            if zero is not None:
                optimizer.zero_grad(set_to_none=zero == "none")
        state = engine.full_state_dict()
        engine.close()
        return state

    assert_same(run_with_deadline(train), dpu_reference_schedule(schedule))
