"""``tier: auto``'s re-plan after the first step ([Note: re-plan] in tiered/engine/replan.py):
the units the measured step shows fit move to the device, once, and the model trains as plain
PyTorch does throughout; what the step measured is what a plain model's forward keeps."""
from __future__ import annotations

import json
import os

import pytest
import torch
import yaml

import tiered
from tiered.engine.build import flat_units, forward_order, memory_plan
from tiered.launch.cli import main
from tiered.placement.plan import StateKind
from tiered.planning.activations import forward_activations
from tiered.planning.planner import MEASURED_MARGIN_SHARE, replanned_units, units_to_keep
from tiered.policy.config import Policy
from tiered.policy.kinds import Tier

from distributed import run_ranks
from gpt import next_token_loss
from helpers_models import OPTIM, assert_parity, make_model, token_batches
from helpers_placement import (AUTO, CPU, SUB_GROUP, auto_policy, mixed_budgets, placed,
                               replan_budgets, units_per_tier)
from helpers_quantized import qlora_model

STEPS = 4


def small_batches() -> list[torch.Tensor]:
    """One row a step: activations small beside the states, so the re-plan has room to move."""
    return [idx[:1].clone() for idx in token_batches(STEPS)]


def train(model, optimizer, after_step=lambda: None) -> list[float]:
    losses = []
    for idx in small_batches():
        loss = next_token_loss(model(idx), idx)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        after_step()
    return losses


def auto_engine(nvme, delayed: bool, reserve):
    nvme.mkdir()
    budgets = replan_budgets()
    budgets["hbm"]["reserve"] = reserve
    return tiered.initialize(
        make_model(), AUTO, device="cpu", compute_dtype="fp32", nvme={"path": str(nvme)},
        optimizer=dict(OPTIM, sub_group_size=SUB_GROUP,
                       delayed_update={"enabled": delayed, "warmup_steps": 1}), **budgets)


@pytest.mark.parametrize("delayed", [False, True])
def test_the_first_step_moves_what_fits_to_the_device_once_and_training_stays_exact(
        tmp_path, delayed):
    """Moved at step 1, the unit trains on as one placed on the device from the start does,
    bit for bit (its states copied, its step count with them), under either update."""
    engine, optimizer = auto_engine(tmp_path / "moved", delayed, reserve=None)
    root, second, third = placed(engine, StateKind.MASTER)  # third: dram, nvme if delayed
    assert (root, second) == ("hbm", "nvme")
    nvme_before = engine.memory_report()["nvme"]["current"]
    seen = []
    losses = train(engine, optimizer, lambda: seen.append(
        (placed(engine, StateKind.MASTER), engine.plan_report().replanned)))
    assert seen[0][1].startswith("re-planned after step 1: 1 more units kept on the device")
    assert seen == [(["hbm", "hbm", third], seen[0][1])] * STEPS  # at step 1, never again
    assert {engine.manager.tier_of(0, kind).value for kind in StateKind
            if engine.manager.has(0, kind)} == {"hbm"}
    assert engine.memory_report()["nvme"]["current"] < nvme_before  # its files are gone
    assert seen[0][1] in engine.plan_report().table()
    state = engine.full_state_dict()
    engine.close()

    placed_there, its_optimizer = auto_engine(tmp_path / "placed", delayed, reserve=0)
    assert placed(placed_there, StateKind.MASTER)[:2] == ["hbm", "hbm"]
    assert placed_there.runtime.replan is None  # an explicit reserve is kept as it is
    assert train(placed_there, its_optimizer) == losses
    expected = placed_there.full_state_dict()
    placed_there.close()
    for name, value in expected.items():
        assert torch.equal(state[name], value), name
    if not delayed:
        model = make_model()
        assert train(model, torch.optim.AdamW(model.parameters(), fused=True, **OPTIM)) == losses


