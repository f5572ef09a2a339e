"""Spill by budget: what does not fit the DRAM budget moves to NVMe, unit by unit."""
from __future__ import annotations

import copy
import functools
import os

import pytest
import torch

import tiered
from tiered.placement.plan import StateKind, build_plan
from tiered.policy.config import Policy
from tiered.policy.kinds import Tier
from tiered.tiers.moments import PACKED, piece_granule
from tiered.tiers.nvme import SPARE_EXTENTS, nvme_bytes

from gpt import GPT
from helpers_models import assert_parity, make_gpt, reference_optimizer, train_both

four_blocks = functools.partial(make_gpt, 4, qkv_bias=False)


def plan_for(policy: Policy, dram_available: int | None = None, model=four_blocks):
    engine, _ = tiered.initialize(model(), policy.replace(dram={"spill": None}))
    flats = engine.runtime.flats
    args = ([f.shard_numel for f in flats], [f.padded_numel for f in flats],
            [f.spec.path for f in flats], 1)
    engine.close()
    return build_plan(policy, torch.device("cpu"), *args, dram_available=dram_available)


def spill_policy(tmp_path, **dram) -> Policy:
    # Small sub-groups: the staging stays small beside these tiny shards, and every spilled
    # shard streams through the optimizer in several pieces.
    return Policy.from_dict(dict(device="cpu", compute_dtype="fp32", nvme={"path": str(tmp_path)},
                                 dram=dict(spill="nvme", **dram),
                                 optimizer={"lr": 1e-2, "weight_decay": 0.1,
                                            "sub_group_size": 1024}))


def tiers_of(engine, kind: StateKind) -> list[str]:
    return [engine.manager.tier_of(f.spec.index, kind).value for f in engine.runtime.flats]


def test_part_of_the_optimizer_spills_and_training_matches_pytorch(tmp_path):
    everything = plan_for(spill_policy(tmp_path)).needed(Tier.DRAM)
    optimizer_bytes = sum(b.nbytes for (u, k), b in plan_for(spill_policy(tmp_path)).shards.items()
                          if k in (StateKind.MASTER, StateKind.EXP_AVG, StateKind.EXP_AVG_SQ))
    budget = everything - optimizer_bytes // 2  # about half the optimizer states must move
    model = four_blocks()
    reference = copy.deepcopy(model)
    engine, optimizer = tiered.initialize(model, spill_policy(tmp_path, budget=budget))
    masters = tiers_of(engine, StateKind.MASTER)
    assert "nvme" in masters and "dram" in masters, masters
    assert tiers_of(engine, StateKind.PARAM) == ["dram"] * len(masters)  # weights stayed
    for kind in (StateKind.EXP_AVG, StateKind.EXP_AVG_SQ):
        assert tiers_of(engine, kind) == masters  # a unit's optimizer states move together
    train_both(engine, optimizer, reference, reference_optimizer(reference), steps=4)
    assert_parity(engine.full_state_dict(), reference.state_dict())
    report = engine.memory_report()
    assert report["dram"]["peak"] <= budget
    spilled = [f.shard_numel * 4 for f in engine.runtime.flats
               if engine.manager.tier_of(f.spec.index, StateKind.MASTER) is Tier.NVME]
    assert report["nvme"]["current"] == nvme_bytes(spilled * 3)
    engine.close()


