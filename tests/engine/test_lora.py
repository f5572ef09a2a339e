"""LoRA-style fine-tuning: every weight of the model frozen, small trainable adapters inside each
block's linear layers. ``units.split_frozen`` makes two units of each block (its frozen weights,
kept as weights alone, and its adapters, with full AdamW state), so the frozen weights cost their
own bytes and nothing more; training is PyTorch's bit for bit, and a checkpoint taken with one
set of frozen parameters resumes with another, mapped by parameter name."""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial

import pytest
import torch
from torch import nn

import tiered
from tiered.placement.plan import StateKind

from gpt import GPT, Block, add_lora, next_token_loss
from helpers import REPO, rewrite_manifest
from helpers_frozen import assert_same_states, frozen_model, resumed, torch_changing_midway, train
from helpers_models import (OPTIM, RANK, SEQ, VOCAB, assert_parity, assert_parity_on_host, batches,
                            lora_model, make_model, states_by_name, train_torch)
from helpers_tiers import dram_bytes


def engine_for(policy: str, nvme: str, optimizer: dict | None = None, **overrides):
    return tiered.initialize(lora_model(), os.path.join(REPO, "configs", f"{policy}.yaml"),
                             compute_dtype="fp32", device="cpu", nvme={"path": nvme},
                             optimizer=dict(OPTIM, sub_group_size=1024, **(optimizer or {})),
                             **overrides)


@pytest.mark.parametrize("policy", ["cpu", "nvme", "gpu"])
def test_lora_trains_bit_for_bit_as_torch(policy, tmp_path):
    engine, optimizer = engine_for(policy, str(tmp_path))
    names = [flat.name for flat in engine.runtime.flats]
    state = train(engine, optimizer)
    engine.close()
    assert names == ["blocks.0 (frozen)", "blocks.0", "blocks.1 (frozen)", "blocks.1", "<root>"]
    model = lora_model()
    expected = train_torch(model, torch.optim.AdamW(model.parameters(), fused=True, **OPTIM))
    initial = lora_model().state_dict()
    for name in expected:
        assert torch.equal(state[name], expected[name]), name
        assert torch.equal(state[name], initial[name]) == ("lora_" not in name), name


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["cpu", "gpu"])
def test_lora_on_cuda(policy, tmp_path):
    engine, optimizer = tiered.initialize(
        lora_model(), os.path.join(REPO, "configs", f"{policy}.yaml"), compute_dtype="fp32",
        device="cuda", optimizer=OPTIM)
    state = train(engine, optimizer)
    engine.close()
    model = lora_model().cuda()
    expected = train_torch(model, torch.optim.AdamW(model.parameters(), fused=True, **OPTIM),
                           device="cuda")
    assert_parity_on_host(state, expected)


@pytest.mark.parametrize("split", [True, False])
def test_frozen_weights_cost_their_own_bytes_only(split, tmp_path):
    engine, _ = engine_for("cpu", str(tmp_path), units={"split_frozen": split})
    try:
        placement = engine.placement()
        every = list(placement["blocks.0"])
        expected = 0
        for flat in engine.runtime.flats:
            trained = sum(p.numel for p in flat.spec.params if p.trainable)
            kinds = list(placement[flat.name])
            assert kinds == (every if trained else ["param"]), flat.name
            assert trained in (0, flat.numel) or not split, flat.name  # never mixed when split
            expected += dram_bytes(flat, [StateKind(kind) for kind in kinds], torch.float32)
        assert engine.memory_report()["dram"]["current"] == expected
        adapters = sum(p.numel() for n, p in lora_model().named_parameters() if "lora_" in n)
        if split:  # all of AdamW's state is the adapters'
            assert sum(f.numel for f in engine.runtime.flats if f.has_trainable) == adapters
    finally:
        engine.close()