def test_a_quantized_base_stays_where_placed_and_trains_on_exactly_across_the_re_plan(tmp_path):
    """A LoRA model with an nf4 base (its frozen units' records in DRAM): the re-plan moves a
    block's adapters to the device and no record (units move whole, trained ones only), and
    it trains on bit for bit as the placement it reached, given from the start."""
    policy = auto_policy(optimizer={"sub_group_size": SUB_GROUP}, params={"frozen_dtype": "nf4"})
    flats = flat_units(qlora_model(), policy, 0, 1, CPU)
    two = memory_plan(policy, CPU, flats, on_device=frozenset(forward_order(flats)[:2]))
    runs = []
    for reserve in (None, 0):  # the default reserve re-plans; none places it at once
        engine, optimizer = tiered.initialize(
            qlora_model(), AUTO, device="cpu", compute_dtype="fp32", nvme={"path": str(tmp_path)},
            params={"frozen_dtype": "nf4"}, optimizer=dict(OPTIM, sub_group_size=SUB_GROUP),
            hbm={"budget": two.needed(Tier.HBM) * 4 // 3 - 8, "reserve": reserve})
        before = placed(engine, StateKind.PARAM)
        losses = train(engine, optimizer)
        runs.append((before, engine.placement(), engine.plan_report().replanned, losses,
                     engine.full_state_dict()))
        engine.close()
    (before, after, replanned, losses, state), (given, there, _, its_losses, expected) = runs
    assert (before, given) == (["hbm", "dram"], ["hbm", "hbm"])
    assert replanned.startswith("re-planned after step 1: 1 more units kept on the device "
                                "(blocks.1)")
    assert after == there
    assert [after[name] for name in ("blocks.0 (frozen)", "blocks.1 (frozen)")] == [
        {"param": "dram"}] * 2
    assert losses == its_losses
    for name, value in expected.items():
        assert torch.equal(state[name], value), name


WORLD = 2


def rank_batches(rank: int) -> list[torch.Tensor]:
    """Rank 0 trains on one row of 4 tokens a step, rank 1 on two rows of 8: rank 1's forward
    keeps four times what rank 0's does, so each measures its own activations."""
    rows, seq = ((slice(0, 1), 4), (slice(1, 3), 8))[rank]
    return [idx[rows, :seq].clone() for idx in token_batches(STEPS)]


def two_rank_budgets() -> dict:
    """mixed_budgets' DRAM at two ranks, and an HBM budget under which, after step 1, every
    unit fits beside what rank 0's forward keeps and a sixteenth of the budget: the default
    reserve (a quarter) leaves the device only the root; rank 0 alone would move both blocks,
    rank 1 alone (its forward keeping four times as much) one. The test asserts each."""
    policy = auto_policy(optimizer={"sub_group_size": SUB_GROUP})
    flats = flat_units(make_model(), policy, 0, WORLD, CPU)
    every = memory_plan(policy, CPU, flats, on_device=frozenset(forward_order(flats)))
    idx = rank_batches(0)[0]
    room = every.needed(Tier.HBM) + forward_activations(make_model(), lambda model: model(idx))
    budget = room * MEASURED_MARGIN_SHARE // (MEASURED_MARGIN_SHARE - 1)
    while budget - budget // MEASURED_MARGIN_SHARE < room:
        budget += 1
    return {"hbm": {"budget": budget, "reserve": None}, "dram": mixed_budgets(WORLD)["dram"]}


def _replan_at_two_ranks(rank: int, world: int, out: str) -> None:
    engine, optimizer = tiered.initialize(
        make_model(), AUTO, device="cpu", compute_dtype="fp32",
        nvme={"path": os.path.join(out, "nvme")},
        optimizer=dict(OPTIM, sub_group_size=SUB_GROUP), **two_rank_budgets())
    planned, before = engine.manager.plan, placed(engine, StateKind.MASTER)
    for idx in rank_batches(rank):
        next_token_loss(engine(idx), idx).backward()
        optimizer.step()
        optimizer.zero_grad()
    measured = engine.plan_report().measured.activations
    # What this rank's own measurement alone would move: the plan it started with, re-planned.
    alone = replanned_units(planned, forward_order(engine.runtime.flats),
                            engine.manager.hbm.usage.budget, measured)
    result = {"before": before, "after": placed(engine, StateKind.MASTER), "alone": alone,
              "measured": measured, "replanned": engine.plan_report().replanned,
              "state": engine.full_state_dict()}
    engine.close()
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))


