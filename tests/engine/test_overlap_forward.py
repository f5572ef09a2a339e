"""An ordinary update, and units stepped as their gradients arrive, overlap the next forward:
``optimizer.step()`` returns at once, and the forward reads each unit only after the update has
written it."""
from __future__ import annotations

import copy
import os
import threading
import time

import pytest
import torch
from torch import nn

import tiered
from tiered.optim.stepper import UnitStepper

from gpt import next_token_loss
from helpers import run_with_deadline
from helpers_models import OPTIM, assert_parity, make_model, token_batches

HOLD_SECONDS = 0.3


class SlowKernel:
    """Every unit's AdamW takes HOLD_SECONDS longer while ``slow`` is set."""

    def __init__(self, monkeypatch):
        self.slow = False
        kernel = UnitStepper._kernel

        def slowed(stepper, *args):
            if self.slow:
                time.sleep(HOLD_SECONDS)
            return kernel(stepper, *args)

        monkeypatch.setattr(UnitStepper, "_kernel", slowed)


def on_arrival_beside_torch(model: nn.Module, device: str = "cpu"):
    """An engine that steps units as their gradients arrive, and a copy of ``model`` trained by
    plain PyTorch: ``(engine, optimizer, reference, reference_optimizer)``."""
    reference = copy.deepcopy(model).to(device)
    engine, optimizer = tiered.initialize(
        model, "configs/cpu.yaml", compute_dtype="fp32", device=device,
        optimizer=dict(OPTIM, accumulation_steps=1))
    return engine, optimizer, reference, torch.optim.AdamW(reference.parameters(), **OPTIM)


def on_cpu(state: dict) -> dict:
    return {name: value.cpu() for name, value in state.items()}


class Stack(nn.Module):
    """Linear blocks, of which a forward runs the first ``depth``: the next forward may skip
    units the last backward delivered (and so not wait for their steps)."""

    def __init__(self, blocks: int = 6):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(blocks))

    def forward(self, x: torch.Tensor, depth: int) -> torch.Tensor:
        for block in self.blocks[:depth]:
            x = torch.tanh(block(x))
        return x.square().mean()


@pytest.mark.parametrize("policy", ["cpu", "nvme"])
def test_the_next_forward_waits_for_each_units_new_weights(policy, tmp_path, monkeypatch):
    kernel = SlowKernel(monkeypatch)
    engine, optimizer = tiered.initialize(
        make_model(), f"configs/{policy}.yaml", compute_dtype="fp32", device="cpu",
        nvme={"path": str(tmp_path)}, optimizer=dict(OPTIM, max_grad_norm=1e9))
    reference = make_model()
    ref_optimizer = torch.optim.AdamW(reference.parameters(), fused=True, **OPTIM)
    names = [flat.name for flat in engine.runtime.flats]
    written = []
    record = engine.runtime.pending_weights.written

    def recording(units):  # a spy: the gate itself still runs
        written.extend(names[unit] for unit in units)
        record(units)

    engine.runtime.pending_weights.written = recording
    batches = token_batches(3)
    for step, idx in enumerate(batches[:2]):
        next_token_loss(engine(idx), idx).backward()
        next_token_loss(reference(idx), idx).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9)
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        written.clear()
        kernel.slow = True
        optimizer.step()
        optimizer.zero_grad()
        assert not written, "step() waited for the update"
        started = time.perf_counter()
        logits = run_with_deadline(lambda: engine(batches[step + 1]))
        assert time.perf_counter() - started >= HOLD_SECONDS, "the forward did not wait"
        kernel.slow = False
        # Bit for bit what the synchronously stepped model computes (fused AdamW both sides).
        assert torch.equal(logits, reference(batches[step + 1]))
        assert optimizer.last_grad_norm == pytest.approx(ref_norm.item(), rel=1e-6)
        # One unit at a time, in the order the forward needs them (the model's units, then
        # each block in turn), each unit once more as the update ends.
        assert written[:len(names)] == ["<root>", "blocks.0", "blocks.1"]
    engine.close()


