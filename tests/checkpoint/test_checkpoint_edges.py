"""Checkpoint edge cases: state outside the units (buffers, extra states), saves at the wrong
moment, tags, and exports written again into the same folder."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import tiered

from distributed import run_ranks
from gpt import next_token_loss
from helpers import REPO
from helpers_checkpoint import gpt_engine, train_gpt
from helpers_models import OPTIM, token_batches


class Counted(nn.Module):
    """A layer with a non-tensor extra state: its calls in training mode."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x):
        if self.training:
            self.calls += 1
        return self.linear(x)

    def get_extra_state(self):
        return {"calls": self.calls}

    def set_extra_state(self, state) -> None:
        self.calls = state["calls"]


class SeenState(nn.Module):
    """A module whose extra state is a tensor."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.seen = torch.zeros(8)

    def forward(self, x):
        if self.training:
            self.seen = self.seen + x.detach().abs().mean(0)
        return self.linear(x)

    def get_extra_state(self):
        return self.seen.clone()

    def set_extra_state(self, state) -> None:
        self.seen = state.clone()


class Buffered(nn.Module):
    """BatchNorm (float running stats, an integer count), a complex buffer (a rotary table)
    that training turns, and extra states, in several units."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Counted(), SeenState()])
        self.norm = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 1)
        self.register_buffer("phase", torch.ones(4, dtype=torch.complex64))

    def forward(self, x):
        if self.training:
            self.phase *= torch.polar(torch.ones(4), x.detach()[0, :4])
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(self.norm(x)) + self.phase.real.sum()


def buffered_engine():
    torch.manual_seed(0)
    return tiered.initialize(Buffered(), "configs/cpu.yaml", compute_dtype="fp32", device="cpu",
                             optimizer=OPTIM)


def buffered_batches(count: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(16, 8, generator=g) for _ in range(count)]