def test_ranks_that_measure_different_activations_move_the_same_units(tmp_path):
    """Each rank measures its own step, and would move its own count of units; they move the
    fewest any of them can ([Note: re-plan]: ranks plan alike, so none holds a placement its
    peers do not), and train as PyTorch does on the ranks' batches, averaged."""
    os.mkdir(tmp_path / "nvme")
    run_ranks(WORLD, _replan_at_two_ranks, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD)]
    assert ranks[0]["measured"] < ranks[1]["measured"]
    assert [len(rank["alone"]) for rank in ranks] == [2, 1]  # the ranks would not agree alone
    for rank in ranks:
        assert rank["before"] == ["hbm", "nvme", "dram"]
        assert rank["after"] == ["hbm", "hbm", "dram"], rank["replanned"]
        assert rank["replanned"].startswith("re-planned after step 1: 1 more units kept")
    model = make_model()
    reference = torch.optim.AdamW(model.parameters(), **OPTIM)
    for step in zip(*(rank_batches(rank) for rank in range(WORLD))):
        # DDP's gradient: each rank's mean over its own tokens, averaged over the ranks.
        sum(next_token_loss(model(idx), idx) for idx in step).div(WORLD).backward()
        reference.step()
        reference.zero_grad()
    for rank in ranks:
        assert_parity(rank["state"], model.state_dict())


def test_a_first_step_too_long_to_time_is_re_planned_after_by_memory(tmp_path):
    """33 micro-batches outgrow what the probe times (SPANS_PER_UNIT): the step is not
    measured, but what its forwards kept is, and the re-plan runs on it, once."""
    engine, optimizer = auto_engine(tmp_path / "nvme", False, reserve=None)
    idx = small_batches()[0]
    for step in range(2):
        for _ in range(33):
            next_token_loss(engine(idx), idx).backward()
        optimizer.step()
        optimizer.zero_grad()
        assert engine.plan_report().measured is None
        assert not engine.runtime.replan_due
        assert engine.plan_report().replanned.startswith(
            "re-planned after the first step: 1 more units kept on the device")
    assert placed(engine, StateKind.MASTER)[:2] == ["hbm", "hbm"]
    engine.close()


def test_a_step_measures_the_activations_a_plain_forward_keeps():
    """What the engine's hooks count as kept for backward is, to the byte, what autograd keeps
    for the same forward of the plain model, its parameters left out."""
    engine, optimizer = tiered.initialize(make_model(), "configs/cpu.yaml", device="cpu",
                                          compute_dtype="fp32")
    idx = token_batches(1)[0]
    for rows in (8, 2):  # the step's peak is its largest forward's
        next_token_loss(engine(idx[:rows]), idx[:rows]).backward()
    optimizer.step()
    measured = engine.plan_report().measured.activations
    engine.close()
    assert measured == forward_activations(make_model(), lambda model: model(idx)) > 0


class _Rootless(torch.nn.Module):
    """Blocks alone hold parameters (no root unit); the model's own code between them keeps
    tensors for backward too."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x)) * x  # tanh keeps its output, the product both factors
        return x


def test_what_the_model_keeps_outside_its_units_is_measured_too():
    torch.manual_seed(0)
    engine, optimizer = tiered.initialize(_Rootless(), "configs/cpu.yaml", device="cpu",
                                          compute_dtype="fp32")
    x = torch.randn(64, 32, requires_grad=True)
    engine(x).sum().backward()
    optimizer.step()
    measured = engine.plan_report().measured.activations
    engine.close()
    assert measured == forward_activations(_Rootless(), lambda model: model(x)) > 0


def test_the_count_hands_what_the_model_keeps_to_the_hooks_it_was_called_under():
    """A caller's saved-tensor hooks around the model (save_on_cpu, say) still get every
    tensor the forward keeps that is no unit's weights, with the count between them."""
    torch.manual_seed(0)
    engine, optimizer = tiered.initialize(_Rootless(), "configs/cpu.yaml", device="cpu",
                                          compute_dtype="fp32")
    x = torch.randn(64, 32, requires_grad=True)
    seen = []

    def pack(tensor):
        seen.append(tensor.shape)
        return tensor.clone()  # what a caller's hooks may hand back: another tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda packed: packed):
        engine(x).sum().backward()
    measured_grad = x.grad.clone()
    optimizer.step()
    assert len(seen) > 0 and engine.plan_report().measured.activations > 0
    engine.close()
    x.grad = None
    torch.manual_seed(0)
    _Rootless()(x).sum().backward()
    assert torch.equal(measured_grad, x.grad)


