"""Checkpoints: exact resume, resharding, policy changes, crash safety, corruption, export."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import tiered

from distributed import run_ranks
from gpt import next_token_loss
from helpers import REPO, mounted
from helpers_checkpoint import engine_for
from helpers_models import (OPTIM, assert_parity, ddp_gradients, make_model, token_batches,
                            train_batches)

SCENARIOS = [(policy, delayed) for policy in ("cpu", "nvme") for delayed in (False, True)]


def resume_scenario(policy: str, delayed: bool, folder: str, rank: int = 0, world: int = 1):
    """Train 3 steps, save, train 3 more; load, train the same 3 again: both branches' losses
    and final weights."""
    engine, optimizer = engine_for(policy, folder, delayed)
    batches = token_batches(6)
    train_batches(engine, optimizer, batches[:3], rank, world)
    engine.save_checkpoint(os.path.join(folder, "ckpt"), f"{policy}-{delayed}")
    first = train_batches(engine, optimizer, batches[3:], rank, world)
    first_state = engine.full_state_dict()
    engine.load_checkpoint(os.path.join(folder, "ckpt"))
    second = train_batches(engine, optimizer, batches[3:], rank, world)
    second_state = engine.full_state_dict()
    engine.close()
    return first, first_state, second, second_state


def assert_identical(first, first_state, second, second_state) -> None:
    assert first == second, f"losses after the reload differ: {first} vs {second}"
    for name in first_state:
        assert torch.equal(first_state[name], second_state[name]), name


@pytest.mark.parametrize("policy,delayed", SCENARIOS)
def test_resume_is_exact_one_rank(policy, delayed, tmp_path):
    assert_identical(*resume_scenario(policy, delayed, str(tmp_path)))


def _resume_ranks(rank: int, world: int, folder: str) -> None:
    results = {f"{p}-{d}": resume_scenario(p, d, folder, rank, world) for p, d in SCENARIOS}
    torch.save(results, os.path.join(folder, f"resume{rank}.pt"))


def test_resume_is_exact_two_ranks(tmp_path):
    run_ranks(2, _resume_ranks, str(tmp_path))
    for rank in range(2):
        for name, result in torch.load(tmp_path / f"resume{rank}.pt", weights_only=True).items():
            assert_identical(*result)


def _train_and_save(rank: int, world: int, folder: str, policy: str, steps: int) -> None:
    engine, optimizer = engine_for(policy, folder)
    train_batches(engine, optimizer, token_batches(steps), rank, world)
    engine.save_checkpoint(os.path.join(folder, "ckpt"), "saved")
    torch.save(engine.full_state_dict(), os.path.join(folder, f"saved{rank}.pt"))
    engine.close()


def _load_and_train(rank: int, world: int, folder: str, policy: str, steps: int) -> None:
    engine, optimizer = engine_for(policy, folder)
    engine.load_checkpoint(os.path.join(folder, "ckpt"))
    loaded = engine.full_state_dict()
    train_batches(engine, optimizer, token_batches(steps)[-2:], rank, world)
    torch.save((loaded, engine.full_state_dict()), os.path.join(folder, f"loaded{rank}.pt"))
    engine.close()


def continuous(steps: int) -> dict:
    """The same training without a save, at one rank: what a resume at one rank must match."""
    engine, optimizer = engine_for("cpu", "/tmp")
    train_batches(engine, optimizer, token_batches(steps))
    state = engine.full_state_dict()
    engine.close()
    return state


def reference(worlds: list[int]) -> dict:
    """Plain PyTorch, step t's gradient averaged over ``worlds[t]`` ranks as DDP does (each
    rank's mean over its rows, then the mean over ranks, summed in rank order as the engine's
    reduction sums them), clipped, stepped with AdamW."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), **OPTIM)
    for world, idx in zip(worlds, token_batches(len(worlds))):
        for param, grad in zip(model.parameters(), ddp_gradients(model, idx, world)):
            param.grad = grad
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