def test_a_failed_overlapped_update_stops_the_forward_with_its_error(monkeypatch):
    engine, optimizer = tiered.initialize(make_model(), "configs/cpu.yaml", compute_dtype="fp32",
                                          device="cpu", optimizer=OPTIM)
    idx = token_batches(1)[0]
    next_token_loss(engine(idx), idx).backward()

    def failing_kernel(self, *args):
        raise OSError(5, "simulated failure in the update")

    monkeypatch.setattr(UnitStepper, "_kernel", failing_kernel)
    optimizer.step()  # returns: the failure happens on the worker
    with pytest.raises(tiered.TieredError, match="simulated failure in the update"):
        run_with_deadline(lambda: engine(idx))
    engine.runtime.worker.close()


def test_close_after_a_failed_update_with_nvme_reads_waiting_cleans_up(tmp_path, monkeypatch):
    """The forward read a unit ahead that the failing update had not written: that read ends
    with the worker's error, and close() must still remove the hooks and the run folder."""
    engine, optimizer = tiered.initialize(
        make_model(), "configs/nvme.yaml", compute_dtype="fp32", device="cpu",
        nvme={"path": str(tmp_path)}, optimizer=OPTIM, prefetch={"depth": 1})
    idx = token_batches(1)[0]
    next_token_loss(engine(idx), idx).backward()
    last = [flat.name for flat in engine.runtime.flats].index("blocks.1")
    kernel = UnitStepper._kernel

    def failing_kernel(self, piece, *args):
        if piece.unit == last:  # the forward is reading ahead of the unit it waits for by now
            time.sleep(HOLD_SECONDS)
            raise OSError(5, "simulated failure in the update")
        return kernel(self, piece, *args)

    monkeypatch.setattr(UnitStepper, "_kernel", failing_kernel)
    optimizer.step()
    with pytest.raises(tiered.TieredError, match="simulated failure"):
        run_with_deadline(lambda: engine(idx))
    engine.close()
    assert os.listdir(tmp_path) == []
    assert not engine.module._forward_pre_hooks, "the model kept the engine's hooks"


def test_units_stepped_as_gradients_arrive_are_read_once_written(monkeypatch):
    """With accumulation_steps, a unit is stepped during backward; a forward before step()
    reads its new weights whole, however slow the worker."""
    kernel = SlowKernel(monkeypatch)
    engine, optimizer = tiered.initialize(
        make_model(), "configs/cpu.yaml", compute_dtype="fp32", device="cpu",
        optimizer=dict(OPTIM, accumulation_steps=1))
    idx = token_batches(1)[0]
    kernel.slow = True
    next_token_loss(engine(idx), idx).backward()
    with torch.no_grad():
        before_step = run_with_deadline(lambda: engine(idx))
    kernel.slow = False
    optimizer.step()  # the units were stepped already: nothing is left to do
    with torch.no_grad():
        assert torch.equal(before_step, engine(idx))
    engine.close()


def test_units_stepped_on_arrival_go_in_the_next_forwards_order(monkeypatch):
    """Backward delivers the embeddings (the root unit) last; the next forward needs them first.
    Of the gradients already in, the worker steps first what that forward needs first."""
    engine, optimizer, reference, reference_optimizer = on_arrival_beside_torch(make_model())
    stepped = []
    step = UnitStepper.step
    monkeypatch.setattr(UnitStepper, "step",
                        lambda stepper, units, *args, **kw: (stepped.extend(units),
                                                             step(stepper, units, *args, **kw)))
    idx = token_batches(1)[0]
    worker_busy = threading.Event()  # until every gradient is in
    engine.runtime.worker.submit(worker_busy.wait)
    try:
        run_with_deadline(lambda: next_token_loss(engine(idx), idx).backward())
    finally:
        worker_busy.set()
    optimizer.step()
    optimizer.synchronize()
    forward = list(dict.fromkeys(engine.runtime.prefetcher.trace))
    assert stepped == forward == [2, 0, 1]  # the root, block 0, block 1
    assert engine.runtime.host.rank_host.arrival_order == [1, 0, 2]
    next_token_loss(reference(idx), idx).backward()
    reference_optimizer.step()
    assert_parity(engine.full_state_dict(), reference.state_dict())
    engine.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_step_does_not_wait_for_units_stepped_on_arrival(monkeypatch, device):
    """``step()`` returns while the worker still steps units on arrival; the next forward
    reads each unit once written, and a learning rate set after ``step()`` (as a scheduler
    does) is the next step's, not that of the units still being stepped."""
    kernel = SlowKernel(monkeypatch)
    engine, optimizer, reference, reference_optimizer = on_arrival_beside_torch(make_model(),
                                                                                device)
    learning_rates = [OPTIM["lr"], OPTIM["lr"] / 4]
    for idx, lr in zip((idx.to(device) for idx in token_batches(2)), learning_rates):
        for group in (optimizer.param_groups[0], reference_optimizer.param_groups[0]):
            group["lr"] = lr
        kernel.slow = True
        next_token_loss(engine(idx), idx).backward()
        started = time.perf_counter()
        optimizer.step()
        assert time.perf_counter() - started < HOLD_SECONDS, "step() waited for the worker"
        optimizer.zero_grad()
        next_token_loss(reference(idx), idx).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    kernel.slow = False
    assert_parity(engine.full_state_dict(), on_cpu(reference.state_dict()))
    engine.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_units_stepped_on_arrival_and_skipped_by_the_next_forward(monkeypatch, set_to_none,
                                                                  device):
    """A unit still being stepped on arrival when the next step begins: the next backward's
    gradients, zero_grad() and that step's own update of the unit (zero_grad(False) keeps zero
    gradients) all come after, and each step keeps its own learning rate."""
    kernel = SlowKernel(monkeypatch)
    engine, optimizer, reference, reference_optimizer = on_arrival_beside_torch(Stack(), device)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)).to(device)
    kernel.slow = True
    for lr, depth in zip([1e-2, 5e-2, 2e-2], [6, 1, 6]):
        for group in (optimizer.param_groups[0], reference_optimizer.param_groups[0]):
            group["lr"] = lr
        run_with_deadline(lambda: engine(x, depth).backward())
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
        reference(x, depth).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad(set_to_none=set_to_none)
    kernel.slow = False
    assert_parity(engine.full_state_dict(), on_cpu(reference.state_dict()))
    engine.close()