def test_a_resume_may_freeze_more_across_split_units(tmp_path):
    # blocks.1.fc.weight trains two steps, then is frozen: it moves from block 1's trainable
    # unit to its frozen one (weights alone), the others keep their masters, moments and step
    # counts, and the run goes on as PyTorch's, where a frozen parameter is no longer stepped.
    ckpt = str(tmp_path / "ckpt")
    engine, optimizer = tiered.initialize(
        frozen_model(), os.path.join(REPO, "configs", "cpu.yaml"), compute_dtype="fp32",
        device="cpu", optimizer=OPTIM)
    train(engine, optimizer, steps=slice(2))
    engine.save_checkpoint(ckpt, "two")
    engine.close()

    def freeze(model):
        model.blocks[1].fc.weight.requires_grad_(False)

    def frozen_more():
        model = frozen_model()
        freeze(model)
        engine, optimizer = tiered.initialize(
            model, os.path.join(REPO, "configs", "cpu.yaml"), compute_dtype="fp32",
            device="cpu", optimizer=OPTIM)
        frozen_half = next(f for f in engine.runtime.flats if f.name == "blocks.1 (frozen)")
        assert "blocks.1.fc.weight" in [p.names[0] for p in frozen_half.spec.params]
        return engine, optimizer

    state = resumed(frozen_more, ckpt, steps=slice(2, None))
    assert_same_states(state, torch_changing_midway(freeze))


def test_a_checkpoint_loads_into_unsplit_units_and_back(tmp_path):
    # The same parameters cut into other units (units.split_frozen off, then on again) load
    # by name: full_state_dict is unchanged and the masters and moments follow each
    # parameter, so two more steps are the same whichever cut took them.
    ckpt = str(tmp_path / "ckpt")

    def engine_with(split: bool):
        return engine_for("cpu", str(tmp_path), units={"split_frozen": split})

    engine, optimizer = engine_with(True)
    train(engine, optimizer, steps=slice(2))
    engine.save_checkpoint(ckpt, "split")
    saved = engine.full_state_dict()
    expected = train(engine, optimizer, steps=slice(2, 4))
    engine.close()
    engine, optimizer = engine_with(False)
    try:
        engine.load_checkpoint(ckpt, "split")
        assert all(torch.equal(value, saved[name])
                   for name, value in engine.full_state_dict().items())
        engine.save_checkpoint(ckpt, "whole")
    finally:
        engine.close()
    assert_same_states(resumed(lambda: engine_with(True), ckpt, slice(2, 4), "whole"), expected)


def test_a_cut_that_joins_different_step_counts_is_refused(tmp_path):
    # Block 0's adapters are frozen for two steps, then train: its units count 2 steps where
    # block 1's count 4. One unit for the whole model (units.classes: [GPT], the root) would
    # join them, which one count per unit cannot represent; nor can unfreezing block 0's
    # adapters into a unit whose others stepped.
    ckpt = str(tmp_path / "ckpt")
    cpu = os.path.join(REPO, "configs", "cpu.yaml")

    def build(frozen_block: bool, **overrides):
        model = lora_model()
        if frozen_block:
            model.blocks[0].requires_grad_(False)
        return tiered.initialize(model, cpu, compute_dtype="fp32", device="cpu",
                                 optimizer=OPTIM, **overrides)

    engine, optimizer = build(frozen_block=True)
    train(engine, optimizer, steps=slice(2))
    engine.save_checkpoint(ckpt, "frozen")
    engine.close()
    engine, optimizer = build(frozen_block=False)  # block 0's units took no step: allowed
    engine.load_checkpoint(ckpt, "frozen")
    train(engine, optimizer, steps=slice(2, 4))
    engine.save_checkpoint(ckpt, "trained")
    engine.close()

    for tag, frozen_block, refusal in (("trained", False, "different numbers of AdamW steps"),
                                       ("frozen", False, "were frozen when the checkpoint")):
        engine, optimizer = build(frozen_block, units={"classes": ["GPT"]})
        try:
            before = engine.full_state_dict()
            with pytest.raises(tiered.CheckpointError, match=refusal):
                engine.load_checkpoint(ckpt, tag)
            after = engine.full_state_dict()
            assert all(torch.equal(after[name], value) for name, value in before.items())
        finally:
            engine.close()


