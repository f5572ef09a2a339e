"""A unit of frozen parameters only keeps its weights alone: no gradient, no Adam moments, no
delayed-update buffer, and fp32 master weights only where the compute dtype would round its
parameters. The model is test_frozen's: block 0 is such a unit; the root and block 1 are partly
frozen, so each is two units (units.split_frozen), a frozen half of that kind and a trained
half with every state."""
from __future__ import annotations

import os

import pytest
import torch

import tiered
from tiered.engine.build import flat_units, memory_plan
from tiered.placement.plan import StateKind, state_kinds
from tiered.policy.config import Policy
from tiered.policy.kinds import Tier
from tiered.tiers.dram import BLOCK_ALIGN

from gpt import next_token_loss
from helpers import REPO
from helpers_frozen import (assert_same_states, engine_for, frozen_model, is_frozen, resumed, train,
                            train_reference)
from helpers_models import OPTIM, batches
from helpers_tiers import dram_bytes


@pytest.mark.parametrize("model_dtype, compute_dtype, kept", [
    (torch.float32, "fp32", ["param"]),
    (torch.bfloat16, "bf16", ["param"]),
    (torch.float32, "bf16", ["param", "master"]),  # bf16 would round the fp32 weights
])
@pytest.mark.parametrize("delayed", [False, True])
def test_a_frozen_unit_keeps_its_weights_alone(model_dtype, compute_dtype, kept, delayed):
    engine, _ = engine_for("cpu", None, compute_dtype, model=frozen_model().to(model_dtype),
                          delayed_update={"enabled": delayed, "warmup_steps": 1})
    try:
        placement = engine.placement()
        every = [kind.value for kind in state_kinds(engine.policy)]
        assert list(placement["blocks.0"]) == kept
        assert list(placement["blocks.1 (frozen)"]) == kept
        assert list(placement["blocks.1"]) == every  # the trained half: all of them
        assert list(placement["<root>"]) == every
        compute = engine.policy.compute_dtype.torch_dtype
        expected = sum(dram_bytes(flat, [StateKind(k) for k in placement[flat.name]], compute)
                       for flat in engine.runtime.flats)
        assert engine.memory_report()["dram"]["current"] == expected
        frozen = engine.runtime.flats[0]
        saved = dram_bytes(frozen, state_kinds(engine.policy), compute) - dram_bytes(
            frozen, [StateKind(k) for k in kept], compute)
        assert saved >= frozen.shard_numel * (12 if "master" in kept else 16)
    finally:
        engine.close()


@pytest.mark.parametrize("policy", ["cpu", "nvme"])
def test_bf16_training_with_frozen_units_keeps_their_weights_exactly(policy, tmp_path):
    # Without masters the bf16 weights are the frozen unit's values; with fp32 parameters the
    # masters keep what bf16 would round. full_state_dict gives both back exactly.
    for model_dtype in (torch.bfloat16, torch.float32):
        initial = {name: value.float() for name, value in
                   frozen_model().to(model_dtype).state_dict().items()}
        engine, optimizer = engine_for(policy, str(tmp_path), "bf16",
                                       model=frozen_model().to(model_dtype))
        state = train(engine, optimizer)
        engine.close()
        for name in initial:
            assert torch.equal(state[name], initial[name]) == is_frozen(name), (model_dtype, name)


def test_zero_grad_to_zeros_leaves_frozen_units_out(tmp_path):
    # zero_grad(set_to_none=False) makes zeros of the gradients there are; a frozen unit has
    # none (and no buffer), as a frozen parameter's grad stays None in PyTorch.
    engine, optimizer = engine_for("cpu", None)
    try:
        for micro_batches in batches():
            for idx in micro_batches:
                (next_token_loss(engine(idx), idx) / len(micro_batches)).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
        state = engine.full_state_dict()
    finally:
        engine.close()
    for name, value in train_reference().items():
        assert torch.equal(state[name], value), name


@pytest.mark.parametrize("delayed", [False, True])
def test_resume_with_weights_only_units_is_exact(delayed, tmp_path):
    # A bf16 model trained in bf16: block 0 is saved as its bf16 weights (no masters, no
    # moments). Two steps, save, two more, against a resumed run of the same two.
    ckpt = str(tmp_path / "ckpt")
    dpu = {"enabled": delayed, "warmup_steps": 1}

    def fresh():
        return engine_for("cpu", None, "bf16", model=frozen_model().bfloat16(),
                          delayed_update=dpu)

    engine, optimizer = fresh()
    train(engine, optimizer, steps=slice(2))
    engine.save_checkpoint(ckpt, "two")
    expected = train(engine, optimizer, steps=slice(2, 4))
    engine.close()
    assert_same_states(resumed(fresh, ckpt, steps=slice(2, 4)), expected)


