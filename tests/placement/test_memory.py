"""Memory: what each tier holds equals a formula of the model's shards, and budgets hold."""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import tiered
from tiered.engine.build import memory_plan
from tiered.placement.plan import GRAD_LANDING_SLOTS
from tiered.policy.config import Policy
from tiered.policy.kinds import Tier

from gpt import GPT
from helpers_models import SEQ, make_gpt, train_step
from helpers_tiers import dram_block, shard_numels


@pytest.mark.parametrize("compute_dtype,itemsize", [("fp32", 4), ("bf16", 2)])
def test_cpu_policy_holds_exactly_the_shards_in_dram(compute_dtype, itemsize):
    model = make_gpt()
    numels = shard_numels(model)
    engine, optimizer = tiered.initialize(model, "configs/cpu.yaml", device="cpu",
                                          compute_dtype=compute_dtype)
    # Per unit: compute-dtype weights, fp32 gradient, fp32 master, exp_avg, exp_avg_sq.
    expected = sum(dram_block(n, itemsize) + 4 * dram_block(n, 4) for n in numels)
    for _ in range(2):
        train_step(engine, optimizer)
        report = engine.memory_report()
        assert report["dram"]["current"] == report["dram"]["peak"] == expected
        assert report["hbm"]["current"] == 0
        assert report["nvme"]["current"] == 0
    engine.close()


@pytest.mark.parametrize("built", ["eager", "tiered.init"])
def test_units_hold_no_gathered_storage_until_first_used(built):
    if built == "eager":
        model = make_gpt()
    else:
        with tiered.init("configs/cpu.yaml", device="cpu"):
            model = make_gpt()
    engine, optimizer = tiered.initialize(model, "configs/cpu.yaml", device="cpu",
                                          compute_dtype="bf16")
    held = {f.name: f.full.untyped_storage().nbytes() for f in engine.runtime.flats}
    assert held == {f.name: 0 for f in engine.runtime.flats}
    train_step(engine, optimizer)
    assert all(f.full.untyped_storage().nbytes() == 0 for f in engine.runtime.flats)
    engine.close()


def test_building_a_unit_counts_its_flat_copy_and_its_materialized_parameters():
    policy = Policy.from_yaml("configs/gpu.yaml").replace(device="cpu", compute_dtype="bf16")
    with tiered.init(policy):
        model = make_gpt()  # on the meta device: each unit is materialized on "hbm" in fp32
    numels = shard_numels(model)
    engine, _ = tiered.initialize(model)
    resident = sum(n * (2 + 4 + 12) for n in numels)
    building = max(f.padded_numel * 4 + f.numel * 4 for f in engine.runtime.flats)
    assert engine.memory_report()["hbm"] == {"current": resident, "peak": resident + building,
                                             "budget": engine.memory_report()["hbm"]["budget"]}
    engine.close()


def test_gpu_policy_holds_the_shards_on_the_device_and_transients_stay_in_the_plan():
    model = make_gpt()
    numels = shard_numels(model)
    policy = Policy.from_yaml("configs/gpu.yaml").replace(device="cpu", compute_dtype="bf16")
    engine, optimizer = tiered.initialize(model, policy)
    resident = sum(n * (2 + 4 + 12) for n in numels)
    assert engine.memory_report()["hbm"]["current"] == resident
    train_step(engine, optimizer)
    report = engine.memory_report()["hbm"]
    assert report["current"] == resident
    # Transients: the gathered root and the two largest blocks, and the gradients of as many
    # units as may wait for the CPU worker at once.
    full = [f.padded_numel for f in engine.runtime.flats]
    working_set = (full[-1] + sum(sorted(full[:-1])[-2:]) + GRAD_LANDING_SLOTS * max(full)) * 2
    assert resident < report["peak"] <= resident + working_set
    engine.close()


def make_wide_vocab_gpt() -> GPT:
    """Embedding and head as large as a block: units gathered through the whole forward."""
    torch.manual_seed(0)
    return GPT(2048, 32, 3, 2, max_seq=SEQ, tied=False)


