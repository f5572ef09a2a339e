"""Frozen parameters (``requires_grad=False``) as PyTorch treats them: no gradient is computed
for them, the optimizer never steps them (no weight decay, no moments) and the gradient norm
leaves them out. The model freezes the tied embedding (a root parameter under two names), all
of block 0 (a unit with nothing to train, which the gradient still crosses on its way to the
position table) and two parameters of block 1 (partly frozen: two units, units.split_frozen)."""
from __future__ import annotations

import os

import pytest
import torch

import tiered
from tiered.engine.flat import Residency

from distributed import run_ranks
from helpers import REPO
from helpers_frozen import (assert_same_states, engine_for, frozen_model, is_frozen, resumed,
                            torch_changing_midway, train, train_reference)
from helpers_models import (MICRO, OPTIM, CheckpointedGPT, assert_parity, assert_parity_on_host,
                            batches, torch_groups, train_torch)


@pytest.mark.parametrize("accumulation_steps", [None, MICRO])
@pytest.mark.parametrize("policy", ["cpu", "nvme", "gpu"])
def test_frozen_parameters_train_bit_for_bit_as_torch(policy, accumulation_steps, tmp_path):
    engine, optimizer = engine_for(policy, str(tmp_path), accumulation_steps=accumulation_steps)
    state = train(engine, optimizer)
    engine.close()
    reference = train_reference()
    initial = frozen_model().state_dict()
    for name in reference:
        assert torch.equal(state[name], reference[name]), name
        assert torch.equal(state[name], initial[name]) == is_frozen(name), name


@pytest.mark.parametrize("policy", ["cpu", "nvme"])
def test_the_gradient_norm_leaves_frozen_parameters_out(policy, tmp_path):
    engine, optimizer = engine_for(policy, str(tmp_path), max_grad_norm=0.5)
    state = train(engine, optimizer)
    engine.close()
    assert_parity(state, train_reference(max_grad_norm=0.5))


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["cpu", "gpu"])
def test_frozen_parameters_on_cuda(policy, tmp_path):
    engine, optimizer = engine_for(policy, str(tmp_path), device="cuda")
    state = train(engine, optimizer)
    engine.close()
    assert_parity_on_host(state, train_reference(device="cuda"))
    initial = frozen_model().state_dict()
    for name in initial:
        assert torch.equal(state[name].cpu(), initial[name]) == is_frozen(name), name


def train_watching_gradients(engine, optimizer) -> tuple[dict, dict[str, list[str]]]:
    """Train; also return, for the last step, the units gathered as each unit's gradient
    arrived."""
    runtime = engine.runtime
    gathered_at = {}
    reduce = runtime.reduce_grad

    def reduce_and_look(flat):
        gathered_at[flat.name] = [f.name for f in runtime.flats
                                  if f.residency is Residency.GATHERED]
        reduce(flat)

    runtime.reduce_grad = reduce_and_look
    try:
        return train(engine, optimizer), gathered_at
    finally:
        runtime.reduce_grad = reduce


def _two_ranks(rank: int, world: int, folder: str) -> None:
    states = {}
    for policy in ("cpu", "nvme"):
        engine, optimizer = engine_for(policy, folder, max_grad_norm=0.5)
        states[policy] = train(engine, optimizer, rank=rank, world=world)
        engine.close()
    torch.save(states, os.path.join(folder, f"rank{rank}.pt"))


def test_frozen_parameters_with_two_ranks(tmp_path):
    run_ranks(2, _two_ranks, str(tmp_path))
    reference = train_reference(max_grad_norm=0.5)
    initial = frozen_model().state_dict()
    for rank in range(2):
        for state in torch.load(tmp_path / f"rank{rank}.pt", weights_only=True).values():
            assert_parity(state, reference)
            assert all(torch.equal(state[name], initial[name]) for name in initial
                       if is_frozen(name))


def test_a_unit_with_nothing_to_train_is_released_after_its_backward(tmp_path):
    # Block 0 is gathered again in backward (the position table's gradient crosses it). With
    # no gradient hook of its own it used to stay gathered until the backward's end; it must
    # be gone before the root's gradient, the last of the backward, arrives.
    engine, optimizer = engine_for("cpu", str(tmp_path))
    try:
        _, gathered_at = train_watching_gradients(engine, optimizer)
    finally:
        engine.close()
    assert "blocks.0" not in gathered_at  # no gradient of its own
    assert list(gathered_at)[-1] == "<root>"
    assert "blocks.0" not in gathered_at["<root>"]


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_frozen_units_under_activation_checkpointing(use_reentrant, tmp_path, monkeypatch):
    # Reentrant checkpointing runs the forward without grad and recomputes it inside
    # backward: the frozen block must still be released after its backward there.
    monkeypatch.setattr(CheckpointedGPT, "use_reentrant", use_reentrant)
    model = frozen_model()
    model.__class__ = CheckpointedGPT
    engine, optimizer = tiered.initialize(model, os.path.join(REPO, "configs", "cpu.yaml"),
                                          compute_dtype="fp32", device="cpu", optimizer=OPTIM)
    try:
        state, gathered_at = train_watching_gradients(engine, optimizer)
    finally:
        engine.close()
    assert "blocks.0" not in gathered_at["<root>"]
    reference = train_reference()  # without checkpointing: the same arithmetic
    for name in reference:
        assert torch.equal(state[name], reference[name]), name