class _Attention(torch.nn.Module):
    def __init__(self, dropout: float):
        super().__init__()
        self.qkv, self.dropout = torch.nn.Linear(16, 48), dropout

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, None, self.dropout)


def test_attention_dropout_is_counted_as_each_device_keeps_it():
    """On fake tensors as on the CPU, whose fused kernels take no dropout (its math path keeps
    the weights); for a GPU as its flash kernel keeps it: as if there were none."""
    def counted(dropout: float, on_meta: bool, for_gpu: bool = False) -> int:
        torch.manual_seed(0)
        with torch.device("meta" if on_meta else "cpu"):
            model = _Attention(dropout)
        return forward_activations(model, lambda model: model(torch.ones(2, 64, 16)), for_gpu)

    assert counted(0.1, on_meta=True) == counted(0.1, on_meta=False) > counted(0.0, False)
    assert counted(0.1, on_meta=True, for_gpu=True) == counted(0.0, on_meta=False)


def test_the_re_plan_adds_units_to_the_balance_and_within_memory():
    """On synthetic measurements: memory alone moves all that fit beside the reserve; with a
    predicted step, no more than bring it within 2% of the shortest."""
    need = lambda count: 100 + 10 * count  # noqa: E731  bytes with `count` units moved
    assert units_to_keep(8, need, 200, 40, None) == 6
    assert units_to_keep(8, need, 200, 200, None) == 0
    # The CPU's share shrinks 0.1 s a unit until the forward and backward (0.5 s) bound it.
    step = lambda count: max(0.5, 1.0 - 0.1 * count)  # noqa: E731
    assert units_to_keep(8, need, 200, 40, step) == 5
    assert units_to_keep(8, need, 200, 90, step) == 1  # memory binds before the balance


def test_tiered_plan_with_the_batch_places_units_as_the_re_plan_does(tmp_path, capsys):
    """``tiered plan --batch --seq`` leaves free what that batch keeps and a sixteenth, as the
    re-plan after a step of that batch does: the same units on the device."""
    budgets = replan_budgets()
    (tmp_path / "nvme").mkdir()
    policy = Policy.from_yaml(AUTO, dict(device="cpu", compute_dtype="fp32",
                                         nvme={"path": str(tmp_path / "nvme")},
                                         optimizer=dict(OPTIM, betas=list(OPTIM["betas"]),
                                                        sub_group_size=SUB_GROUP), **budgets))
    path = tmp_path / "auto.yaml"
    path.write_text(yaml.safe_dump(policy.to_dict()))
    idx = small_batches()[0]
    assert main(["plan", "helpers_models:make_model", "--policy", str(path), "--batch",
                 str(idx.shape[0]), "--seq", str(idx.shape[1]), "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    engine, optimizer = tiered.initialize(make_model(), str(path))
    next_token_loss(engine(idx), idx).backward()
    optimizer.step()
    report = engine.plan_report()
    assert planned["batch"]["activations"] == report.measured.activations
    for kind in (StateKind.PARAM, StateKind.GRAD, StateKind.MASTER):
        assert planned["units"][kind.value] == units_per_tier(engine, kind), kind
    assert units_per_tier(engine, StateKind.MASTER)["hbm"] == 2
    held = engine.memory_report()
    for tier in ("dram", "nvme"):  # the DRAM the moved states left stays pinned, counted
        assert planned["needed"][tier] == report.to_dict()["needed"][tier] == \
            held[tier]["current"], tier
    engine.close()