def loaded_state(build, ckpt: str, tag: str | None = None) -> dict:
    """``full_state_dict`` of a fresh engine from ``build()`` once it loaded ``ckpt``."""
    engine, _ = build()
    try:
        engine.load_checkpoint(ckpt, tag)
        return engine.full_state_dict()
    finally:
        engine.close()


def test_a_format_2_checkpoint_of_a_partly_frozen_model_loads_into_its_own_units(tmp_path):
    # Before format 3 the manifest did not list each unit's parameters: such a checkpoint
    # loads only into the units it was saved from, and the refusal says how to get them.
    ckpt = str(tmp_path / "ckpt")
    engine, optimizer = engine_for("cpu", str(tmp_path), units={"split_frozen": False})
    train(engine, optimizer, steps=slice(2))
    engine.save_checkpoint(ckpt, "old")
    saved = engine.full_state_dict()
    engine.close()
    def as_format_2(manifest):
        manifest["format"] = 2
        for unit in manifest["units"]:
            del unit["params"]

    rewrite_manifest(os.path.join(ckpt, "old"), as_format_2)
    engine, _ = engine_for("cpu", str(tmp_path))
    with pytest.raises(tiered.CheckpointError, match="set units.split_frozen: false"):
        engine.load_checkpoint(ckpt)
    engine.close()
    loaded = loaded_state(lambda: engine_for("cpu", str(tmp_path), units={"split_frozen": False}),
                          ckpt)
    assert all(torch.equal(loaded[name], value) for name, value in saved.items())


def test_halves_with_the_same_sizes_but_other_parameters_map_by_name(tmp_path):
    # Freezing blocks.0.out.weight instead of blocks.0.fc.weight (the same size) gives units
    # of the same paths and sizes; the manifest's parameter lists tell them apart.
    ckpt = str(tmp_path / "ckpt")

    def build(frozen: str):
        model = make_model()
        getattr(model.blocks[0], frozen).weight.requires_grad_(False)
        return tiered.initialize(model, os.path.join(REPO, "configs", "cpu.yaml"),
                                 compute_dtype="fp32", device="cpu", optimizer=OPTIM)

    engine, _ = build("fc")
    engine.save_checkpoint(ckpt, "fc")
    saved = engine.full_state_dict()
    engine.close()
    loaded = loaded_state(lambda: build("out"), ckpt, "fc")
    assert all(torch.equal(loaded[name], value) for name, value in saved.items())


def test_a_pending_delayed_update_resumes_exactly_into_another_cut(tmp_path):
    # Saved with an update pending (its next weights written, the current ones saved beside
    # the masters): loaded into unsplit units, each keeps both and swaps at the next step.
    ckpt = str(tmp_path / "ckpt")
    delayed = {"delayed_update": {"enabled": True, "warmup_steps": 1}}
    engine, optimizer = engine_for("cpu", str(tmp_path), optimizer=delayed)
    for micro_batches in batches()[:3]:  # not train(): its full_state_dict finishes the update
        for idx in micro_batches:
            (next_token_loss(engine(idx), idx) / len(micro_batches)).backward()
        optimizer.step()
        optimizer.zero_grad()
    engine.save_checkpoint(ckpt, "pending")
    assert optimizer.checkpoint_state()["pending"]["written"]
    expected = train(engine, optimizer, steps=slice(3, 5))
    engine.close()
    state = resumed(lambda: engine_for("cpu", str(tmp_path), units={"split_frozen": False},
                                       optimizer=delayed),
                    ckpt, steps=slice(3, 5))
    assert_same_states(state, expected)