class InPlaceBlock(torch.nn.Module):
    """Scales its input in place before its layer: legal in PyTorch on a non-leaf input."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 8)

    def forward(self, x):
        x.mul_(2)
        return self.layer(x)


def test_a_frozen_unit_may_change_its_input_in_place():
    def model():
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(8, 8), InPlaceBlock(), InPlaceBlock())
        net[1].requires_grad_(False)
        return net

    x = torch.randn(4, 8)
    reference = model()
    reference_optimizer = torch.optim.AdamW(reference.parameters(), fused=True, **OPTIM)
    engine, optimizer = tiered.initialize(model(), os.path.join(REPO, "configs", "cpu.yaml"),
                                          compute_dtype="fp32", device="cpu", optimizer=OPTIM)
    try:
        for net, opt in ((reference, reference_optimizer), (engine, optimizer)):
            for _ in range(2):
                net(x).square().sum().backward()
                opt.step()
                opt.zero_grad()
        state = engine.full_state_dict()
    finally:
        engine.close()
    for name, value in reference.state_dict().items():
        assert torch.equal(state[name], value), name


@pytest.mark.parametrize("delayed", [False, True])
@pytest.mark.parametrize("policy", ["cpu", "nvme"])
def test_bf16_frozen_weights_stay_what_they_were(policy, delayed, tmp_path):
    # The weights the forward computes with: bf16 copies of the fp32 masters, written by the
    # CPU update through a staging buffer (nvme) and into the delayed update's second buffer.
    engine, optimizer = engine_for(
        policy, str(tmp_path), compute_dtype="bf16",
        delayed_update={"enabled": delayed, "warmup_steps": 1})
    seen = {}
    model = engine.module
    model.blocks[0].fc.register_forward_hook(
        lambda module, args, out: seen.__setitem__("blocks.0.fc.weight", module.weight.clone()))
    model.blocks[1].fc.register_forward_hook(
        lambda module, args, out: seen.__setitem__("blocks.1.fc.bias", module.bias.clone()))
    train(engine, optimizer, steps=slice(4))
    engine(batches()[0][0])  # a forward after the last update
    state = engine.full_state_dict()
    engine.close()
    initial = frozen_model().state_dict()
    for name, weights in seen.items():
        assert torch.equal(weights, initial[name].bfloat16()), name
    for name in initial:
        assert torch.equal(state[name], initial[name]) == is_frozen(name), name


def test_resume_may_unfreeze_a_unit_that_never_stepped(tmp_path):
    # Block 0, frozen for two steps, trains from the third as PyTorch trains it once
    # requires_grad is set again: its moments start at step 1, the others' go on.
    ckpt = str(tmp_path / "ckpt")
    engine, optimizer = engine_for("cpu", str(tmp_path))
    train(engine, optimizer, steps=slice(2))
    engine.save_checkpoint(ckpt, "two")
    engine.close()

    def unfrozen():
        model = frozen_model()
        model.blocks[0].requires_grad_(True)
        return tiered.initialize(model, os.path.join(REPO, "configs", "cpu.yaml"),
                                 compute_dtype="fp32", device="cpu", optimizer=OPTIM)

    state = resumed(unfrozen, ckpt, steps=slice(2, None))
    assert_same_states(state, torch_changing_midway(
        lambda model: model.blocks[0].requires_grad_(True)))


def test_resume_refuses_to_unfreeze_part_of_a_unit_that_stepped(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    engine, optimizer = engine_for("cpu", str(tmp_path))
    train(engine, optimizer, steps=slice(2))
    engine.save_checkpoint(ckpt, "two")
    before = engine.full_state_dict()
    engine.close()

    model = frozen_model()
    model.blocks[1].fc.bias.requires_grad_(True)  # block 1 has stepped twice
    engine, optimizer = tiered.initialize(model, os.path.join(REPO, "configs", "cpu.yaml"),
                                          compute_dtype="fp32", device="cpu", optimizer=OPTIM)
    try:
        with pytest.raises(tiered.CheckpointError, match=r"blocks\.1\.fc\.bias of unit "
                                                         r"blocks\.1 were frozen"):
            engine.load_checkpoint(ckpt)
        untouched = engine.full_state_dict()  # nothing was loaded
        assert not torch.equal(untouched["blocks.1.fc.weight"], before["blocks.1.fc.weight"])
    finally:
        engine.close()


def test_param_groups_with_frozen_parameters(tmp_path):
    # A group of frozen parameters only is a right pattern, not one that "matches nothing";
    # a group holding frozen and trainable ones steps only the trainable ones.
    groups = [{"match": ["emb.weight"], "lr": 1.0}, {"match": ["blocks.1.*"], "lr": 3e-2}]
    engine, optimizer = engine_for("cpu", str(tmp_path), param_groups=groups)
    state = train(engine, optimizer)
    engine.close()
    model = frozen_model()
    reference = torch.optim.AdamW(torch_groups(model, groups), fused=True, **OPTIM)
    expected = train_torch(model, reference)
    for name in expected:
        assert torch.equal(state[name], expected[name]), name


def test_a_kept_input_collects_no_hooks_across_steps():
    # A frozen unit's input that is a leaf the caller keeps (a learned prompt): its hook of
    # each forward goes at the backward's end, so each backward releases the unit once.
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    net[0].requires_grad_(False)
    prompt = torch.randn(4, 8, requires_grad=True)
    engine, optimizer = tiered.initialize(net, os.path.join(REPO, "configs", "cpu.yaml"),
                                          compute_dtype="fp32", device="cpu", optimizer=OPTIM)
    releases = []
    done = engine.runtime.backward_done
    engine.runtime.backward_done = lambda flat: (releases.append(flat.name), done(flat))
    try:
        for step in range(3):
            releases.clear()
            engine(prompt).square().sum().backward()
            assert releases == ["0"], (step, releases)
            optimizer.step()
            optimizer.zero_grad()
    finally:
        engine.close()
