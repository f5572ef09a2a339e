"""The plan, shown: ``engine.plan_report()`` and the table ``initialize`` logs. Its bytes are the
plan's (what the tiers then hold), its unit counts the placement's, and its predicted step the
per-step traffic of the plan over the node's rates, checked here against the same sums written
out from the units' shard sizes."""
from __future__ import annotations

import dataclasses
import logging
import os
import time

import pytest
import torch

import tiered
from tiered.engine.probe import SPANS_PER_UNIT
from tiered.placement.plan import StateKind
from tiered.planning.node import NodeRates
from tiered.planning.report import StepTerms, step_terms
from tiered.policy.kinds import Tier
from tiered.tiers.moments import PACKED, stored_numel

from gpt import next_token_loss
from helpers import REPO
from helpers_models import OPTIM, lora_model, make_model, token_batches
from helpers_placement import SUB_GROUP, units_per_tier

RATES = NodeRates(machine="a synthetic node", measured_at=0.0, cpu_threads=2,
                  cpu_adamw_params_per_s=1e6, cpu_one_pass_params_per_s=2e6,
                  gpu_adamw_params_per_s=5e7, h2d_gbps=0.01, d2h_gbps=0.02, both_gbps=0.025,
                  nvme_write_gbps=0.001, nvme_read_gbps=0.004)
"""Rates chosen so that each term is a different round number per element."""


def engine_of(config: str, tmp_path, **overrides):
    """Small NVMe sub-groups: the staging stays small beside these tiny shards."""
    return tiered.initialize(make_model(), os.path.join(REPO, "configs", f"{config}.yaml"),
                             device="cpu", compute_dtype="fp32",
                             optimizer=dict(OPTIM, sub_group_size=SUB_GROUP),
                             nvme={"path": str(tmp_path)}, **overrides)


@pytest.mark.parametrize("config", ["cpu", "nvme", "auto"])
def test_the_predicted_terms_are_the_plans_traffic_over_the_rates(config, tmp_path):
    engine, _ = engine_of(config, tmp_path, hbm=dict(budget="600KiB", **(
        {"reserve": 0} if config == "auto" else {})))
    n = {f.spec.index: f.shard_numel for f in engine.runtime.flats}
    tier = {unit: {kind: engine.manager.tier_of(unit, kind) for kind in (
        StateKind.PARAM, StateKind.GRAD, StateKind.MASTER)}
            for unit in n}
    host = sum(n[u] for u in n if tier[u][StateKind.MASTER] is not Tier.HBM)
    device = sum(n[u] for u in n if tier[u][StateKind.MASTER] is Tier.HBM)
    up = sum(2 * 4 * n[u] for u in n if tier[u][StateKind.PARAM] is not Tier.HBM)
    down = sum(4 * n[u] for u in n if tier[u][StateKind.GRAD] is not Tier.HBM)
    nvme_weights = sum(n[u] for u in n if tier[u][StateKind.PARAM] is Tier.NVME)
    nvme_states = sum(n[u] for u in n if tier[u][StateKind.MASTER] is Tier.NVME)
    terms = step_terms(engine.manager.plan, engine.policy, 1, RATES)
    assert terms.cpu_update == pytest.approx(host / 1e6)
    assert terms.gpu_update == pytest.approx(device / 5e7)
    assert terms.pcie == pytest.approx(max(up / 1e7, down / 2e7, (up + down) / 2.5e7))
    assert terms.nvme == pytest.approx((8 * nvme_weights + 12 * nvme_states) / 4e6
                                       + (4 * nvme_weights + 12 * nvme_states) / 1e6)
    if config == "auto":
        assert host and device, "a mixed placement was wanted"
    if config == "nvme":
        assert terms.bound[0] == "NVMe"
    engine.close()


def test_the_report_shows_the_plan_the_tiers_hold_and_the_placement(tmp_path):
    engine, _ = engine_of("auto", tmp_path, hbm={"budget": "600KiB", "reserve": 0})
    report = engine.plan_report()
    held = engine.memory_report()
    for tier in (Tier.DRAM, Tier.NVME):  # a fresh engine holds what its plan lists
        assert report.needed[tier] == held[tier.value]["current"]
    for kind in (StateKind.PARAM, StateKind.GRAD, StateKind.MASTER):
        assert {t.value: c for t, c in report.units[kind].items()} == \
            units_per_tier(engine, kind)
    engine.close()