@dataclass
class Box:
    x: torch.Tensor


class BoxBlock(Block):
    """A block whose input comes inside an object torch cannot look into."""

    def forward(self, box: Box) -> torch.Tensor:
        return super().forward(box.x)


class CallingGPT(nn.Module):
    """The LoRA GPT with its blocks called by keyword, as many Hugging Face models call theirs,
    or with their input in a dataclass."""

    def __init__(self, boxed: bool):
        super().__init__()
        torch.manual_seed(0)
        self.inner = add_lora(GPT(VOCAB, 32, 2, 2, max_seq=SEQ, tied=True, qkv_bias=False,
                                  block=BoxBlock if boxed else Block), RANK)
        self.boxed = boxed

    def forward(self, idx):
        inner = self.inner
        x = inner.emb(idx) + inner.pos[: idx.shape[1]]
        for block in inner.blocks:
            x = block(Box(x)) if self.boxed else block(x=x)
        return inner.head(inner.ln(x))


@pytest.mark.parametrize("boxed", [False, True])
def test_a_frozen_half_is_released_after_its_backward(boxed):
    # Block 0's adapters need the gradient through block 1, so block 1's frozen weights are
    # read in backward; they are released before block 0's backward, not at the end: once
    # the gradient of block 1's keyword input is computed, or, where its input cannot be
    # hooked (in a dataclass), with block 1's adapters' gradient. Block 0's input needs no
    # gradient, so its frozen half goes with its adapters' gradient.
    engine, optimizer = tiered.initialize(
        CallingGPT(boxed), os.path.join(REPO, "configs", "cpu.yaml"), compute_dtype="fp32",
        device="cpu", optimizer=OPTIM, prefetch={"enabled": False})
    gathered = {}  # a block's adapters (released as their gradient arrives) -> blocks gathered

    def look(full, name):
        gathered[name] = [f.name for f in engine.runtime.flats
                          if f.residency.value == "gathered" and f.name.startswith("inner.blocks")]

    for flat in engine.runtime.flats:
        if flat.has_trainable:
            flat.full.register_post_accumulate_grad_hook(partial(look, name=flat.name))
    try:
        idx = batches()[0][0]
        next_token_loss(engine(idx), idx).backward()
    finally:
        engine.close()
    assert gathered == {"inner.blocks.1": [] if boxed else ["inner.blocks.1 (frozen)"],
                        "inner.blocks.0": []}


def _save_split(rank: int, world: int, folder: str) -> None:
    engine, optimizer = engine_for("cpu", folder, units={"split_frozen": True})
    train(engine, optimizer, steps=slice(2), rank=rank, world=world)
    engine.save_checkpoint(os.path.join(folder, "ckpt"), "two")
    torch.save(states_by_name(engine), os.path.join(folder, f"saved{rank}.pt"))
    engine.close()


def _load_unsplit(rank: int, world: int, folder: str) -> None:
    engine, optimizer = tiered.initialize(
        _lora_freezing_one_more(), os.path.join(REPO, "configs", "cpu.yaml"),
        compute_dtype="fp32", device="cpu", optimizer=OPTIM, units={"split_frozen": False})
    engine.load_checkpoint(os.path.join(folder, "ckpt"), "two")
    torch.save(states_by_name(engine), os.path.join(folder, f"loaded{rank}.pt"))
    engine.close()


def _lora_freezing_one_more():
    model = lora_model()
    model.blocks[1].fc.lora_a.requires_grad_(False)
    return model


def _joined(folder: str, prefix: str, world: int) -> dict[tuple[str, str], torch.Tensor]:
    pieces: dict[tuple[str, str], list] = {}
    for rank in range(world):
        for key, piece in torch.load(os.path.join(folder, f"{prefix}{rank}.pt")).items():
            pieces.setdefault(key, []).append(piece)
    return {key: torch.cat([values for _, values in sorted(parts, key=lambda p: p[0])])
            for key, parts in pieces.items()}


