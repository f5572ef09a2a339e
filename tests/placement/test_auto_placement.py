"""``tier: auto`` (configs/auto.yaml): the planner keeps units whole on the device, stepped there,
and offloads the rest; a model stepped partly on the device and partly on the host (in DRAM, on
NVMe) trains as plain PyTorch does. On the CPU the HBM tier is host memory with a budget of its
own, and its units are stepped by the same kernels a GPU would run there (torch's fused AdamW
in fp32)."""
from __future__ import annotations

import os

import pytest
import torch

import tiered
from tiered.placement.plan import OPTIMIZER_STATES, StateKind
from tiered.policy.config import Policy

from distributed import run_ranks
from gpt import next_token_loss
from helpers import REPO
from helpers_delayed import assert_matches, reference, train_engine as train_delayed
from helpers_models import OPTIM, assert_parity, make_model, run_engine, token_batches, train_torch
from helpers_placement import AUTO, SUB_GROUP, auto_policy, mixed_budgets, placed


def mixed_engine(nvme: str, world: int = 1, **optimizer):
    engine, opt = tiered.initialize(
        make_model(), AUTO, device="cpu", compute_dtype="fp32", nvme={"path": nvme},
        optimizer=dict(OPTIM, sub_group_size=SUB_GROUP, **optimizer), **mixed_budgets(world))
    return engine, opt


def assert_mixed(engine) -> None:
    """Each unit's states sit together: the root's on the device, a block's in DRAM, the
    other's optimizer on NVMe with its weights in DRAM."""
    assert placed(engine, StateKind.MASTER) == ["hbm", "nvme", "dram"]
    assert placed(engine, StateKind.PARAM) == ["hbm", "dram", "dram"]
    assert placed(engine, StateKind.GRAD) == ["hbm", "dram", "dram"]
    for kind in OPTIMIZER_STATES:
        assert placed(engine, kind) == placed(engine, StateKind.MASTER)


def test_auto_places_a_whole_unit_so_it_is_set_for_all_three_or_none():
    with pytest.raises(tiered.PolicyError, match="set it for params, grads and optimizer alike"):
        Policy.from_dict({"params": {"tier": "auto"}})
    with pytest.raises(tiered.PolicyError, match="optimizer.tier: dram"):
        Policy.from_dict({"params": {"tier": "auto"}, "grads": {"tier": "auto"}})
    assert auto_policy().placed_by_planner and not auto_policy().uses_nvme


@pytest.mark.parametrize("accumulation_steps", [None, 2])
def test_units_stepped_on_device_dram_and_nvme_train_bit_for_bit_as_pytorch(tmp_path,
                                                                            accumulation_steps):
    """Without clipping every unit is stepped by torch's fused kernel on the gradient PyTorch
    computes, wherever it is: the same bits (stepped at optimizer.step(), or as each unit's last
    gradient arrives)."""
    engine, optimizer = mixed_engine(str(tmp_path), accumulation_steps=accumulation_steps)
    assert_mixed(engine)
    state = run_engine(engine, optimizer)
    engine.close()
    model = make_model()
    expected = train_torch(model, torch.optim.AdamW(model.parameters(), fused=True, **OPTIM))
    assert list(state) == list(expected)
    for name in expected:
        assert torch.equal(state[name], expected[name]), name


def test_mixed_placement_under_the_delayed_update_follows_its_rule(tmp_path):
    state, losses = train_delayed("auto", 0, 1, str(tmp_path), 0.5,
                                  optimizer={"sub_group_size": SUB_GROUP}, **mixed_budgets(1))
    assert_matches(state, losses, *reference(0.5), world=1)


def _two_ranks(rank: int, world: int, out: str) -> None:
    engine, optimizer = mixed_engine(os.path.join(out, "nvme"), world, max_grad_norm=0.5)
    assert_mixed(engine)
    state = run_engine(engine, optimizer, rank=rank, world=world)
    engine.close()
    torch.save(state, os.path.join(out, f"rank{rank}.pt"))


def test_two_ranks_with_mixed_placement_and_clipping(tmp_path):
    os.mkdir(tmp_path / "nvme")
    run_ranks(2, _two_ranks, str(tmp_path))
    model = make_model()
    expected = train_torch(model, torch.optim.AdamW(model.parameters(), **OPTIM), 0.5)
    for rank in range(2):
        assert_parity(torch.load(tmp_path / f"rank{rank}.pt", weights_only=True), expected)


