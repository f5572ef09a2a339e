"""Compact gradients: with ``accumulation_steps: 1`` bf16 (or fp16) gradients stay in bf16.

No second backward can add to a step's gradient there, so the buffer needs no fp32 width: the
grads tier holds 2 bytes per parameter less, and training is bit for bit what it is with fp32
buffers (which hold a single backward's bf16 gradient as it is, and step it with the same kernel).
"""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import tiered
from tiered.engine.build import memory_plan
from tiered.placement.plan import StateKind
from tiered.policy.config import Policy
from tiered.policy.kinds import ComputeDtype, Tier

from distributed import run_ranks
from gpt import next_token_loss
from helpers import REPO
from helpers_delayed import WARMUP
from helpers_models import BATCH, OPTIM, POLICIES, make_gpt, make_model, token_batches, train_step
from helpers_tiers import dram_block, shard_numels

STEPS = 5


@pytest.mark.parametrize("compute_dtype,accumulation_steps,grad_itemsize", [
    ("bf16", 1, 2), ("bf16", None, 4), ("bf16", 2, 4), ("fp32", 1, 4)])
def test_dram_holds_gradients_in_the_compute_dtype_only_at_one_backward_per_step(
        compute_dtype, accumulation_steps, grad_itemsize):
    model = make_gpt()
    numels = shard_numels(model)
    engine, optimizer = tiered.initialize(model, "configs/cpu.yaml", device="cpu",
                                          compute_dtype=compute_dtype,
                                          optimizer={"accumulation_steps": accumulation_steps})
    weight_itemsize = 2 if compute_dtype == "bf16" else 4
    # Per unit: compute-dtype weights, the gradient, fp32 master, exp_avg, exp_avg_sq.
    expected = sum(dram_block(n, weight_itemsize) + dram_block(n, grad_itemsize)
                   + 3 * dram_block(n, 4) for n in numels)
    for seed in range(2):
        train_step(engine, optimizer, seed)
        report = engine.memory_report()
        assert report["dram"]["current"] == report["dram"]["peak"] == expected
    engine.close()


def test_compact_gradients_save_two_bytes_per_parameter_in_plan_and_report():
    # Shards of whole 4 KiB blocks in either width (64 x 64 elements), so that block rounding
    # hides none of the difference.
    def model():
        torch.manual_seed(0)
        return nn.Sequential(*(nn.Linear(64, 64, bias=False) for _ in range(3)))

    params = sum(p.numel() for p in model().parameters())
    dram = {}
    for accumulation_steps in (None, 1):
        policy = Policy.from_dict(dict(device="cpu", compute_dtype="bf16",
                                       optimizer={"accumulation_steps": accumulation_steps}))
        engine, optimizer = tiered.initialize(model(), policy)
        engine(torch.randn(4, 64)).square().sum().backward()
        optimizer.step()
        flats = engine.runtime.flats
        plan = memory_plan(policy, torch.device("cpu"), flats)
        dram[accumulation_steps] = engine.memory_report()["dram"]["current"]
        assert dram[accumulation_steps] == plan.needed(Tier.DRAM)  # what the budget check counts
        engine.close()
    assert dram[None] - dram[1] == 2 * params


def train(policy: str, nvme: str, compute_dtype: str = "bf16", **optimizer):
    """Train for STEPS steps, zeroing the gradients with ``set_to_none=False`` after every other
    step; returns the fp32 master weights, the gradient norms and the gradient dtype."""
    engine, opt = tiered.initialize(
        make_model(), os.path.join(REPO, "configs", f"{policy}.yaml"),
        compute_dtype=compute_dtype, device="cpu", nvme={"path": nvme},
        optimizer=dict(OPTIM, **optimizer))
    norms = []
    for step, idx in enumerate(token_batches(STEPS)):
        engine.backward(next_token_loss(engine(idx), idx))
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
        norms.append(opt.last_grad_norm)
    grad_dtype = engine.manager.shards[(0, StateKind.GRAD)].dtype
    state = engine.full_state_dict()
    engine.close()
    return state, norms, grad_dtype


def assert_equal(state: dict, reference: dict) -> None:
    assert list(state) == list(reference)
    for name in reference:
        assert torch.equal(state[name], reference[name]), name


@pytest.mark.parametrize("policy,compute_dtype",
                         [*((policy, "bf16") for policy in POLICIES), ("cpu", "fp16")])
def test_compact_gradients_train_bit_for_bit_as_fp32_buffers(policy, compute_dtype, tmp_path):
    # bf16: units stepped as their gradients arrive, also onto the zeros of zero_grad(False);
    # fp16: stepped at optimizer.step(), after the overflow check read the scaled gradients.
    state, _, grad_dtype = train(policy, str(tmp_path), compute_dtype, accumulation_steps=1)
    reference, _, reference_dtype = train(policy, str(tmp_path), compute_dtype)
    assert grad_dtype is ComputeDtype(compute_dtype).torch_dtype
    assert reference_dtype is torch.float32
    assert_equal(state, reference)


def test_compact_gradients_with_the_delayed_update_and_clipping(tmp_path):
    # Both step at optimizer.step() (no stepping on arrival); clipping reads every unit's
    # gradient for the global norm first.
    delayed = dict(delayed_update={"enabled": True, "warmup_steps": WARMUP}, max_grad_norm=0.5)
    state, norms, grad_dtype = train("cpu", str(tmp_path), accumulation_steps=1, **delayed)
    reference, reference_norms, _ = train("cpu", str(tmp_path), **delayed)
    assert grad_dtype is torch.bfloat16
    assert max(reference_norms) > 0.5, "clipping never triggered"
    assert norms == reference_norms
    assert_equal(state, reference)


def test_an_fp32_view_of_a_compact_buffer_is_refused():
    engine, _ = tiered.initialize(make_gpt(), "configs/cpu.yaml", device="cpu",
                                  compute_dtype="bf16", optimizer={"accumulation_steps": 1})
    assert engine.manager.grad_buffer(0, torch.bfloat16).dtype is torch.bfloat16
    with pytest.raises(tiered.TieredError, match="compact"):
        engine.manager.grad_buffer(0, torch.float32)
    engine.close()


def _rank_main(rank: int, world: int, out_dir: str) -> None:
    grads = {}
    for accumulation_steps in (1, None):
        # With clipping no unit is stepped on arrival: the gradients wait, read here, for a step.
        engine, _ = tiered.initialize(
            make_model(), os.path.join(REPO, "configs", "cpu.yaml"), compute_dtype="bf16",
            device="cpu", optimizer=dict(OPTIM, max_grad_norm=1.0,
                                         accumulation_steps=accumulation_steps))
        idx = token_batches(1)[0][rank * BATCH // world:(rank + 1) * BATCH // world]
        next_token_loss(engine(idx), idx).backward()
        engine.runtime.worker.drain()
        host = engine.runtime.host.rank_host
        grads[accumulation_steps] = [host.read(i).clone() for i in range(len(host.held))]
        engine.close()
    torch.save(grads, os.path.join(out_dir, f"rank{rank}.pt"))


def test_two_ranks_narrow_the_fp32_mean_into_compact_gradients(tmp_path):
    run_ranks(2, _rank_main, str(tmp_path))
    for rank in range(2):
        grads = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        for compact, summed in zip(grads[1], grads[None]):
            assert (compact.dtype, summed.dtype) == (torch.bfloat16, torch.float32)
            assert torch.equal(compact, summed.to(torch.bfloat16))