def test_initialize_logs_the_table_and_says_how_to_get_a_prediction(tmp_path, caplog,
                                                                     monkeypatch):
    monkeypatch.setenv("TIERED_CACHE", str(tmp_path / "cache"))  # nothing measured there
    with caplog.at_level(logging.INFO, logger="tiered"):
        engine, _ = engine_of("cpu", tmp_path)
    engine.close()
    logged = "\n".join(r.getMessage() for r in caplog.records if r.name == "tiered")
    assert "the plan of rank 0" in logged and "units: master" in logged
    assert "run `tiered node`" in logged


@pytest.mark.parametrize("compute_dtype, rate", [("fp32", 1e6), ("bf16", 2e6)])
def test_a_node_without_a_gpu_is_bound_by_its_cpu_update_at_the_kernels_rate(compute_dtype,
                                                                             rate):
    """fp32 is stepped by torch's fused kernel, bf16 by the one-pass kernel: each its rate."""
    cpu_only = dataclasses.replace(RATES, gpu_adamw_params_per_s=None, h2d_gbps=None,
                                   d2h_gbps=None, both_gbps=None)
    engine, _ = tiered.initialize(make_model(), os.path.join(REPO, "configs", "cpu.yaml"),
                                  device="cpu", compute_dtype=compute_dtype, optimizer=OPTIM)
    report = dataclasses.replace(engine.plan_report(), terms=step_terms(
        engine.manager.plan, engine.policy, 1, cpu_only), rates_of=cpu_only.machine)
    trained = sum(f.shard_numel for f in engine.runtime.flats)
    engine.close()
    assert report.terms.gpu_update is None and report.terms.pcie is None
    assert report.terms.bound == ("CPU update", pytest.approx(trained / rate))
    assert "bound by CPU update" in report.table() and "a synthetic node" in report.table()


def test_a_step_is_measured_from_its_first_forward_with_grad_to_its_optimizer_step():
    """An evaluation forward (no grad) and a pause before the training forward are in the
    step's time, not in its forward and backward."""
    engine, optimizer = tiered.initialize(make_model(), os.path.join(REPO, "configs", "cpu.yaml"),
                                          device="cpu", compute_dtype="fp32", optimizer=OPTIM)
    assert engine.plan_report().measured is None  # no step yet
    idx = token_batches(1)[0]
    for _ in range(2):
        with torch.no_grad():
            engine(idx)
        time.sleep(0.3)
        next_token_loss(engine(idx), idx).backward()
        with torch.no_grad():  # evaluation between backward and step: not the step's compute
            for _ in range(20):
                engine(idx)
        optimizer.step()
        optimizer.zero_grad()
    report = engine.plan_report()
    engine.close()
    measured = report.measured
    assert measured.step == 2 and measured.device_peak is None
    assert 0 < measured.compute_s < 0.3 < measured.step_s
    assert "measured at step 2" in report.table() and "slowest unit: blocks." in report.table()
    seconds = dict(zip(report.unit_names, measured.unit_seconds))
    assert set(seconds) == {"<root>", "blocks.0", "blocks.1"}
    assert all(forward > 0 and backward > 0 for forward, backward in seconds.values())
    # The root's forward holds the blocks' (it is gathered through the whole forward).
    assert seconds["<root>"][0] >= seconds["blocks.0"][0] + seconds["blocks.1"][0]
    assert sum(f + b for f, b in seconds.values()) < 2 * measured.compute_s
    assert all(forward < measured.compute_s for forward, _ in seconds.values())


