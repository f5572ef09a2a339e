"""Activations as a tier (issue 34): with ``activations.tier: dram`` what a forward saves for
backward waits in the plan's DRAM block instead of on the device, with ``nvme`` what that block
cannot hold waits in a file on the drive, and training is bit for bit what it is with them on
the device, and what plain PyTorch computes; with and without non-reentrant activation
checkpointing, under the delayed update, at two ranks, on the simulated accelerator with every
copy's ordering checked. The device's count of saved bytes shows what moved; a read of the drive
that fails mid-backward fails the step by name and leaves nothing behind."""
from __future__ import annotations

import functools
import os

import pytest
import torch
from torch import nn

import tiered
from tiered.core.errors import PolicyError
from tiered.device import DEVICE_ENV, simulated_device
from tiered.device.sim import OrderingError
from tiered.engine import offloaded_activations
from tiered.service.client import JOB_ENV, SERVICE_ENV
from tiered.tiers.aio import inject_faults

from distributed import run_ranks
from gpt import GPT
from helpers import CONFIGS, assert_same, left_behind, own_service
from helpers_models import (OPTIM, SEQ, VOCAB, assert_parity, make_model, model_loss,
                            run_engine, token_batches, train_torch)
from helpers_tiers import activations_on_nvme

OFFLOADED = {"tier": "dram", "dram_bytes": "1MiB", "min_bytes": 0}
SPILLED = 8192
"""The DRAM block of the runs on the drive: about one of the forward's saved tensors, so that
most of them go to the drive."""


def model(checkpointed: bool) -> GPT:
    """The parity GPT; ``checkpointed``: each block under non-reentrant activation
    checkpointing, its input what the forward saves of it."""
    gpt = make_model()
    gpt.checkpointed = checkpointed
    return gpt


def train(checkpointed: bool, activations: dict | None = None, policy: str = "cpu",
          nvme: str | None = None, spill: str | None = None, **optimizer) -> tuple[dict, dict]:
    """The weights after the parity steps, and what the engine counted of saved tensors (and
    each loss); ``spill``: a folder for activations.tier: nvme (activations_on_nvme, past a
    block of SPILLED bytes), over ``activations``."""
    overrides: dict = {"nvme": {"path": nvme}}
    if activations:
        overrides["activations"] = activations
    if spill is not None:
        overrides = activations_on_nvme(spill, SPILLED)
    losses: list[torch.Tensor] = []

    def recorded(engine, idx):
        loss = model_loss(engine, idx)
        losses.append(loss.detach().clone())
        return loss

    engine, opt = tiered.initialize(
        model(checkpointed), str(CONFIGS / f"{policy}.yaml"), compute_dtype="fp32",
        device="cpu", optimizer=dict(OPTIM, **optimizer), **overrides)
    try:
        state = run_engine(engine, opt, loss=recorded)
        store = engine.runtime.activations
        measured = engine.plan_report().measured
        counted = {"on_device": engine.runtime.probe.last_activations,
                   "in_dram": measured.activations_in_dram,
                   "on_nvme": measured.activations_on_nvme,
                   "report": engine.plan_report().table(),
                   "offloaded": store.offloaded_bytes,
                   "spilled": store.spill.written_bytes if store.spill is not None else 0,
                   "read_ahead": store.spill.read_ahead_bytes if store.spill is not None else 0,
                   "fetched_ahead": store.fetched_ahead_bytes,
                   "reads_not_ahead": store.reads_not_ahead,
                   "arena": engine.memory_report()["dram"],
                   "nvme": engine.memory_report()["nvme"],
                   "host": type(engine.runtime.host).__name__,
                   "losses": torch.stack(losses)}
    finally:
        engine.close()
    return state, counted


@functools.cache
def on_device(checkpointed: bool) -> tuple[dict, dict]:
    """The run with the activations on the device, which every tier's is held to (once)."""
    return train(checkpointed)


