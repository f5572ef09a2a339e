"""The engine on the simulated accelerator (``TIERED_DEVICE=sim``; issue 31, items 2 and 3): it
takes every branch a GPU takes (gather and offload streams, their events, ``record_stream``,
the in-process worker's own stream, host memory registered for the device's copies, the
GPU-stepped units of ``tier: auto``), the simulator checks CUDA's ordering rules on every
operator of the training thread from ``initialize`` to ``close`` (tiered/device/sim.py), and the
run trains as PyTorch does and as the plain CPU does, bit for bit: the device changes when
work may run, never what it computes.

What the checks find in a real engine run, not only in the simulator's own tests: a gathered
unit read before its gather's event (the wait taken out of ``Gatherer.finish``), or a
gradient's memory handed back to the allocator while the offload stream copies it (the
``record_stream`` taken out) fail these runs with both sites named; ``test_sim_device.py``
holds the simulator's own cases.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import tiered
from tiered.device import DEVICE_ENV, simulated_device
from tiered.device.sim import OrderingError
from tiered.engine import gather as gather_module
from tiered.engine.streams import Streams
from tiered.integrations.transformers import TieredTrainer
from tiered.policy.config import Policy
from tiered.service.paths import RUNTIME_ENV

from distributed import run_ranks
from helpers import CONFIGS, REPO, assert_same, clean_env, finish, train_reference, write_policy
from helpers_delayed import assert_matches, reference, train_engine as train_delayed
from helpers_hf import arguments, assert_close_states, dataset, llama, train_plain
from helpers_models import OPTIM, assert_parity, make_model, run_engine, train_torch
from helpers_placement import SUB_GROUP, mixed_budgets

CASES = {
    "cpu": ("cpu", {}),
    "nvme": ("nvme", {}),
    "gpu": ("gpu", {}),
    # The root on the device, one block's states in DRAM, the other's on NVMe.
    "auto": ("auto", dict(mixed_budgets(1), optimizer=dict(OPTIM, sub_group_size=SUB_GROUP))),
    "clipped, int8 moments": ("cpu", {"optimizer": dict(OPTIM, max_grad_norm=0.5,
                                                        moments="int8")}),
}


def train(case: str, nvme: str) -> tuple[dict, object, list[bool]]:
    """The state after the parity steps, the engine (closed) and which units its host stepped
    on the device."""
    policy, overrides = CASES[case]
    overrides = dict(overrides)
    engine, optimizer = tiered.initialize(
        make_model(), os.path.join(CONFIGS, f"{policy}.yaml"), compute_dtype="fp32",
        device="cpu", nvme={"path": nvme}, optimizer=overrides.pop("optimizer", OPTIM),
        **overrides)
    try:
        stepper = engine.runtime.host.rank_host.stepper
        return (run_engine(engine, optimizer), engine,
                [stepper.on_device(unit) for unit in range(len(engine.runtime.flats))])
    finally:
        engine.close()


@pytest.mark.parametrize("case", CASES)
def test_a_rank_on_the_simulated_device_trains_as_on_the_cpu_with_every_access_ordered(
        case, tmp_path, monkeypatch):
    plain, _, on_cpu = train(case, str(tmp_path))
    monkeypatch.setenv(DEVICE_ENV, "sim")
    with simulated_device().tracking():  # raises what would race on a GPU, as it ends
        simulated, engine, on_device = train(case, str(tmp_path))
    assert engine.runtime.streams.accelerator is simulated_device()
    assert engine.runtime.host.device_stream is not None  # the branches a GPU takes
    # Units stepped on the device by the worker's stream: gpu.yaml's all, auto's the root.
    assert not any(on_cpu)
    assert any(on_device) == (case in ("gpu", "auto")) and all(on_device) == (case == "gpu")
    assert_same(simulated, plain, case)
    if "int8" not in case:  # compact states: tests/optim/test_compact_engine.py's reference
        model = make_model()
        clip = CASES[case][1].get("optimizer", {}).get("max_grad_norm")
        assert_parity(simulated, train_torch(model, torch.optim.AdamW(model.parameters(),
                                                                      **OPTIM), clip))


def test_the_delayed_update_on_the_simulated_device_follows_its_rule(tmp_path, monkeypatch):
    monkeypatch.setenv(DEVICE_ENV, "sim")
    with simulated_device().tracking():
        state, losses = train_delayed("cpu", 0, 1, str(tmp_path), None)
    assert_matches(state, losses, *reference(None), world=1)


def _rank_on_the_simulated_device(rank: int, world: int, nvme: str, out: str) -> None:
    with simulated_device().tracking():
        state, _ = train_delayed("nvme", rank, world, nvme, 0.5)
    torch.save(state, os.path.join(out, f"rank{rank}.pt"))


def test_two_ranks_on_the_simulated_device_follow_the_delayed_rule(tmp_path, monkeypatch):
    """Each rank's training thread tracked, under nvme.yaml with clipping and the delayed
    update (the ranks inherit TIERED_DEVICE)."""
    monkeypatch.setenv(DEVICE_ENV, "sim")
    run_ranks(2, _rank_on_the_simulated_device, str(tmp_path), str(tmp_path))
    expected, _ = reference(0.5, world=2)
    for rank in range(2):
        assert_parity(torch.load(tmp_path / f"rank{rank}.pt", weights_only=True), expected)


def test_a_gathered_unit_read_before_its_gathers_event_is_found(tmp_path, monkeypatch):
    """The wait of ``Gatherer.finish`` taken out: the forward reads each unit's buffer on the
    compute stream with nothing ordering it after the gather stream's copy into it."""
    monkeypatch.setattr(gather_module, "wait_for", lambda *args, **kwargs: None)
    monkeypatch.setenv(DEVICE_ENV, "sim")
    with pytest.raises(OrderingError) as found:
        with simulated_device().tracking():
            train("cpu", str(tmp_path))
    report = str(found.value)
    assert "a read on the default stream is not ordered after the write of the same memory " \
           "on the gather stream" in report
    assert "in start" in report and "mine.copy_(source, non_blocking=True)" in report


