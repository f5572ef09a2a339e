"""Failures inside an update whose states live on NVMe, and shapes at the edges of the plan: no
transfer outlives the call that failed, an update that failed part-way is never computed on,
one unit's read error is never another's, a unit of no elements trains, and frozen units add
nothing to the buffers sized for gradients."""
from __future__ import annotations

import errno
import os
import time

import pytest
import torch
from torch import nn

import tiered
from tiered.engine.build import flat_units, memory_plan
from tiered.placement.plan import StateKind
from tiered.policy.config import resolve
from tiered.tiers import aio
from tiered.tiers.aio import inject_faults

from gpt import GPT, add_lora, next_token_loss
from helpers import REPO, update_failing_with

NVME = os.path.join(REPO, "configs", "nvme.yaml")


def nvme_engine(tmp_path, model: nn.Module | None = None, **nvme):
    torch.manual_seed(0)
    return tiered.initialize(model if model is not None else GPT(64, 32, 2, 2), NVME,
                             device="cpu", compute_dtype="fp32",
                             nvme={"path": str(tmp_path), **nvme})


def train_step(engine, optimizer, idx: torch.Tensor) -> None:
    next_token_loss(engine(idx), idx).backward()
    optimizer.step()
    optimizer.zero_grad()
    optimizer.synchronize()


def test_a_failed_state_read_leaves_no_transfer_running(tmp_path, monkeypatch):
    """A piece's master read fails while its moment read is slow: the update raises only once
    that read has landed, since the staging set it lands in is reused or freed after it."""
    engine, optimizer = nvme_engine(tmp_path, queue_depth=4)
    idx = torch.randint(0, 64, (4, 16))
    train_step(engine, optimizer, idx)
    manager = engine.manager
    kind_of = {shard.file.path: key for key, shard in manager.shards.items()
               if shard.file is not None}
    landed: list[float] = []
    real_preadv = os.preadv

    def preadv(fd, buffers, offset):
        count = real_preadv(fd, buffers, offset)
        landed.append(time.monotonic())
        return count

    monkeypatch.setattr(aio.os, "preadv", preadv)
    first = engine.runtime.forward_order(list(range(len(engine.runtime.flats))))[0]
    failed: list[int] = []

    def fault(verb, path, offset, size):
        unit, kind = kind_of.get(path, (None, None))
        if verb != "read" or unit != first:
            return
        if kind is StateKind.MASTER:
            failed.append(unit)
            raise OSError(errno.EIO, "injected EIO")
        if kind is StateKind.EXP_AVG:
            time.sleep(0.5)  # the same piece's other read, still in flight at the failure

    next_token_loss(engine(idx), idx).backward()
    with inject_faults(fault):
        with pytest.raises(tiered.TieredError, match="injected EIO"):
            optimizer.step()
            optimizer.synchronize()
        raised = time.monotonic()
        time.sleep(1.0)  # a read still in flight would land in here
    assert failed and landed and max(landed) < raised
    engine.close()


def test_an_update_that_failed_part_way_is_never_computed_on(tmp_path):
    engine, optimizer = nvme_engine(tmp_path, block_size=4096, queue_depth=1)
    idx = torch.randint(0, 64, (4, 16))
    train_step(engine, optimizer, idx)
    started: list[str] = []

    def fault(verb, path, offset, size):
        # Each unit writes its master, moments, then weights: the second unit's master fails
        # after the first unit's new weights were written.
        if verb != "write":
            return
        if offset == 0:
            started.append(path)
        if len(started) == 5 and offset == 4096:
            raise OSError(errno.EIO, "injected EIO")

    update_failing_with(engine, optimizer, idx, fault, "injected EIO")
    with torch.no_grad(), pytest.raises(tiered.TieredError, match="CPU worker failed"):
        engine(idx)
    engine.close()