@functools.cache
def pytorch(checkpointed: bool) -> dict:
    reference = model(checkpointed)
    return train_torch(reference, torch.optim.AdamW(reference.parameters(), **OPTIM))


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("tier", ["dram", "nvme"])
def test_activations_off_the_device_train_bit_for_bit_as_on_it_and_as_pytorch(
        checkpointed, tier, tmp_path):
    """In DRAM, and with a DRAM block too small for them on the drive (the rest): every loss and
    weight is the device's to the bit (the updates read the gradients, which are so too)."""
    on_it, kept = on_device(checkpointed)
    off, moved = (train(checkpointed, OFFLOADED) if tier == "dram"
                  else train(checkpointed, spill=str(tmp_path)))
    assert_same(off, on_it, f"activations in {tier}")
    assert torch.equal(moved["losses"], kept["losses"])
    assert_parity(off, pytorch(checkpointed))
    # What the forwards saved moved off the device: none of it stays there, all of it is in
    # DRAM (or, past the block, on the drive), and plan_report says so.
    assert kept["on_device"] > 0 and kept["offloaded"] == 0 and kept["in_dram"] == 0
    assert moved["on_device"] == 0 and "in DRAM" in moved["report"]
    assert "in DRAM" not in kept["report"]
    if tier == "dram":
        assert 0 < moved["in_dram"] <= 1 << 20 and moved["spilled"] == 0  # within the block
        return
    assert 0 < moved["in_dram"] <= SPILLED < moved["on_nvme"] and moved["spilled"] > 0
    assert "on NVMe" in moved["report"] and kept["nvme"]["current"] == 0
    assert moved["nvme"]["current"] == 4 << 20  # the file, in the NVMe tier's count
    assert left_behind(tmp_path) == []


def _rank(rank: int, world: int, out: str) -> None:
    states = {}
    for name, overrides in (("hbm", {}), ("dram", {"activations": OFFLOADED}),
                            ("nvme", activations_on_nvme(out, SPILLED))):
        engine, optimizer = tiered.initialize(
            model(True), str(CONFIGS / "cpu.yaml"), compute_dtype="fp32", device="cpu",
            optimizer=dict(OPTIM), **overrides)
        states[name] = run_engine(engine, optimizer, rank=rank, world=world)
        store = engine.runtime.activations
        states[f"{name} offloaded"] = store.offloaded_bytes
        states[f"{name} spilled"] = store.spill.written_bytes if store.spill is not None else 0
        engine.close()
    torch.save(states, os.path.join(out, f"rank{rank}.pt"))


def test_two_ranks_with_activations_in_dram_or_on_nvme_train_as_with_them_on_the_device(
        tmp_path):
    run_ranks(2, _rank, str(tmp_path))
    for rank in range(2):
        states = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert_same(states["dram"], states["hbm"], f"rank {rank}")
        assert_same(states["nvme"], states["hbm"], f"rank {rank}, on NVMe")
        assert states["dram offloaded"] > 0 and states["hbm offloaded"] == 0
        assert states["nvme spilled"] > 0 and states["dram spilled"] == 0
        assert_parity(states["dram"], pytorch(True))
    assert sorted(os.listdir(tmp_path)) == ["rank0.pt", "rank1.pt"]  # no run folder left


def test_a_small_block_keeps_on_the_device_what_it_cannot_hold():
    on_device, kept = train(False)
    small = dict(OFFLOADED, dram_bytes=8192)  # about one of the forward's saved tensors
    in_part, moved = train(False, small)
    assert_same(in_part, on_device, "a part in DRAM")
    assert 0 < moved["on_device"] < kept["on_device"] and moved["offloaded"] > 0


def test_the_block_is_counted_in_the_dram_tier(tmp_path):
    _, kept = train(False)
    _, moved = train(False, dict(OFFLOADED, dram_bytes="2MiB"))
    assert moved["arena"]["current"] - kept["arena"]["current"] == 2 << 20