@pytest.mark.parametrize("make_model", [make_gpt, make_wide_vocab_gpt])
def test_budget_exactly_the_plan_trains_and_never_passes_it(tmp_path, make_model):
    model = make_model()
    policy = Policy.from_yaml("configs/nvme.yaml", dict(
        device="cpu", compute_dtype="fp32", nvme={"path": str(tmp_path)}))
    # Find what the plan needs, then give each tier exactly that.
    probe, _ = tiered.initialize(make_model(), policy)
    whole_forward = any(f.spec.whole_forward for f in probe.runtime.flats)
    assert whole_forward == (make_model is make_wide_vocab_gpt)
    plan = probe.runtime.manager.plan
    probe.close()
    tight = policy.replace(hbm={"budget": plan.needed(Tier.HBM)},
                           dram={"budget": plan.needed(Tier.DRAM)},
                           nvme={"budget": plan.needed(Tier.NVME)})
    engine, optimizer = tiered.initialize(model, tight)
    for seed in range(3):
        train_step(engine, optimizer, seed)
    for tier, usage in engine.memory_report().items():
        assert usage["peak"] <= usage["budget"], tier
    assert engine.memory_report()["dram"]["peak"] == plan.needed(Tier.DRAM)
    assert engine.memory_report()["nvme"]["current"] == plan.needed(Tier.NVME)
    engine.close()

    # A byte short, the working set bends (see [Note: the working set bends]): one landing
    # slot, no prefetch or read-ahead; a byte short of that, it breaks.
    one_byte_short = tight.replace(hbm={"budget": plan.needed(Tier.HBM) - 1})
    with pytest.warns(UserWarning, match="without what is for speed"):
        bent, optimizer = tiered.initialize(make_model(), one_byte_short)
    lean = bent.runtime.manager.plan.needed(Tier.HBM)
    assert bent.policy.grads.landing_slots == 1 and lean < plan.needed(Tier.HBM)
    train_step(bent, optimizer, 0)
    assert bent.memory_report()["hbm"]["peak"] <= lean
    bent.close()
    with pytest.raises(tiered.BudgetError) as error:
        tiered.initialize(make_model(), tight.replace(hbm={"budget": lean - 1}))
    assert error.value.shortfalls == {"hbm": (lean, lean - 1)}
    assert os.listdir(tmp_path) == [], "a failed initialize left NVMe files behind"


def test_budget_error_names_every_tier_that_does_not_fit(tmp_path):
    with pytest.raises(tiered.BudgetError) as error:
        tiered.initialize(make_gpt(), "configs/nvme.yaml", device="cpu",
                          nvme={"path": str(tmp_path), "budget": "8KiB"},
                          dram={"budget": 4096})
    message = str(error.value)
    assert set(error.value.shortfalls) == {"dram", "nvme"}
    for tier, (needed, available) in error.value.shortfalls.items():
        assert needed > available
        assert f"{tier}: needs" in message and f"({needed} bytes)" in message
        assert f"({available} bytes) available" in message
    assert os.listdir(tmp_path) == []


class Inner(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim, dim) / dim**0.5)

    def forward(self, x):
        return torch.tanh(x @ self.weight)


class Middle(Inner):
    def __init__(self, dim: int):
        super().__init__(dim)
        self.inner = Inner(dim)

    def forward(self, x):
        return self.inner(super().forward(x))


class Outer(Middle):
    def __init__(self, dim: int):
        super().__init__(dim)
        self.middle = Middle(dim)

    def forward(self, x):
        return self.middle(super().forward(x))


def test_nested_units_fit_a_budget_of_exactly_the_plan():
    # Units three deep: an outer unit stays gathered while the units nested in it run.
    def model():
        torch.manual_seed(0)
        return nn.Sequential(Outer(64), Outer(64))

    policy = Policy.from_dict(dict(device="cpu", compute_dtype="fp32",
                                   units={"classes": ["Outer", "Middle", "Inner"]}))
    probe, _ = tiered.initialize(model(), policy)
    flats = probe.runtime.flats
    # Each Outer: itself, its Inner, its Middle and that Middle's Inner (the root has no params).
    assert [f.name for f in flats][:4] == ["0", "0.inner", "0.middle", "0.middle.inner"]
    assert len(flats) == 8
    plan = memory_plan(policy, torch.device("cpu"), flats)
    probe.close()
    engine, optimizer = tiered.initialize(model(), policy.replace(
        hbm={"budget": plan.needed(Tier.HBM)}))
    for _ in range(2):
        engine(torch.randn(4, 64, requires_grad=True)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    assert engine.memory_report()["hbm"]["peak"] <= plan.needed(Tier.HBM)
    engine.close()