def test_one_units_read_error_is_not_anothers(tmp_path):
    """Every read-ahead buffer is held by reads of later units, one of which fails: taking an
    earlier unit reuses that buffer and reads the unit it was asked for."""
    engine, _ = nvme_engine(tmp_path, model=GPT(64, 32, 4, 2))
    readahead, manager = engine.runtime.readahead, engine.manager
    assert len(manager.staging_names("param_in")) == 2
    bad = manager.shards[(3, StateKind.PARAM)].file.path

    def fault(verb, path, offset, size):
        if verb == "read" and path == bad:
            time.sleep(0.2)
            raise OSError(errno.EIO, "injected EIO")

    with inject_faults(fault):
        readahead.read_ahead(2)
        readahead.read_ahead(3)
        landed = readahead.take(1)
        expected = torch.empty(manager.shards[(1, StateKind.PARAM)].numel)
        manager.copy_out(1, StateKind.PARAM, expected)
        assert torch.equal(landed.tensor, expected)
        readahead.give_back(landed, None)
    engine.close()


class _WithEmpty(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.empty = nn.Parameter(torch.empty(0))  # the root unit: no elements at all

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_a_unit_of_no_elements_trains_with_its_states_on_nvme(tmp_path):
    states = {}
    for policy in ("cpu", "nvme"):
        torch.manual_seed(0)
        engine, optimizer = tiered.initialize(
            _WithEmpty(), os.path.join(REPO, "configs", f"{policy}.yaml"), device="cpu",
            compute_dtype="fp32", nvme={"path": str(tmp_path)})
        assert [flat.shard_numel for flat in engine.runtime.flats][-1] == 0
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
        for _ in range(2):
            engine(x).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        states[policy] = engine.full_state_dict()
        engine.close()
    for name, value in states["cpu"].items():
        assert torch.equal(states["nvme"][name], value), name


def test_frozen_units_add_nothing_to_what_is_sized_for_gradients():
    """On a GPU the gradient landing buffers and the gradients in flight are sized for the
    largest unit that has a gradient: a frozen block's weights never land."""
    with tiered.init(device="cpu"):
        model = add_lora(GPT(64, 64, 2, 2), 4)
    policy = resolve(os.path.join(REPO, "configs", "cpu.yaml"), {"compute_dtype": "bf16"})
    flats = flat_units(model, policy, 0, 1, torch.device("cpu"))
    plan = memory_plan(policy, torch.device("cuda"), flats)
    # By hand, from GPT(64, 64, 2, 2)'s shapes (untied, no position table): each block's frozen
    # half is ln1 128 + qkv 64*192+192 + proj 64*64+64 + ln2 128 + fc 64*256+256 + out
    # 256*64+64 = 49984 elements; its trained half the adapters of rank 4 on qkv (4*64+192*4),
    # proj (4*64+64*4), fc (4*64+256*4) and out (4*256+64*4) = 4096; the root (frozen) emb
    # 64*64, ln 128, head 64*64 = 8320.
    frozen, trained, root = 49984, 4096, 8320
    assert [(f.padded_numel, f.has_trainable) for f in flats] == [
        (frozen, False), (trained, True)] * 2 + [(root, False)]
    assert plan.staging["grad0"].numel == trained
    # bf16 working set: the root and two chains gathered (a chain is a block's two halves),
    # 4 gradients in flight ([Note: gradients in flight]) of the largest trained unit, and a
    # prefetch of twice the largest module. Sized for the frozen half instead, the gradients
    # would be 4 * 49984 * 2 bytes.
    gathered = (root + 2 * (frozen + trained)) * 2
    in_flight = 4 * trained * 2
    prefetch = 2 * (frozen + trained) * 2
    assert plan.working_set == gathered + in_flight + prefetch == 482048


def test_copying_nvme_weights_out_leaves_the_read_ahead_buffers_alone(tmp_path):
    """On a GPU a gather's copy out of a read-ahead buffer may still run after its iteration;
    a checkpoint reading NVMe weights (the current ones, a delayed update pending) must not
    write into those buffers."""
    torch.manual_seed(0)
    engine, optimizer = tiered.initialize(
        GPT(64, 32, 2, 2), NVME, device="cpu", compute_dtype="fp32",
        nvme={"path": str(tmp_path)},
        optimizer={"delayed_update": {"enabled": True, "warmup_steps": 0}})
    idx = torch.randint(0, 64, (4, 16))
    next_token_loss(engine(idx), idx).backward()
    optimizer.step()  # returns at once: the checkpoint saves the current weights too
    ring = [engine.manager.staging_block(name)
            for name in engine.manager.staging_names("param_in")]
    for block in ring:
        block.fill_(7)
    engine.save_checkpoint(str(tmp_path / "checkpoint"))
    assert all(bool((block == 7).all()) for block in ring)
    engine.close()
