"""Frozen parameters (``requires_grad=False``) as PyTorch treats them: no gradient is computed
for them, the optimizer never steps them (no weight decay, no moments) and the gradient norm
leaves them out. The model freezes the tied embedding (a root parameter under two names), all
of block 0 (a unit with nothing to train, which the gradient still crosses on its way to the
position table) and two parameters of block 1 (a unit partly frozen)."""
from __future__ import annotations

import os

import pytest
import torch

import tiered
from gpt import next_token_loss
from test_parity import MICRO, OPTIM, REPO, assert_parity, batches, make_model, train_torch
from tiered.engine.flat import Residency

FROZEN = ("emb.weight", "head.weight", "blocks.0.", "blocks.1.fc.bias", "blocks.1.ln1.weight")


def frozen_model():
    model = make_model()
    for name, param in model.named_parameters(remove_duplicate=False):
        if name.startswith(FROZEN):
            param.requires_grad_(False)
    return model


def is_frozen(name: str) -> bool:
    return name.startswith(FROZEN)


def engine_for(policy: str, nvme: str, compute_dtype="fp32", device="cpu", **optimizer):
    return tiered.initialize(
        frozen_model(), os.path.join(REPO, "configs", f"{policy}.yaml"),
        compute_dtype=compute_dtype, device=device, nvme={"path": nvme},
        optimizer=dict(OPTIM, sub_group_size=1024, **optimizer))


def train(engine, optimizer, steps=None) -> dict:
    for micro_batches in batches()[:steps]:
        for idx in micro_batches:
            idx = idx.to(engine.device)
            (next_token_loss(engine(idx), idx) / MICRO).backward()
        optimizer.step()
        optimizer.zero_grad()
    return engine.full_state_dict()


def train_reference(max_grad_norm=None, device="cpu") -> dict:
    model = frozen_model().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), fused=True, **OPTIM)  # skips grad=None
    return train_torch(model, optimizer, max_grad_norm, device=device)


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
    state = {name: value.cpu() for name, value in train(engine, optimizer).items()}
    engine.close()
    reference = {name: value.cpu() for name, value in train_reference(device="cuda").items()}
    assert_parity(state, reference)
    initial = frozen_model().state_dict()
    for name in initial:
        assert torch.equal(state[name], initial[name]) == is_frozen(name), name


def test_a_unit_with_nothing_to_train_is_released_after_its_backward(tmp_path):
    # Block 0 is gathered again in backward (the position table's gradient crosses it). With
    # no gradient hook of its own it used to stay gathered until the backward's end; it must
    # be gone before the root's gradient, the last of the backward, arrives.
    engine, optimizer = engine_for("cpu", str(tmp_path))
    runtime = engine.runtime
    gathered_at = {}
    reduce = runtime.reduce_grad

    def reduce_and_look(flat):
        gathered_at[flat.name] = [f.name for f in runtime.flats
                                  if f.residency is Residency.GATHERED]
        reduce(flat)

    runtime.reduce_grad = reduce_and_look
    try:
        train(engine, optimizer, steps=1)
    finally:
        engine.close()
    assert "blocks.0" not in gathered_at  # no gradient of its own
    assert list(gathered_at)[-1] == "<root>"
    assert "blocks.0" not in gathered_at["<root>"]


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
    train(engine, optimizer, steps=4)
    engine(batches()[0][0])  # a forward after the last update
    state = engine.full_state_dict()
    engine.close()
    initial = frozen_model().state_dict()
    for name, weights in seen.items():
        assert torch.equal(weights, initial[name].bfloat16()), name
    for name in initial:
        assert torch.equal(state[name], initial[name]) == is_frozen(name), name