@pytest.mark.parametrize("tier", ["dram", "nvme"])
def test_activations_off_the_device_under_the_delayed_update_with_states_on_nvme(tmp_path, tier):
    delayed = {"delayed_update": {"enabled": True, "warmup_steps": 1}}
    on_device, _ = train(True, None, "nvme", str(tmp_path), **delayed)
    off, moved = train(True, OFFLOADED, "nvme", str(tmp_path),
                       spill=str(tmp_path) if tier == "nvme" else None, **delayed)
    assert_same(off, on_device, f"delayed update, states on NVMe, activations in {tier}")
    assert moved["offloaded"] > 0 and (moved["spilled"] > 0) == (tier == "nvme")


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """A service of this module's own (each test's job its own)."""
    with own_service(tmp_path_factory, keep_seconds=0.0) as folder:
        yield folder


@pytest.mark.parametrize("tier", ["dram", "nvme"])
def test_through_the_nodes_service_the_block_is_in_its_pool(service, monkeypatch, tmp_path,
                                                            tier):
    """A rank whose DRAM tier (the block for activations with it, and the slots to the drive)
    is the service's memory and whose CPU update runs there trains as the in-process one does
    (as with them on the device); the file on the drive is the trainer's own, gone with its
    close."""
    monkeypatch.setenv(SERVICE_ENV, service)
    monkeypatch.setenv(JOB_ENV, f"activations-{tier}")
    through, moved = train(True, OFFLOADED, spill=str(tmp_path) if tier == "nvme" else None)
    monkeypatch.delenv(SERVICE_ENV)
    assert_same(through, on_device(True)[0], "through the service")
    assert moved["offloaded"] > 0 and moved["host"] == "RemoteHost"
    assert (moved["spilled"] > 0) == (tier == "nvme")
    assert left_behind(tmp_path) == []


@pytest.mark.parametrize("tier", ["dram", "nvme"])
def test_on_the_simulated_device_every_copy_is_ordered(monkeypatch, tmp_path, tier):
    spill = str(tmp_path) if tier == "nvme" else None
    plain, on_cpu = train(True, OFFLOADED, spill=spill)
    monkeypatch.setenv(DEVICE_ENV, "sim")
    with simulated_device().tracking():  # raises what would race on a GPU, as it ends
        simulated, moved = train(True, OFFLOADED, spill=spill)
    assert_same(simulated, plain, "on the simulated device")
    assert moved["offloaded"] > 0
    # With streams, what backward reads next was copied back ahead of its reads (read back from
    # the drive, there), the first read of each backward too (copied as the backward reached the
    # model's output); the CPU has no stream to copy ahead on.
    assert moved["fetched_ahead"] > 0 and on_cpu["fetched_ahead"] == 0
    assert moved["reads_not_ahead"] == 0
    assert (moved["read_ahead"] > 0) == (tier == "nvme") and on_cpu["read_ahead"] == 0


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_a_backward_copies_back_ahead_only_what_its_own_forward_saved(monkeypatch,
                                                                       checkpointed):
    """Two forwards, then the first one's backward, then the second's: the copies ahead start
    from the outputs of the later forward only (its backward reads every tensor ahead), and
    the first backward, whose first read then waits for its own copy, copies back none of what
    the second forward saved (nothing copied ahead is left unread after it)."""
    monkeypatch.setenv(DEVICE_ENV, "sim")
    with simulated_device().tracking():
        engine, _ = tiered.initialize(model(checkpointed), str(CONFIGS / "cpu.yaml"),
                                      compute_dtype="fp32", device="cpu", optimizer=OPTIM,
                                      activations=OFFLOADED)
        try:
            store = engine.runtime.activations
            first, second = (model_loss(engine, idx) for idx in token_batches(2))
            first.backward()
            assert (store.reads_not_ahead, store._fetched_bytes) == (1, 0)
            second.backward()
            assert (store.reads_not_ahead, store._fetched_bytes) == (1, 0)
            assert store.fetched_ahead_bytes > 0
        finally:
            engine.close()