def test_a_step_without_backward_after_units_stepped_on_arrival():
    # zero_grad(set_to_none=False) keeps zeros as gradients: PyTorch steps them again.
    engine, optimizer, reference, reference_optimizer = on_arrival_beside_torch(Stack())
    x = torch.randn(4, 8)
    for module, opt in ((engine, optimizer), (reference, reference_optimizer)):
        module(x, 6).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        opt.step()
    assert_parity(engine.full_state_dict(), reference.state_dict())
    engine.close()


def test_a_failure_after_step_returned_is_raised_by_close(monkeypatch):
    """step() returns while units are stepped on arrival; if one fails after the last call
    that could report it, close() raises it (after freeing everything) instead of ending as
    if training went well."""
    engine, optimizer = tiered.initialize(
        Stack(), "configs/cpu.yaml", compute_dtype="fp32", device="cpu",
        optimizer=dict(OPTIM, accumulation_steps=1))
    x = torch.randn(4, 8)
    release = threading.Event()

    def failing(stepper, *args):
        release.wait()
        raise OSError(5, "injected failure in the update")

    monkeypatch.setattr(UnitStepper, "_kernel", failing)
    engine(x, 6).backward()
    optimizer.step()  # returns: the worker waits in the first unit's step
    release.set()
    deadline = time.monotonic() + 20
    while not engine.runtime.worker.failed and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(tiered.TieredError, match="injected failure"):
        engine.close()
    assert engine.runtime.manager.shards == {}


def test_consolidated_weights_right_after_step_are_the_new_ones(monkeypatch):
    kernel = SlowKernel(monkeypatch)
    engine, optimizer = tiered.initialize(make_model(), "configs/cpu.yaml",
                                          compute_dtype="fp32", device="cpu", optimizer=OPTIM)
    idx = token_batches(1)[0]
    next_token_loss(engine(idx), idx).backward()
    kernel.slow = True
    optimizer.step()
    early = {flat.name: full for flat, full in engine.consolidated_units()}
    kernel.slow = False
    optimizer.synchronize()
    late = {flat.name: full for flat, full in engine.consolidated_units()}
    assert [name for name in late if not torch.equal(early[name], late[name])] == []
    engine.close()


def test_the_clip_threshold_cannot_change_under_a_running_update():
    engine, optimizer = tiered.initialize(make_model(), "configs/cpu.yaml", device="cpu",
                                          optimizer=dict(OPTIM, max_grad_norm=1.0))
    assert optimizer.max_grad_norm == 1.0
    optimizer.max_grad_norm = 1.0  # the same value: nothing changes
    with pytest.raises(tiered.TieredError, match="set optimizer.max_grad_norm in the policy"):
        optimizer.max_grad_norm = None
    engine.close()