def test_resume_may_unfreeze_a_unit_saved_as_weights_alone(tmp_path):
    # Its masters start from the saved bf16 weights (exact: the model is bf16) and its
    # moments at zero, as a parameter that was never stepped; then it trains.
    ckpt = str(tmp_path / "ckpt")
    engine, optimizer = engine_for("cpu", None, "bf16", model=frozen_model().bfloat16())
    train(engine, optimizer, steps=slice(2))
    engine.save_checkpoint(ckpt, "two")
    saved = engine.full_state_dict()
    engine.close()

    model = frozen_model().bfloat16()
    model.blocks[0].requires_grad_(True)
    engine, optimizer = engine_for("cpu", None, "bf16", model=model)
    try:
        assert "exp_avg" in engine.placement()["blocks.0"]
        engine.load_checkpoint(ckpt)
        loaded = engine.full_state_dict()
        assert all(torch.equal(loaded[name], saved[name]) for name in saved)
        block = engine.runtime.flats[0].spec.index
        assert not engine.manager.load(block, StateKind.EXP_AVG).any()
        state = train(engine, optimizer, steps=slice(2, None))
    finally:
        engine.close()
    assert not torch.equal(state["blocks.0.fc.weight"], saved["blocks.0.fc.weight"])


@pytest.mark.parametrize("compute_dtype, frozen_kinds", [
    ("fp32", [StateKind.PARAM]), ("bf16", [StateKind.PARAM, StateKind.MASTER])])
def test_a_dram_budget_spills_a_frozen_units_weights_with_the_others(compute_dtype,
                                                                     frozen_kinds, tmp_path):
    # The spill order holds with units of weights alone: every optimizer state moves before
    # any weights do, and a frozen unit has only weights (and masters) to move. The moments'
    # staging buffers exist only where moments are on NVMe: masters alone need no stream.
    policy = Policy.from_dict(dict(device="cpu", compute_dtype=compute_dtype,
                                   nvme={"path": str(tmp_path)}, dram={"spill": "nvme"},
                                   optimizer={"sub_group_size": 1024}))
    flats = flat_units(frozen_model(), policy, 0, 1, torch.device("cpu"))
    whole = memory_plan(policy, torch.device("cpu"), flats)
    assert [kind for (unit, kind) in whole.shards if unit == 0] == frozen_kinds
    optimizer_states = (StateKind.MASTER, StateKind.EXP_AVG, StateKind.EXP_AVG_SQ)
    weights_moved = 0
    for available in range(whole.needed(Tier.DRAM), -1, -BLOCK_ALIGN):
        plan = memory_plan(policy, torch.device("cpu"), flats, dram_available=available)
        on_nvme = {key for key, buffer in plan.shards.items() if buffer.tier is Tier.NVME}
        if any(kind is StateKind.PARAM for _, kind in on_nvme):
            weights_moved += 1
            assert all(key in on_nvme for key in plan.shards if key[1] in optimizer_states)
        assert not any(kind is StateKind.GRAD for _, kind in on_nvme)
        moments = any(kind is StateKind.EXP_AVG for _, kind in on_nvme)
        assert ("exp_avg0" in plan.staging) == moments
        assert ("master0" in plan.staging) == any(k is StateKind.MASTER for _, k in on_nvme)
    assert weights_moved and (0, StateKind.PARAM) in on_nvme  # at 0 bytes, all that can move


def test_a_frozen_units_spilled_masters_train_and_export_as_in_dram(tmp_path):
    # One block's worth of DRAM short: the frozen block's fp32 masters (the largest unit)
    # move to NVMe first, alone, with no moments to stream.
    def run(budget):
        dram = {"budget": budget, "spill": "nvme"} if budget else {}
        engine, optimizer = tiered.initialize(
            frozen_model(), os.path.join(REPO, "configs", "cpu.yaml"), compute_dtype="bf16",
            device="cpu", nvme={"path": str(tmp_path)}, dram=dram,
            optimizer=dict(OPTIM, sub_group_size=1024))  # small staging beside tiny shards
        placement, needed = engine.placement(), engine.manager.plan.needed(Tier.DRAM)
        state = train(engine, optimizer)
        engine.close()
        return state, placement, needed

    expected, placement, needed = run(None)
    assert placement["blocks.0"] == {"param": "dram", "master": "dram"}
    state, placement, _ = run(needed - 1)
    assert placement["blocks.0"] == {"param": "dram", "master": "nvme"}
    assert all(tier == "dram" for name, kinds in placement.items() if name != "blocks.0"
               for tier in kinds.values())
    assert_same_states(state, expected)