def test_a_read_not_waiting_for_its_copy_ahead_is_found(monkeypatch):
    """The read's wait for the event of the copy back made ahead taken out: the compute stream
    reads what the offload stream may still be writing."""
    monkeypatch.setattr(offloaded_activations.SavedActivations, "_wait", lambda self, ready: None)
    monkeypatch.setenv(DEVICE_ENV, "sim")
    with pytest.raises(OrderingError) as found:
        with simulated_device().tracking():
            train(True, OFFLOADED)
    assert "the offload stream" in str(found.value)


def test_a_copy_back_not_waiting_for_its_copy_out_is_found(monkeypatch):
    """The copy back's wait for the copy out's event taken out: backward reads DRAM the
    offload stream wrote, with nothing ordering it after the write (each tensor copied back as
    it is read: copies ahead run behind the copies out on their stream)."""
    real = offloaded_activations.SavedActivations.unpack

    def unordered(self, packed):
        if isinstance(packed, offloaded_activations._InDram):
            packed.ready = None
        return real(self, packed)

    monkeypatch.setattr(offloaded_activations.SavedActivations, "unpack", unordered)
    monkeypatch.setenv(DEVICE_ENV, "sim")
    with pytest.raises(OrderingError) as found:
        with simulated_device().tracking():
            train(False, dict(OFFLOADED, prefetch_bytes=0))
    assert "the offload stream" in str(found.value)


def test_what_the_activations_cannot_have_is_refused_by_name(tmp_path):
    with pytest.raises(PolicyError, match=r"nvme.path is required by activations.tier: nvme"):
        tiered.Policy.from_dict({"activations": {"tier": "nvme"}})
    with pytest.raises(PolicyError, match="activations.*dram_bytes"):
        tiered.Policy.from_dict({"activations": {"tier": "dram", "dram_bytes": 0}})
    with pytest.raises(PolicyError, match="activations.*nvme_bytes must be > 0"):
        tiered.Policy.from_dict({"activations": {"tier": "nvme", "nvme_bytes": 0},
                                 "nvme": {"path": str(tmp_path)}})
    # The file is in the plan's NVMe needs: past the budget, nothing starts.
    overrides = activations_on_nvme(tmp_path, SPILLED)
    overrides["nvme"]["budget"] = "1MiB"
    with pytest.raises(tiered.BudgetError,
                       match=r"nvme: needs 4.00 MiB(.|\n)*4.00 MiB of the needs are the file for "
                             r"saved activations \(activations.nvme_bytes\)"):
        tiered.initialize(model(False), str(CONFIGS / "cpu.yaml"), compute_dtype="fp32",
                          device="cpu", **overrides)
    assert left_behind(tmp_path) == []


def test_a_failed_read_of_the_drive_fails_the_step_by_name_and_leaves_nothing(tmp_path):
    """An NVMe read error on a saved tensor mid-backward (aio.inject_faults, the I/O engine's
    seam): backward raises an NvmeError naming the tensor and the file, with no read left in
    flight; the engine closes with nothing pinned and nothing on the drive."""
    engine, optimizer = tiered.initialize(model(True), str(CONFIGS / "cpu.yaml"),
                                          compute_dtype="fp32", device="cpu",
                                          optimizer=dict(OPTIM),
                                          **activations_on_nvme(tmp_path, SPILLED))
    idx = token_batches(1)[0]
    reads = []

    def fail_the_third_read(verb, path, offset, size):
        if verb == "read" and "extent" in path:
            reads.append(offset)
            if len(reads) == 3:
                raise OSError(5, "injected EIO")
        return None

    try:
        loss = model_loss(engine, idx)
        with inject_faults(fail_the_third_read):
            with pytest.raises(tiered.NvmeError) as failed:
                loss.backward()
        message = str(failed.value)
        assert "a tensor the forward saved for backward" in message
        assert "could not be read back" in message and "injected EIO" in message
        assert failed.value.path.startswith(str(tmp_path)) and "\n" not in message
        assert engine.runtime.activations.spill._ahead == {}  # no read left in flight
        del loss
    finally:
        engine.close()
    report = engine.memory_report()
    assert report["dram"]["current"] == 0 and report["nvme"]["current"] == 0
    assert left_behind(tmp_path) == []