def test_bf16_units_on_the_device_train_as_offloaded_ones():
    """On the CPU the device's units are stepped by the one-pass kernel too, so bf16 compute
    placed by the planner gives cpu.yaml's bits."""
    states = []
    for policy, hbm in ((AUTO, mixed_budgets(1, "bf16")["hbm"]),
                        (os.path.join(REPO, "configs", "cpu.yaml"), {})):
        engine, optimizer = tiered.initialize(make_model(), policy, device="cpu",
                                              optimizer=OPTIM, hbm=hbm)
        if policy == AUTO:
            assert placed(engine, StateKind.MASTER) == ["hbm", "dram", "dram"]
        states.append(run_engine(engine, optimizer))
        engine.close()
    for name in states[1]:
        assert torch.equal(states[0][name], states[1][name]), name


def test_more_device_memory_keeps_more_units_there_and_the_reserve_stays_free():
    on_device, plans = [], []
    for budget in ("500KiB", "700KiB", "1MiB", "8MiB"):
        for reserve in (0, "300KiB"):
            engine, optimizer = tiered.initialize(
                make_model(), AUTO, device="cpu", compute_dtype="fp32", optimizer=OPTIM,
                hbm={"budget": budget, "reserve": reserve})
            kept = placed(engine, StateKind.MASTER)
            # In the forward's order: a unit is on the device only if those before it are.
            assert kept == sorted(kept, key=lambda tier: tier != "hbm"), kept
            idx = token_batches(2)[0]
            for _ in range(2):
                next_token_loss(engine(idx), idx).backward()
                optimizer.step()
                optimizer.zero_grad()
            report = engine.memory_report()["hbm"]
            reserved = engine.policy.hbm.reserve
            if "hbm" in kept:  # no unit is placed into the reserve (the working set may be)
                assert report["peak"] + reserved <= report["budget"]
            on_device.append(kept.count("hbm"))
            plans.append((budget, reserve))
            engine.close()
    with_reserve, without = on_device[1::2], on_device[0::2]
    assert without == sorted(without) and without[0] < without[-1] == 3, dict(zip(plans,
                                                                                  on_device))
    assert all(r <= w for r, w in zip(with_reserve, without))
    assert with_reserve != without, "the reserve never changed the placement"


def test_a_model_the_device_holds_leaves_nothing_on_the_host():
    engine, _ = tiered.initialize(make_model(), AUTO, device="cpu", compute_dtype="fp32",
                                  optimizer=OPTIM, hbm={"budget": "8MiB", "reserve": 0})
    assert set(placed(engine, StateKind.MASTER)) == {"hbm"}
    assert engine.memory_report()["dram"]["current"] == 0  # no landing, no staging
    engine.close()


def test_a_checkpoint_moves_between_placements_bit_for_bit(tmp_path):
    """Saved with units on the device, in DRAM and on NVMe, resumed under cpu.yaml and under
    the same mixed placement: both continue as one uninterrupted PyTorch run."""
    engine, optimizer = mixed_engine(str(tmp_path))
    run_engine(engine, optimizer, steps=slice(0, 2))
    engine.save_checkpoint(str(tmp_path / "checkpoints"), "mixed")
    engine.close()
    model = make_model()
    expected = train_torch(model, torch.optim.AdamW(model.parameters(), fused=True, **OPTIM))
    cpu_yaml = os.path.join(REPO, "configs", "cpu.yaml")
    for make in (lambda: tiered.initialize(make_model(), cpu_yaml, device="cpu",
                                           compute_dtype="fp32", optimizer=OPTIM),
                 lambda: mixed_engine(str(tmp_path))):
        engine, optimizer = make()
        engine.load_checkpoint(str(tmp_path / "checkpoints"), "mixed")
        state = run_engine(engine, optimizer, steps=slice(2, None))
        engine.close()
        for name in expected:
            assert torch.equal(state[name], expected[name]), name


def test_a_dram_budget_only_a_fuller_device_leaves_room_for_is_met_by_one():
    """Keeping fewer units on the device needs more DRAM: with no NVMe to spill to, a DRAM
    budget that holds no unit is met only by keeping every unit on the device (the search once
    gave up at the first plan DRAM refused, and initialize refused the model)."""
    engine, _ = tiered.initialize(make_model(), AUTO, device="cpu", compute_dtype="fp32",
                                  optimizer=OPTIM, hbm={"budget": "8MiB", "reserve": 0},
                                  dram={"budget": 4096})
    assert placed(engine, StateKind.MASTER) == ["hbm"] * 3
    engine.close()