def train_buffered(engine, optimizer, batches) -> list[float]:
    losses = []
    for x in batches:
        loss = engine(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def assert_same_state(expected: dict, actual: dict) -> None:
    assert list(expected) == list(actual)
    for name, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == actual[name].dtype and torch.equal(value, actual[name]), name
        else:
            assert value == actual[name], name


def test_resume_restores_buffers_and_extra_states(tmp_path):
    # README: a checkpoint saves every tier's state and resumes exactly. BatchNorm's running
    # stats and its integer count, and modules' extra states, are the model's state too (torch's
    # state_dict holds them): a fresh engine that loads must continue as the run that went on.
    batches = buffered_batches(5)
    engine, optimizer = buffered_engine()
    train_buffered(engine, optimizer, batches)
    expected = engine.full_state_dict()
    engine.close()

    engine, optimizer = buffered_engine()
    train_buffered(engine, optimizer, batches[:3])
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    engine.close()
    engine, optimizer = buffered_engine()
    engine.load_checkpoint(str(tmp_path / "ckpt"))
    train_buffered(engine, optimizer, batches[3:])
    actual = engine.full_state_dict()
    engine.close()
    assert expected["norm.num_batches_tracked"].item() == 5
    assert_same_state(expected, actual)


@pytest.mark.parametrize("accumulation_steps", [None, 2])
def test_a_save_between_backward_and_step_is_refused(accumulation_steps, tmp_path):
    # Gradients are not saved (nor by DeepSpeed), and a load drops them: a save while a
    # backward's gradients wait for their step would resume without them (with
    # accumulation_steps, units stepped on arrival are half a step ahead). It must refuse, and
    # write nothing.
    engine, optimizer = gpt_engine(accumulation_steps=accumulation_steps)
    batches = token_batches(2)
    train_gpt(engine, optimizer, batches[:1])
    engine.save_checkpoint(str(tmp_path / "ckpt"), "good")
    idx = batches[1]
    (next_token_loss(engine(idx), idx) / 2).backward()
    if accumulation_steps:
        (next_token_loss(engine(idx), idx) / 2).backward()
    with pytest.raises(tiered.CheckpointError, match="optimizer.step"):
        engine.save_checkpoint(str(tmp_path / "ckpt"), "mid")
    assert sorted(os.listdir(tmp_path / "ckpt")) == [".owner.lock", "good", "latest"]
    optimizer.step()  # the refusal changed nothing: the step goes on as usual
    optimizer.zero_grad()
    engine.save_checkpoint(str(tmp_path / "ckpt"), "after")  # after a step: allowed
    engine.close()


@pytest.mark.parametrize("first_shard,second_shard", [(16 << 10, 5 << 30), (5 << 30, 16 << 10)])
def test_exporting_again_into_a_folder_leaves_no_stale_weights(first_shard, second_shard,
                                                               tmp_path):
    # A second export into the same folder must be what a reader finds. A stale index left
    # beside a new single file makes tiered (and anything that reads the index first) load the
    # old shards; a stale model.safetensors beside a new index is what Hugging Face's
    # from_pretrained reads first.
    safetensors = pytest.importorskip("safetensors.torch")
    folder = tmp_path / "export"
    engine, optimizer = gpt_engine()
    engine.save_pretrained(str(folder), max_shard_bytes=first_shard)
    train_gpt(engine, optimizer, token_batches(2))
    files = engine.save_pretrained(str(folder), max_shard_bytes=second_shard)
    trained = engine.full_state_dict()
    engine.close()
    read = {}
    for path in hf_weight_files(folder):
        read.update(safetensors.load_file(str(path)))
    assert_same_state(trained, {key: read[key] for key in trained})
    fresh, _ = gpt_engine()
    fresh.load_pretrained(str(folder))
    assert_same_state(trained, fresh.full_state_dict())
    fresh.close()
    index = ["model.safetensors.index.json"] if len(files) > 1 else []
    assert sorted(os.listdir(folder)) == sorted(files + index)


def hf_weight_files(folder) -> list:
    """The files Hugging Face's from_pretrained reads from a local folder: model.safetensors
    when there is one, else the shards its index names (transformers' order)."""
    if (folder / "model.safetensors").exists():
        return [folder / "model.safetensors"]
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    return [folder / name for name in dict.fromkeys(index["weight_map"].values())]


@pytest.mark.parametrize("tag", ["a\0b", "a\nb", "x ", "..", "a/b", "latest"])
def test_a_bad_tag_is_refused_before_anything_is_written(tag, tmp_path):
    # A tag names a folder: one the OS refuses (a NUL byte raised a ValueError on rank 0 alone,
    # leaving the other ranks waiting in the collective that follows), a control character,
    # white space at an end ('latest' is read back stripped: "x " resumed from "x"), a path or
    # the name of the 'latest' file must be a CheckpointError on every rank, before anything
    # is created.
    engine, optimizer = gpt_engine()
    with pytest.raises(tiered.CheckpointError, match="checkpoint tag"):
        engine.save_checkpoint(str(tmp_path / "ckpt"), tag)
    assert not (tmp_path / "ckpt").exists()
    engine.close()


def test_loading_a_tag_that_is_not_there_names_it_and_the_tags_there(tmp_path):
    engine, optimizer = gpt_engine()
    train_gpt(engine, optimizer, token_batches(1))
    engine.save_checkpoint(str(tmp_path / "ckpt"), "first")
    engine.save_checkpoint(str(tmp_path / "ckpt"), "second")
    (tmp_path / "ckpt" / ".third.tmp").mkdir()  # a save that crashed: not a checkpoint
    with pytest.raises(tiered.CheckpointError, match=r"no checkpoint 'thrid' in .*ckpt; it holds "
                                                     r"first, second$"):
        engine.load_checkpoint(str(tmp_path / "ckpt"), "thrid")
    engine.close()


FULL_DISK = r"""
import os, resource, sys
sys.path[:0] = [{tests!r}, {examples!r}]
import torch, tiered
from helpers_checkpoint import gpt_engine, train_gpt
from helpers_models import token_batches
engine, optimizer = gpt_engine()
train_gpt(engine, optimizer, token_batches(2))
folder = engine.save_checkpoint({ckpt!r}, "first")
torch.save(engine.full_state_dict(), {first!r})
train_gpt(engine, optimizer, token_batches(3)[2:])
size = os.path.getsize(os.path.join(folder, "rank00000.safetensors"))
# No file may grow past half a rank file: writes past it fail with EFBIG (Python ignores
# SIGXFSZ), as a full disk fails them with ENOSPC.
resource.setrlimit(resource.RLIMIT_FSIZE, (size // 2, resource.RLIM_INFINITY))
try:
    engine.save_checkpoint({ckpt!r}, "second")
except tiered.CheckpointError as error:
    print("refused:", error)
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
engine.close()
"""


def test_a_file_size_limit_during_save_keeps_the_previous_checkpoint(tmp_path):
    # The full disk of README's promise without a tmpfs (test_checkpoint's needs root): a
    # process file-size limit makes the rank file's writes fail part way.
    ckpt, first = str(tmp_path / "ckpt"), str(tmp_path / "first.pt")
    script = FULL_DISK.format(tests=os.path.join(REPO, "tests"),
                              examples=os.path.join(REPO, "examples"), ckpt=ckpt, first=first)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "refused:" in done.stdout and "File too large" in done.stdout, done.stdout
    # Nothing half-written is left (the lock file is the folder's owner's: folder.py).
    assert sorted(os.listdir(ckpt)) == [".owner.lock", "first", "latest"]
    engine, _ = gpt_engine()
    engine.load_checkpoint(ckpt)
    assert_same_state(torch.load(first, weights_only=True), engine.full_state_dict())
    engine.close()


@pytest.mark.filterwarnings("ignore:tiered. save_pretrained leaves out")
def test_an_export_holds_buffers_of_any_dtype(tmp_path):
    # save_pretrained writes buffers in their own dtype; a complex64 one (or uint16, fp8) is
    # one safetensors holds and the export must too, not fail with a KeyError.
    safetensors = pytest.importorskip("safetensors.torch")
    engine, optimizer = buffered_engine()
    train_buffered(engine, optimizer, buffered_batches(2))
    files = engine.save_pretrained(str(tmp_path / "export"))
    expected = {k: v for k, v in engine.full_state_dict().items() if isinstance(v, torch.Tensor)}
    engine.close()
    written = safetensors.load_file(str(tmp_path / "export" / files[0]))
    assert written["phase"].dtype is torch.complex64
    assert_same_state(expected, {key: written[key] for key in expected})


def _save_buffered(rank: int, world: int, folder: str) -> None:
    engine, optimizer = buffered_engine()
    rows = slice(rank * 16 // world, (rank + 1) * 16 // world)
    train_buffered(engine, optimizer, [x[rows] for x in buffered_batches(3)])
    engine.save_checkpoint(os.path.join(folder, "ckpt"), "two")
    torch.save(engine.full_state_dict(), os.path.join(folder, f"buffered{rank}.pt"))
    engine.close()


def test_buffers_saved_by_two_ranks_load_at_one_from_rank_0(tmp_path):
    # Each rank's BatchNorm saw its own rows, so the ranks' running stats differ: a load at
    # another world size takes rank 0's (as DDP broadcasts rank 0's buffers).
    run_ranks(2, _save_buffered, str(tmp_path))
    saved = [torch.load(tmp_path / f"buffered{r}.pt", weights_only=True) for r in range(2)]
    assert not torch.equal(saved[0]["norm.running_mean"], saved[1]["norm.running_mean"])
    engine, _ = buffered_engine()
    engine.load_checkpoint(str(tmp_path / "ckpt"))
    assert_same_state(saved[0], engine.full_state_dict())
    engine.close()
