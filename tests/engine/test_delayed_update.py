"""The one-step delayed update (DPU) against a plain-PyTorch reference of its exact rule.

With warm-up w: steps 1..w are ordinary; the gradient used at step w+1 is computed at theta_w;
for t >= w+2 the gradient used at step t is computed at theta_{t-2} and applied to theta_{t-1}.
"""
from __future__ import annotations

import os

import pytest
import torch

import tiered

from distributed import run_ranks
from gpt import next_token_loss
from helpers_delayed import assert_matches, batches, reference, train_engine
from helpers_models import OPTIM, make_model


@pytest.mark.parametrize("policy", ["cpu", "gpu"])
@pytest.mark.parametrize("max_grad_norm", [None, 0.5])
def test_delayed_update_follows_the_rule_one_rank(policy, max_grad_norm, tmp_path):
    state, losses = train_engine(policy, 0, 1, str(tmp_path), max_grad_norm)
    ref_state, ref_losses = reference(max_grad_norm)
    assert_matches(state, losses, ref_state, ref_losses, world=1)


def test_delayed_update_differs_from_the_ordinary_update():
    # The rule must matter on this data, or the test above would pass for a plain optimizer.
    ordinary = make_model()
    optimizer = torch.optim.AdamW(ordinary.parameters(), **OPTIM)
    for idx in batches():
        next_token_loss(ordinary(idx), idx).backward()
        optimizer.step()
        optimizer.zero_grad()
    delayed, _ = reference(None)
    assert (ordinary.state_dict()["blocks.0.fc.weight"] - delayed["blocks.0.fc.weight"]
            ).abs().max() > 1e-3


def _rank_main(rank: int, world: int, out_dir: str) -> None:
    torch.save(train_engine("cpu", rank, world, out_dir, max_grad_norm=0.5),
               os.path.join(out_dir, f"rank{rank}.pt"))


def test_delayed_update_follows_the_rule_two_ranks(tmp_path):
    run_ranks(2, _rank_main, str(tmp_path))
    ref_state, ref_losses = reference(0.5, world=2)
    for rank in range(2):
        state, losses = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert_matches(state, losses, ref_state, ref_losses, world=2)


def test_eval_finishes_the_pending_update():
    engine, optimizer = tiered.initialize(
        make_model(), "configs/cpu.yaml", compute_dtype="fp32", device="cpu",
        optimizer=dict(OPTIM, delayed_update={"enabled": True, "warmup_steps": 0}))
    idx = batches()[0]
    next_token_loss(engine(idx), idx).backward()
    optimizer.step()  # returns at once: the update runs behind
    with torch.no_grad():
        after = next_token_loss(engine.eval()(idx), idx).item()
    state = engine.full_state_dict()
    engine.close()
    # The rule's first step (a gradient at theta_0 applied to theta_0) is AdamW's own step:
    # eval must run on all of theta_1, not on the weights of before it or a mix of the two.
    model = make_model()
    before = next_token_loss(model(idx), idx)
    before.backward()
    reference = torch.optim.AdamW(model.parameters(), **OPTIM)
    reference.step()
    with torch.no_grad():
        expected = next_token_loss(model(idx), idx).item()
    assert expected != pytest.approx(before.item(), rel=1e-6)  # the step shows in the loss
    assert after == pytest.approx(expected, rel=1e-6), "eval ran on other weights than theta_1"
    assert_matches(state, [], model.state_dict(), [], world=1)


def test_fp16_overflow_under_delay_skips_that_update():
    engine, optimizer = tiered.initialize(
        make_model(), "configs/cpu.yaml", compute_dtype="fp16", device="cpu",
        loss_scale={"initial_scale": 2.0**40},
        optimizer=dict(OPTIM, delayed_update={"enabled": True, "warmup_steps": 0}))
    before = engine.full_state_dict()
    idx = batches()[0]
    engine.backward(next_token_loss(engine(idx), idx))  # 2**40 overflows fp16 gradients
    optimizer.step()
    optimizer.synchronize()
    assert optimizer.skipped_steps == 1 and engine.scaler.scale == 2.0**39
    after = engine.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "an overflowed update moved"
    engine.close()


def test_update_steps_units_in_the_order_their_gradients_arrived():
    # Backward delivers the last block first; stepping it first lets the next backward refill
    # its buffer without waiting for the whole update (see [Note: buffer hand-off]).
    engine, optimizer = tiered.initialize(
        make_model(), "configs/cpu.yaml", compute_dtype="fp32", device="cpu",
        optimizer=dict(OPTIM, delayed_update={"enabled": True, "warmup_steps": 0}))
    stepped = []
    stepper = engine.runtime.host.rank_host.stepper
    step = stepper.step
    stepper.step = lambda units, *args, **kw: (stepped.extend(units), step(units, *args, **kw))
    idx = batches()[0]
    next_token_loss(engine(idx), idx).backward()
    optimizer.step()
    optimizer.synchronize()
    arrived = [f.spec.index for f in reversed(engine.runtime.flats[:-1])] + [2]
    assert stepped == arrived == [1, 0, 2]  # block 1, block 0, then the root (embeddings)
    engine.close()
