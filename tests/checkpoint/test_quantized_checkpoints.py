"""Checkpoints of frozen units kept quantized (``params.frozen_dtype`` int8 | nf4; [Note:
records in checkpoints] in checkpoint/records.py): each rank's shard of a record saved and
loaded as its bytes, never quantized again. The oracle is the uninterrupted run: a resume into
an engine built from other weights (another seed: its own records differ) continues it bit
for bit, which it can only do from the saved bytes."""
from __future__ import annotations

import os

import pytest
import torch

import tiered

from distributed import run_ranks
from helpers_models import token_batches, train_batches
from helpers_quantized import qlora_engine

SCENARIOS = (("nf4", "cpu"), ("nf4", "nvme"), ("int8", "cpu"))
BATCHES = token_batches(4)


def save_and_go_on(fmt: str, policy: str, folder: str, rank: int = 0, world: int = 1):
    """Two steps, a save (tag ``<fmt>-<policy>-<world>``), two more: the state saved, the
    losses and the state after them (the uninterrupted run)."""
    engine, optimizer = qlora_engine(fmt, policy, folder)
    try:
        train_batches(engine, optimizer, BATCHES[:2], rank, world)
        engine.save_checkpoint(os.path.join(folder, "ckpt"), f"{fmt}-{policy}-{world}")
        saved = engine.full_state_dict()
        losses = train_batches(engine, optimizer, BATCHES[2:], rank, world)
        return saved, losses, engine.full_state_dict()
    finally:
        engine.close()


def resumed(fmt: str, policy: str, folder: str, tag: str, rank: int = 0, world: int = 1,
            train: bool = True):
    """A fresh engine of other weights that loads ``tag``: its state loaded, then (``train``)
    the losses and state of the last two steps."""
    engine, optimizer = qlora_engine(fmt, policy, folder, seed=7)
    try:
        engine.load_checkpoint(os.path.join(folder, "ckpt"), tag)
        loaded = engine.full_state_dict()
        losses = train_batches(engine, optimizer, BATCHES[2:] if train else [], rank, world)
        return loaded, losses, engine.full_state_dict()
    finally:
        engine.close()


def assert_equal(state: dict, expected: dict) -> None:
    assert state.keys() == expected.keys()
    for name in expected:
        assert torch.equal(state[name], expected[name]), name


def assert_resumed(uninterrupted, resumed_run) -> None:
    saved, losses, state = uninterrupted
    loaded, resumed_losses, resumed_state = resumed_run
    assert_equal(loaded, saved)
    assert resumed_losses == losses
    assert_equal(resumed_state, state)


@pytest.mark.parametrize("fmt,policy", SCENARIOS)
def test_a_resume_computes_with_the_saved_records_bit_for_bit(fmt, policy, tmp_path):
    folder = str(tmp_path)
    uninterrupted = save_and_go_on(fmt, policy, folder)
    tag = f"{fmt}-{policy}-1"
    manifest = (tmp_path / "ckpt" / tag / "manifest.json").read_text()
    assert f'"format": "{fmt}"' in manifest  # the record's format, in each quantized unit
    assert_resumed(uninterrupted, resumed(fmt, policy, folder, tag))


def _two_ranks(rank: int, world: int, folder: str) -> None:
    # At two ranks: a resume; and a load of the one-rank checkpoint the test saved first.
    results = {"resume": (save_and_go_on("nf4", "nvme", folder, rank, world),
                          resumed("nf4", "nvme", folder, "nf4-nvme-2", rank, world)),
               "from one": resumed("nf4", "cpu", folder, "nf4-cpu-1", rank, world, train=False)}
    torch.save(results, os.path.join(folder, f"rank{rank}.pt"))


def test_two_ranks_resume_and_records_load_under_another_world_size(tmp_path):
    # The record's bytes are recut whole at another world size: 1 -> 2 and 2 -> 1 load the
    # very weights saved (the dequantized base among them) and train on as at the new size.
    folder = str(tmp_path)
    one = save_and_go_on("nf4", "cpu", folder)
    run_ranks(2, _two_ranks, folder)
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert_resumed(*results["resume"])
        loaded, _, _ = results["from one"]
        assert_equal(loaded, one[0])
    loaded, _, _ = resumed("nf4", "cpu", folder, "nf4-nvme-2", train=False)
    assert_equal(loaded, torch.load(tmp_path / "rank0.pt", weights_only=True)["resume"][0][0])


def test_another_frozen_dtype_or_compute_dtype_is_refused_by_name(tmp_path):
    # A record's bytes load only as what they are: nothing is quantized again.
    folder = str(tmp_path)
    save_and_go_on("nf4", "cpu", folder)
    checkpoint = os.path.join(folder, "ckpt")
    for fmt, message in (("int8", "params.frozen_dtype 'nf4', this engine's is 'int8'"),
                         ("compute", "params.frozen_dtype 'nf4', this engine's is 'compute'")):
        engine, _ = qlora_engine(fmt, "cpu", folder)
        try:
            before = engine.full_state_dict()
            with pytest.raises(tiered.CheckpointError, match=message):
                engine.load_checkpoint(checkpoint)
            assert_equal(engine.full_state_dict(), before)  # nothing loaded
        finally:
            engine.close()
    # Under another compute dtype the record's other tensors (nf4's scales, biases) differ.
    engine, _ = qlora_engine("nf4", "cpu", folder, compute_dtype="bf16")
    try:
        with pytest.raises(tiered.CheckpointError, match=r"keeps its frozen weights as nf4 "
                                                         r"with bfloat16 .*, the checkpoint as "
                                                         r"nf4 with float32"):
            engine.load_checkpoint(checkpoint)
    finally:
        engine.close()