def test_a_checkpoint_of_two_ranks_loads_into_three_cut_otherwise(tmp_path):
    # Other ranks and other units at once (unsplit, one more adapter frozen): every state of
    # every parameter is what was saved, and the frozen weights that now share units with
    # adapters get masters from their saved weights and zero moments.
    from distributed import run_ranks

    run_ranks(2, _save_split, str(tmp_path))
    run_ranks(3, _load_unsplit, str(tmp_path))
    saved, loaded = _joined(str(tmp_path), "saved", 2), _joined(str(tmp_path), "loaded", 3)
    for (name, kind), values in loaded.items():
        if (name, kind) in saved:
            expected = saved[(name, kind)]
        elif kind == "master":  # a frozen parameter's masters start from its weights
            expected = saved[(name, "param")]
        else:  # moments of a parameter frozen when saved start at zero
            assert kind in ("exp_avg", "exp_avg_sq"), (name, kind)
            assert not values.any(), (name, kind)
            continue
        assert torch.equal(values, expected), (name, kind)
    assert ("blocks.0.fc.weight", "exp_avg") in loaded  # beside adapters, unsplit


def _split_and_unsplit(rank: int, world: int, folder: str) -> None:
    states = {}
    for split in (True, False):
        engine, optimizer = engine_for("cpu", folder, optimizer={"accumulation_steps": 2},
                                       units={"split_frozen": split})
        states[split] = train(engine, optimizer, rank=rank, world=world)
        engine.close()
    torch.save(states, os.path.join(folder, f"rank{rank}.pt"))


def test_three_ranks_train_split_units_as_unsplit_ones(tmp_path):
    # Three ranks cut each half on its own, and units are stepped as their gradients arrive:
    # the same training as one unit per block. Not bit for bit: the reduce-scatter adds three
    # ranks' gradients in an order that depends on which rank's shard an element falls in,
    # and the cut moves the shard boundaries.
    from distributed import run_ranks

    run_ranks(3, _split_and_unsplit, str(tmp_path))
    for rank in range(3):
        states = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert_parity(states[True], states[False])
        assert not torch.equal(states[True]["blocks.0.fc.lora_b"],
                               lora_model().state_dict()["blocks.0.fc.lora_b"])


@pytest.mark.parametrize("delayed", [False, True])
def test_fp16_split_units_skip_and_scale_as_unsplit_ones(delayed, tmp_path):
    # fp16 loss scaling: the same overflows skipped (a first scale of 2**40 overflows), the
    # same scales after, the same parameters.
    results = {}
    for split in (True, False):
        engine, optimizer = tiered.initialize(
            lora_model(), os.path.join(REPO, "configs", "cpu.yaml"), compute_dtype="fp16",
            device="cpu", units={"split_frozen": split}, loss_scale={"initial_scale": 2.0**40},
            optimizer=dict(OPTIM, delayed_update={"enabled": delayed, "warmup_steps": 1}))
        for micro_batches in batches():
            for idx in micro_batches:
                engine.backward(next_token_loss(engine(idx), idx) / len(micro_batches))
            optimizer.step()
            optimizer.zero_grad()
        results[split] = (engine.full_state_dict(), optimizer.skipped_steps,
                          optimizer.scaler.scale)
        engine.close()
    assert results[True][1] == results[False][1] > 0
    assert results[True][2] == results[False][2]
    assert_same_states(results[True][0], results[False][0])


def test_the_example_fine_tunes_adapters():
    # examples/train_gpt.py --lora: a real process, its model built under tiered.init with
    # the adapters added there; the loss falls with the adapters alone trained.
    import re
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, os.path.join(REPO, "examples", "train_gpt.py"), "--steps", "40",
         "--lora", "8"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert re.search(r"\(0\.\d+ M trained\)", result.stdout), result.stdout
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", result.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.5, result.stdout