@pytest.mark.parametrize("saved_world,loaded_world", [(2, 1), (1, 2)])
def test_resharding_keeps_the_weights_and_training_continues_with_parity(
        saved_world, loaded_world, tmp_path):
    def run(world, fn, *args):
        if world == 1:
            fn(0, 1, *args)
        else:
            run_ranks(world, fn, *args)

    run(saved_world, _train_and_save, str(tmp_path), "nvme", 3)
    run(loaded_world, _load_and_train, str(tmp_path), "cpu", 5)
    saved = torch.load(tmp_path / "saved0.pt", weights_only=True)
    expected = reference([saved_world] * 3 + [loaded_world] * 2)
    for rank in range(loaded_world):
        loaded, trained = torch.load(tmp_path / f"loaded{rank}.pt", weights_only=True)
        for name in saved:
            assert torch.equal(loaded[name], saved[name]), name
        assert_parity(trained, expected)


@pytest.mark.parametrize("saved,loaded", [("nvme", "cpu"), ("cpu", "nvme")])
def test_loading_under_another_policy_continues_exactly(saved, loaded, tmp_path):
    folder = str(tmp_path)
    _train_and_save(0, 1, folder, saved, 3)
    _load_and_train(0, 1, folder, loaded, 5)
    loaded_state, trained = torch.load(tmp_path / "loaded0.pt", weights_only=True)
    saved_state = torch.load(tmp_path / "saved0.pt", weights_only=True)
    assert all(torch.equal(loaded_state[k], saved_state[k]) for k in saved_state)
    reference = continuous(5)
    for name in reference:  # same world size: the same arithmetic, bit for bit
        assert torch.equal(trained[name], reference[name]), name