def test_ranks_of_tiered_launch_on_the_simulated_device_train_through_the_service(tmp_path):
    """``TIERED_DEVICE=sim`` through the launcher: each rank's script runs tracked
    (rank_entry.py), with its CPU update in the node's service, and trains as PyTorch does."""
    out = tmp_path / "out"
    out.mkdir()
    policy = write_policy(tmp_path / "fp32.yaml", "cpu", compute_dtype="fp32", device="cpu")
    run = finish(subprocess.Popen(
        [sys.executable, "-m", "tiered.launch.launcher", "--nproc-per-node", "2", "--job", "sim",
         "--policy", str(policy), str(REPO / "tests" / "scripts" / "launch_train.py"), str(out)],
        cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=clean_env(**{RUNTIME_ENV: str(tmp_path / "service"), DEVICE_ENV: "sim"})),
        timeout=180)
    assert run.returncode == 0, run.stderr
    assert [json.loads((out / f"rank{r}.json").read_text())["service_job"]
            for r in range(2)] == ["sim", "sim"]
    reference = train_reference(Policy.from_yaml(policy))
    for rank in range(2):
        trained = torch.load(out / f"rank{rank}.pt")
        for name, weight in reference.items():  # as test_service_launch.py compares them
            torch.testing.assert_close(trained[name], weight, rtol=0, atol=1e-5, msg=name)


def test_a_gradient_let_go_while_the_offload_stream_copies_it_is_found(tmp_path, monkeypatch):
    """``record_stream`` taken out of ``Streams.keep_for_offload``: each gradient's memory goes
    back to the compute stream's allocator while the offload stream may still copy it."""
    monkeypatch.setattr(Streams, "keep_for_offload", lambda self, *tensors: None)
    monkeypatch.setenv(DEVICE_ENV, "sim")
    with pytest.raises(OrderingError, match="memory went back to the allocator for the default "
                                            "stream while the offload stream may still use it"):
        with simulated_device().tracking():
            train("cpu", str(tmp_path))


def test_the_hugging_face_trainer_on_the_simulated_device_trains_as_plain_trainer(
        tmp_path, monkeypatch):
    """TieredTrainer with gradient checkpointing (a unit's gather waited on again in its
    recomputation) on the simulated device, tracked, against plain Trainer."""
    data = dataset()
    args = dict(gradient_checkpointing=True, max_steps=3)
    expected, _ = train_plain(llama(), arguments(tmp_path / "plain", **args), data)
    monkeypatch.setenv(DEVICE_ENV, "sim")
    with simulated_device().tracking():
        trainer = TieredTrainer(model=llama(), args=arguments(tmp_path / "tiered", **args),
                                train_dataset=data, policy={"device": "cpu"})
        trainer.train()
        got = trainer.engine.full_state_dict()
        trainer.engine.close()
    assert trainer.engine.runtime.streams.gather is not None
    assert_close_states(got, expected)