def test_backwards_without_a_step_are_not_measured_and_keep_no_marks():
    """Gradients taken again and again with no optimizer.step() (for another use than
    training) would have kept every unit's marks until a step came."""
    engine, optimizer = tiered.initialize(make_model(), os.path.join(REPO, "configs", "cpu.yaml"),
                                          device="cpu", compute_dtype="fp32", optimizer=OPTIM)
    idx = token_batches(1)[0]
    for _ in range(SPANS_PER_UNIT):  # two spans per unit each
        next_token_loss(engine(idx), idx).backward()
    assert len(engine.runtime.probe._spans) <= SPANS_PER_UNIT * len(engine.runtime.flats)
    optimizer.step()
    assert engine.plan_report().measured is None
    next_token_loss(engine(idx), idx).backward()
    optimizer.step()
    assert engine.plan_report().measured.step == 2  # the next step is measured again
    engine.close()


def test_the_step_predicted_with_the_measured_compute_follows_the_overlap_of_each_case():
    terms = StepTerms(cpu_update=0.6, gpu_update=0.05, pcie=0.3, nvme=0.2)
    assert terms.predicted_step(0.27, on_cpu=False, delayed=True) == pytest.approx(0.6)
    assert terms.predicted_step(0.9, on_cpu=False, delayed=True) == pytest.approx(0.95)
    assert terms.predicted_step(0.27, on_cpu=False, delayed=False) == pytest.approx(0.92)
    assert terms.predicted_step(0.27, on_cpu=True, delayed=True) == pytest.approx(0.92)
    drive_bound = StepTerms(cpu_update=0.1, gpu_update=None, pcie=None, nvme=5.0)
    assert drive_bound.predicted_step(1.0, on_cpu=True, delayed=False) == 5.0


def test_frozen_units_move_no_optimizer_bytes_and_each_backward_counts(tmp_path):
    """A LoRA model under nvme.yaml in bf16: the frozen halves keep fp32 masters on the drive,
    never read in a step, and their weights are never written; with two backwards a step the
    gathers and the gradients' copies count twice. Bytes per element: bf16 weights 2 (read for
    both gathers), trained states 12 read and 12 written, new bf16 weights 2 written, bf16
    gradients 2 (one rank)."""
    engine, _ = tiered.initialize(lora_model(), os.path.join(REPO, "configs", "nvme.yaml"),
                                  device="cpu", compute_dtype="bf16",
                                  optimizer=dict(OPTIM, sub_group_size=SUB_GROUP),
                                  nvme={"path": str(tmp_path)})
    flats = engine.runtime.flats
    trained = sum(f.shard_numel for f in flats if f.has_trainable)
    every = sum(f.shard_numel for f in flats)
    assert trained < every and engine.manager.has(
        next(f for f in flats if not f.has_trainable).spec.index, StateKind.MASTER)
    for backwards in (1, 2):
        terms = step_terms(engine.manager.plan, engine.policy, 1, RATES, False, backwards)
        assert terms.nvme == pytest.approx((4 * every * backwards + 12 * trained) / 4e6
                                           + (2 * trained + 12 * trained) / 1e6)
        up, down = 4 * every * backwards, 2 * trained * backwards
        assert terms.pcie == pytest.approx(max(up / 1e7, down / 2e7, (up + down) / 2.5e7))
        assert terms.cpu_update == pytest.approx(trained / 2e6)
    engine.close()


def test_compact_states_move_their_own_bytes_on_the_drive(tmp_path):
    """int8 moments on NVMe: each step reads and writes the fp32 masters and 260 bytes per 256
    parameters of each moment; the CPU update still steps every trained parameter."""
    engine, _ = tiered.initialize(lora_model(), os.path.join(REPO, "configs", "nvme.yaml"),
                                  device="cpu", compute_dtype="bf16",
                                  optimizer=dict(OPTIM, sub_group_size=1 << 18, moments="int8"),
                                  nvme={"path": str(tmp_path)})
    flats = engine.runtime.flats
    trained = [f.shard_numel for f in flats if f.has_trainable]
    every = sum(f.shard_numel for f in flats)
    terms = step_terms(engine.manager.plan, engine.policy, 1, RATES, False, 1)
    states = sum(4 * n + 2 * stored_numel(PACKED, n) for n in trained)
    assert terms.nvme == pytest.approx((4 * every + states) / 4e6
                                       + (2 * sum(trained) + states) / 1e6)
    assert terms.cpu_update == pytest.approx(sum(trained) / 2e6)
    engine.close()