def saved_checkpoint(tmp_path):
    engine, optimizer = engine_for("cpu", str(tmp_path))
    train_batches(engine, optimizer, token_batches(2))
    folder = engine.save_checkpoint(str(tmp_path / "ckpt"), "good")
    return engine, optimizer, folder


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_file_fails_by_name_and_loads_nothing(damage, tmp_path):
    engine, optimizer, folder = saved_checkpoint(tmp_path)
    train_batches(engine, optimizer, token_batches(3)[2:])  # the engine moves on from the checkpoint
    before = engine.full_state_dict()
    path = os.path.join(folder, "rank00000.safetensors")
    data = bytearray(open(path, "rb").read())
    if damage == "truncate":
        data = data[:len(data) // 2]
    else:
        data[len(data) * 2 // 3] ^= 0x10
    open(path, "wb").write(bytes(data))
    with pytest.raises(tiered.CheckpointError, match="rank00000.safetensors") as error:
        engine.load_checkpoint(str(tmp_path / "ckpt"))
    assert ("truncated" if damage == "truncate" else "corrupted") in str(error.value)
    after = engine.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "half-loaded"
    engine.close()


def test_a_checkpoint_of_another_model_or_none_at_all_is_refused(tmp_path):
    engine, optimizer, folder = saved_checkpoint(tmp_path)
    engine.close()
    other, _ = tiered.initialize(torch.nn.Sequential(torch.nn.Linear(4, 4)), "configs/cpu.yaml",
                                 device="cpu")
    with pytest.raises(tiered.CheckpointError, match="another model"):
        other.load_checkpoint(str(tmp_path / "ckpt"))
    with pytest.raises(tiered.CheckpointError, match="no checkpoint in"):
        other.load_checkpoint(str(tmp_path / "nowhere"))
    os.remove(os.path.join(folder, "manifest.json"))
    with pytest.raises(tiered.CheckpointError, match="not a complete checkpoint"):
        other.load_checkpoint(str(tmp_path / "ckpt"), "good")
    other.close()


def test_a_full_disk_during_save_keeps_the_previous_checkpoint(tmp_path):
    disk = tmp_path / "disk"
    with mounted(tmp_path, "tmpfs", "size=2m", name=disk.name):
        engine, optimizer = engine_for("cpu", str(tmp_path))
        train_batches(engine, optimizer, token_batches(2))
        engine.save_checkpoint(str(disk), "first")
        good = engine.full_state_dict()
        train_batches(engine, optimizer, token_batches(3)[2:])
        free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
        (disk / "filler").write_bytes(b"\0" * (free - 20_000))  # no room for another one
        with pytest.raises(tiered.CheckpointError, match="cannot write .*No space left"):
            engine.save_checkpoint(str(disk), "second")
        assert sorted(os.listdir(disk)) == [".owner.lock", "filler", "first", "latest"]
        assert (disk / "latest").read_text() == "first"
        engine.load_checkpoint(str(disk))
        loaded = engine.full_state_dict()
        assert all(torch.equal(good[k], loaded[k]) for k in good)
        engine.close()


SAVE_AND_HANG = r"""
import os, sys, time
sys.path[:0] = [{tests!r}, {examples!r}]
import torch, tiered
from tiered.checkpoint import format as fmt
from helpers_checkpoint import engine_for
from helpers_models import token_batches, train_batches
engine, optimizer = engine_for("cpu", {folder!r})
train_batches(engine, optimizer, token_batches(2))
engine.save_checkpoint({ckpt!r}, "first")
torch.save(engine.full_state_dict(), {first!r})
train_batches(engine, optimizer, token_batches(3)[2:])
write = fmt.Writer.write
def slow_write(self, tensor):  # the save crawls, so the parent's SIGKILL lands inside it
    time.sleep(0.05)
    write(self, tensor)
fmt.Writer.write = slow_write
print("saving", flush=True)
engine.save_checkpoint({ckpt!r}, "second")
print("saved", flush=True)
"""


def test_killed_in_the_middle_of_a_save_the_previous_checkpoint_loads(tmp_path):
    ckpt, first = str(tmp_path / "ckpt"), str(tmp_path / "first.pt")
    script = SAVE_AND_HANG.format(tests=os.path.join(REPO, "tests"),
                                  examples=os.path.join(REPO, "examples"), folder=str(tmp_path),
                                  ckpt=ckpt, first=first)
    child = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE,
                             text=True)
    assert child.stdout.readline().strip() == "saving"
    deadline = time.time() + 30
    while not os.path.exists(os.path.join(ckpt, ".second.tmp", "rank00000.safetensors")):
        assert time.time() < deadline, "the save never started writing"
        time.sleep(0.01)
    time.sleep(0.1)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert child.returncode == -signal.SIGKILL
    assert open(os.path.join(ckpt, "latest")).read() == "first"
    assert not os.path.exists(os.path.join(ckpt, "second")), "a half-written save was published"
    engine, _ = engine_for("cpu", str(tmp_path))
    with pytest.warns(UserWarning, match=r"left in .*ckpt: \.second\.tmp$"):  # the dead save's
        engine.load_checkpoint(ckpt)
    loaded, saved = engine.full_state_dict(), torch.load(first, weights_only=True)
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    engine.close()


def test_exported_safetensors_load_into_the_plain_model(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    engine, optimizer = engine_for("nvme", str(tmp_path))
    train_batches(engine, optimizer, token_batches(2))
    files = engine.save_pretrained(str(tmp_path / "export"), max_shard_bytes=16 << 10)
    assert len(files) > 1
    index = json.loads((tmp_path / "export" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    state = {}
    for name in files:
        state.update(safetensors.load_file(str(tmp_path / "export" / name)))
    plain = make_model()
    plain.load_state_dict(state, strict=True)
    idx = token_batches(1)[0]
    with torch.no_grad():
        torch.testing.assert_close(plain(idx), engine(idx), rtol=0, atol=0)
    assert set(index["weight_map"]) == set(plain.state_dict())
    engine.close()


def test_loading_right_after_a_delayed_step_waits_for_its_update(tmp_path):
    engine, optimizer = engine_for("nvme", str(tmp_path), delayed=True)
    train_batches(engine, optimizer, token_batches(3))
    engine.save_checkpoint(str(tmp_path / "ckpt"), "saved")
    saved = engine.full_state_dict()
    train_batches(engine, optimizer, token_batches(5)[3:])  # the last update is still running
    engine.load_checkpoint(str(tmp_path / "ckpt"))
    loaded = engine.full_state_dict()
    assert all(torch.equal(saved[k], loaded[k]) for k in saved), "the update wrote over the load"
    engine.close()


def fp16_scenario(folder: str):
    """fp16 with the delayed update and a loss scale that overflows for many steps: the save
    happens with an overflowed update pending (nothing written, the scale still to lower)."""
    engine, optimizer = tiered.initialize(
        make_model(), "configs/cpu.yaml", compute_dtype="fp16", device="cpu",
        loss_scale={"initial_scale": 2.0**40},
        optimizer=dict(OPTIM, delayed_update={"enabled": True, "warmup_steps": 0}))

    def run(batches):
        losses = []
        for idx in batches:
            loss = next_token_loss(engine(idx), idx)
            engine.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        optimizer.synchronize()
        return losses, engine.scaler.scale, optimizer.skipped_steps, engine.full_state_dict()

    batches = token_batches(6)
    run(batches[:3])
    engine.save_checkpoint(os.path.join(folder, "ckpt"), "fp16")
    first = run(batches[3:])
    engine.load_checkpoint(os.path.join(folder, "ckpt"))
    second = run(batches[3:])
    engine.close()
    return first, second


def test_resume_keeps_a_pending_overflow_and_the_loss_scale(tmp_path):
    (losses, scale, skipped, state), again = fp16_scenario(str(tmp_path))
    assert skipped >= 4 and scale < 2.0**40  # the scenario overflows across the save
    assert again[:3] == (losses, scale, skipped)
    assert all(torch.equal(state[k], again[3][k]) for k in state)


def test_writer_copies_non_contiguous_tensors_whole(tmp_path):
    from tiered.checkpoint.format import Entry, Reader, Writer

    matrix = torch.arange(64.0).view(8, 8)
    columns = matrix.t()  # not contiguous
    writer = Writer(str(tmp_path / "t.safetensors"), [Entry("t", torch.float32, (8, 8))])
    writer.write(columns)
    writer.close()
    out = torch.empty(8, 8)
    reader = Reader(str(tmp_path / "t.safetensors"))
    reader.read("t", out)
    assert torch.equal(out, columns)


def test_a_write_that_fails_between_pieces_keeps_the_old_version(tmp_path):
    from tiered.placement.plan import StateKind

    engine, _ = tiered.initialize(
        make_model(), "configs/nvme.yaml", compute_dtype="fp32", device="cpu",
        nvme={"path": str(tmp_path)}, optimizer={"sub_group_size": 1024})
    manager = engine.manager
    unit = max(range(len(engine.runtime.flats)), key=lambda u: manager.shards[(u, StateKind.MASTER)].numel)
    shard = manager.shards[(unit, StateKind.MASTER)]
    assert shard.numel > 1024  # several pieces
    before = torch.empty(shard.numel)
    manager.copy_out(unit, StateKind.MASTER, before)
    extent = shard.file.extent
    short = torch.ones(shard.numel - 1)  # the copy of the last piece fails
    with pytest.raises(RuntimeError):
        manager.store(unit, StateKind.MASTER, short)
    after = torch.empty(shard.numel)
    manager.copy_out(unit, StateKind.MASTER, after)
    assert shard.file.extent is extent and torch.equal(before, after)
    engine.close()


def test_saving_a_tag_again_survives_a_crash_between_the_renames(tmp_path, monkeypatch):
    from tiered.checkpoint import checkpoint as ckpt_module

    engine, optimizer, folder = saved_checkpoint(tmp_path)
    good = engine.full_state_dict()
    train_batches(engine, optimizer, token_batches(3)[2:])
    rename = os.rename

    def crash_on_publish(src, dst):
        if src.endswith(".good.tmp"):
            raise OSError(5, "simulated crash")
        rename(src, dst)

    monkeypatch.setattr(ckpt_module.os, "rename", crash_on_publish)
    with pytest.raises(tiered.CheckpointError):
        engine.save_checkpoint(str(tmp_path / "ckpt"), "good")
    monkeypatch.setattr(ckpt_module.os, "rename", rename)
    assert not os.path.exists(folder)  # set aside, not yet replaced
    engine.load_checkpoint(str(tmp_path / "ckpt"))  # finds the copy set aside
    loaded = engine.full_state_dict()
    assert all(torch.equal(good[k], loaded[k]) for k in good)
    engine.close()


class TiledModel(torch.nn.Module):
    """A model whose wide layer is tiled, with a bias, and a non-contiguous buffer."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 32)
        self.wide = torch.nn.Linear(32, 64)
        self.register_buffer("rotation", torch.arange(16.0).view(4, 4).t())

    def forward(self, x):
        return self.wide(torch.tanh(self.inp(x)))


@pytest.mark.parametrize("frozen_weight", [False, True])
def test_export_before_any_forward_with_tiles_and_buffers(frozen_weight, tmp_path):
    # With the tiled layer's weight frozen and its bias trained (BitFit), each tile's weight
    # and bias are in two units (units.split_frozen): the layer is written after both.
    safetensors = pytest.importorskip("safetensors.torch")
    torch.manual_seed(0)
    model = TiledModel()
    model.wide.weight.requires_grad_(not frozen_weight)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    engine, _ = tiered.initialize(model, "configs/cpu.yaml", device="cpu", compute_dtype="fp32",
                                  tiling={"max_unit_bytes": 2048})
    assert any(f.spec.frozen_part for f in engine.runtime.flats) == frozen_weight
    assert isinstance(model.wide, tiered.TiledLinear) and model.wide.has_bias
    files = engine.save_pretrained(str(tmp_path / "export"))
    state = safetensors.load_file(str(tmp_path / "export" / files[0]))
    assert set(state) == set(reference)
    for name in reference:
        assert torch.equal(state[name], reference[name]), name
    engine.close()


def test_export_of_a_model_that_is_a_tiled_layer(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    torch.manual_seed(0)
    model = tiered.TiledLinear(16, 12, True, in_splits=2, out_splits=3)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    engine, _ = tiered.initialize(model, "configs/cpu.yaml", device="cpu", compute_dtype="fp32")
    files = engine.save_pretrained(str(tmp_path / "export"))
    state = safetensors.load_file(str(tmp_path / "export" / files[0]))
    assert set(state) == {"weight", "bias"}
    assert torch.equal(state["weight"], reference["weight"])
    assert torch.equal(state["bias"], reference["bias"])
    engine.close()


def _damaged_rank_load(rank: int, world: int, folder: str) -> None:
    engine, optimizer = engine_for("cpu", folder)
    train_batches(engine, optimizer, token_batches(2), rank, world)
    engine.save_checkpoint(os.path.join(folder, "ckpt"), "two")
    train_batches(engine, optimizer, token_batches(3)[2:], rank, world)
    before = engine.full_state_dict()
    engine.runtime.group.barrier()
    if rank == 1:  # only rank 1's file is damaged
        path = os.path.join(folder, "ckpt", "two", "rank00001.safetensors")
        data = bytearray(open(path, "rb").read())
        data[-10] ^= 0xFF
        open(path, "wb").write(bytes(data))
    engine.runtime.group.barrier()
    outcome = "loaded"
    try:
        engine.load_checkpoint(os.path.join(folder, "ckpt"))
    except tiered.CheckpointError as error:
        outcome = str(error)
    after = engine.full_state_dict()
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    torch.save((outcome, unchanged), os.path.join(folder, f"damaged{rank}.pt"))
    engine.close()


def test_ranks_agree_when_one_cannot_load(tmp_path):
    run_ranks(2, _damaged_rank_load, str(tmp_path))
    outcomes = [torch.load(tmp_path / f"damaged{r}.pt", weights_only=True) for r in range(2)]
    assert "rank00001.safetensors" in outcomes[1][0]
    assert "another rank cannot use the checkpoint" in outcomes[0][0]
    assert outcomes[0][1] and outcomes[1][1], "a rank loaded while the other refused"


def _commit_fails_on_rank0(rank: int, world: int, folder: str) -> None:
    from tiered.checkpoint import checkpoint as ckpt_module

    engine, optimizer = engine_for("cpu", folder)
    train_batches(engine, optimizer, token_batches(2), rank, world)
    if rank == 0:
        def full_disk(*args):
            raise OSError(28, "No space left on device")
        ckpt_module._commit = full_disk
    try:
        engine.save_checkpoint(os.path.join(folder, "ckpt"), "x")
        outcome = "saved"
    except tiered.CheckpointError as error:
        outcome = str(error)
    torch.save(outcome, os.path.join(folder, f"commit{rank}.pt"))
    engine.close()


def test_a_save_failing_on_rank_0_raises_on_every_rank(tmp_path):
    run_ranks(2, _commit_fails_on_rank0, str(tmp_path))
    outcomes = [torch.load(tmp_path / f"commit{r}.pt", weights_only=True) for r in range(2)]
    assert "No space left" in outcomes[0]
    assert "rank 0 could not complete" in outcomes[1]