def test_a_module_without_units_weights_saved_keeps_its_other_tensors_exact():
    """Integer and boolean tensors saved for backward (an embedding's indices, a mask) cross
    to DRAM and back unchanged too."""
    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(VOCAB, 16)
            self.out = nn.Linear(16, 1)

        def forward(self, idx):
            h = self.emb(idx)
            return self.out(h.masked_fill(idx.unsqueeze(-1) % 3 == 0, 0.0)).sum()

    def run(activations):
        torch.manual_seed(0)
        engine, optimizer = tiered.initialize(
            Masked(), str(CONFIGS / "cpu.yaml"), compute_dtype="fp32", device="cpu",
            optimizer=dict(OPTIM), **({"activations": activations} if activations else {}))
        idx = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(2))
        for _ in range(2):
            engine(idx).backward()
            optimizer.step()
            optimizer.zero_grad()
        state = engine.full_state_dict()
        engine.close()
        return state

    assert_same(run(OFFLOADED), run(None), "indices and masks in DRAM")


def test_under_tier_auto_the_block_is_planned_beside_the_units():
    """tier: auto places the units with the activations' block counted in DRAM, and trains as
    with the activations on the device."""
    def run(activations: dict | None) -> tuple[dict, dict]:
        engine, optimizer = tiered.initialize(
            model(True), str(CONFIGS / "auto.yaml"), compute_dtype="fp32", device="cpu",
            optimizer=dict(OPTIM), hbm={"budget": "64MiB", "reserve": 0},
            **({"activations": activations} if activations else {}))
        try:
            return run_engine(engine, optimizer), {
                "offloaded": engine.runtime.activations.offloaded_bytes,
                "dram": engine.memory_report()["dram"]["current"]}
        finally:
            engine.close()

    on_device, kept = run(None)
    in_dram, moved = run(OFFLOADED)
    assert_same(in_dram, on_device, "tier: auto")
    assert moved["offloaded"] > 0 and kept["offloaded"] == 0
    assert moved["dram"] - kept["dram"] == 1 << 20  # the block, beside the units' states


@pytest.mark.parametrize("budget, stays", [("64MiB", False), ("176KiB", True)],
                         ids=["room on the device", "no room"])
@pytest.mark.filterwarnings("ignore:tiered. the budgets hold this model only")
def test_tier_auto_keeps_them_in_dram_only_where_the_device_has_no_room(budget, stays):
    """activations.tier: auto: in DRAM for the first step, which measures them; on the device
    from the next step where they fit beside the plan and the margin, else in DRAM for good;
    the bits are the device's either way. (176 KiB: the HBM tier's peak without prefetch, which
    so small a budget leaves out, 109 KiB, a sixteenth of the budget and the 66 KiB a forward
    saves do not fit together.)"""
    on_device, _ = train(True)
    engine, optimizer = tiered.initialize(
        model(True), str(CONFIGS / "cpu.yaml"), compute_dtype="fp32", device="cpu",
        optimizer=dict(OPTIM), hbm={"budget": budget},
        activations=dict(OFFLOADED, tier="auto"))
    try:
        after_first = run_engine(engine, optimizer, steps=slice(0, 1))
        first = engine.runtime.activations.offloaded_bytes
        state = run_engine(engine, optimizer, steps=slice(1, None))
        later = engine.runtime.activations.offloaded_bytes - first
        report = engine.plan_report().table()
    finally:
        engine.close()
    assert after_first and first > 0
    assert (later > 0) == stays
    assert_same(state, on_device, "tier: auto")
    assert ("in DRAM" if stays else "on the device from the next step") in report