def test_weights_spill_after_the_optimizer(tmp_path):
    policy = spill_policy(tmp_path)
    plan = plan_for(policy)
    grads = sum(b.nbytes for (u, k), b in plan.shards.items() if k is StateKind.GRAD)
    params = sum(b.nbytes for (u, k), b in plan.shards.items() if k is StateKind.PARAM)
    # Room for the gradients, the staging, and a little under half the weights.
    budget = plan_for(policy, dram_available=grads + params // 2).needed(Tier.DRAM)
    model = four_blocks()
    reference = copy.deepcopy(model)
    engine, optimizer = tiered.initialize(model, spill_policy(tmp_path, budget=budget))
    assert set(tiers_of(engine, StateKind.MASTER)) == {"nvme"}
    assert "nvme" in tiers_of(engine, StateKind.PARAM)
    assert set(tiers_of(engine, StateKind.GRAD)) == {"dram"}
    train_both(engine, optimizer, reference, reference_optimizer(reference), steps=3)
    assert_parity(engine.full_state_dict(), reference.state_dict())
    assert engine.memory_report()["dram"]["peak"] <= budget
    engine.close()


def test_nothing_spills_when_dram_has_room(tmp_path):
    engine, _ = tiered.initialize(four_blocks(), spill_policy(tmp_path, budget="1GiB"))
    assert set(tiers_of(engine, StateKind.MASTER)) == {"dram"}
    assert engine.memory_report()["nvme"]["current"] == 0
    engine.close()


def test_gradients_that_do_not_fit_fail_in_initialize(tmp_path):
    with pytest.raises(tiered.BudgetError) as error:
        tiered.initialize(four_blocks(), spill_policy(tmp_path, budget=8192))
    assert "dram" in error.value.shortfalls


def test_spill_without_a_path_is_refused():
    with pytest.raises(tiered.PolicyError, match="nvme.path is required"):
        Policy.from_dict({"dram": {"spill": "nvme"}})
    with pytest.raises(tiered.PolicyError, match="spill must be null or 'nvme'"):
        Policy.from_dict({"dram": {"spill": "hbm"}, "nvme": {"path": "/tmp"}})


def test_optimizer_state_several_times_dram_trains_with_parity(tmp_path):
    # configs/nvme.yaml: weights and optimizer on NVMe; DRAM holds the fp32 gradients (4 bytes
    # a parameter against the optimizer's 12, so under 3x is the most there can be) and staging.
    def make_wider():
        torch.manual_seed(0)
        return GPT(64, 64, 8, 2, max_seq=16, tied=True, qkv_bias=False)

    policy = Policy.from_yaml("configs/nvme.yaml", dict(
        device="cpu", compute_dtype="fp32", nvme={"path": str(tmp_path)},
        optimizer={"lr": 1e-2, "weight_decay": 0.1, "sub_group_size": 1024}))
    plan = plan_for(policy, model=make_wider)
    budget = plan.needed(Tier.DRAM)
    optimizer_bytes = sum(b.nbytes for (u, k), b in plan.shards.items()
                          if k in (StateKind.MASTER, StateKind.EXP_AVG, StateKind.EXP_AVG_SQ))
    assert optimizer_bytes >= 2 * budget
    model = make_wider()
    reference = copy.deepcopy(model)
    engine, optimizer = tiered.initialize(model, policy.replace(dram={"budget": budget}))
    train_both(engine, optimizer, reference, reference_optimizer(reference), steps=4)
    assert_parity(engine.full_state_dict(), reference.state_dict())
    report = engine.memory_report()
    assert report["dram"]["peak"] <= budget
    nvme_shards = [b.nbytes for b in plan.shards.values() if b.tier is Tier.NVME]
    assert report["nvme"]["current"] == nvme_bytes(nvme_shards)
    files = [f for f in os.listdir(engine.manager.nvme.run_dir) if f.endswith(".bin")]
    sizes = sorted(os.path.getsize(os.path.join(engine.manager.nvme.run_dir, f)) for f in files)
    expected = sorted(nvme_shards + [s for s in set(nvme_shards) for _ in range(SPARE_EXTENTS)])
    assert sizes == expected
    engine.close()


@pytest.mark.parametrize("numel", [1000, 4096, (1 << 25) + 1, 87_000_000, 3 * (1 << 25)])
@pytest.mark.parametrize("dtypes", [(torch.float32,), (torch.float32, PACKED)],
                         ids=["fp32", "int8"])
def test_streamed_pieces_are_as_few_as_fit_and_nearly_equal(numel, dtypes):
    from tiered.optim.stream import unit_pieces

    granule = piece_granule(list(dtypes))
    pieces = unit_pieces(0, numel, 1 << 25, granule)
    sizes = [p.numel for p in pieces]
    assert sum(sizes) == numel and max(sizes) <= 1 << 25
    assert len(pieces) == -(-numel // (1 << 25))  # as few as the staging buffers allow
    # O_DIRECT offsets: 4 KiB of fp32, and of 8-bit blocks (1024 of 260 bytes)
    assert all(p.start % (1024 if dtypes == (torch.float32,) else 1 << 18) == 0
               for p in pieces)
    assert [p.last for p in pieces] == [False] * (len(pieces) - 1) + [True]
    assert max(sizes) - min(sizes) <= granule * len(pieces)  # no stray remainder of a few
