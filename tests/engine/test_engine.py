"""The engine's contract beyond plain parity: units, real-model quirks, precision, optimizer API."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import tiered
from tiered.engine.flat import Residency
from tiered.placement.units import find_units

from gpt import GPT, next_token_loss
from helpers_models import (SEQ, VOCAB, SkippingGPT, assert_parity, data, fp32_engine,
                            reference_optimizer, train_both)


def make_gpt(block=None, **kwargs) -> GPT:
    torch.manual_seed(0)
    extra = {"block": block} if block is not None else {}
    return GPT(VOCAB, 32, 2, 2, max_seq=SEQ, tied=True, qkv_bias=False, **extra, **kwargs)


class MHABlock(nn.Module):
    """nn.MultiheadAttention reads out_proj.weight directly, not through out_proj.forward."""

    def __init__(self, dim: int, heads: int, qkv_bias: bool = True):
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True, bias=qkv_bias)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        h = self.ln(x)
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        y, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False)
        return x + self.fc(torch.tanh(y))


def test_units_are_the_repeated_blocks_plus_the_root():
    engine, _ = fp32_engine(make_gpt())
    assert [f.name for f in engine.runtime.flats] == ["blocks.0", "blocks.1", "<root>"]
    root = engine.runtime.flats[-1].spec
    names = [p.names for p in root.params]
    assert ("emb.weight", "head.weight") in names, "tied weight must be one parameter of root"
    assert ("pos",) in names
    engine.close()


@pytest.mark.parametrize("tied", [False, True])
def test_block_sized_modules_are_units_and_train_like_pytorch(tied):
    torch.manual_seed(0)
    # Embedding and head: 8192 parameters each; a block: 3.2k. No qkv bias, as in make_gpt:
    # the key bias's gradient is rounding noise, which AdamW amplifies to whole steps.
    model = GPT(512, 16, 2, 2, max_seq=SEQ, tied=tied, qkv_bias=False)
    assert [u.path for u in find_units(model, None)] == ["blocks.0", "blocks.1", ""]
    reference = copy.deepcopy(model)
    engine, optimizer = fp32_engine(model)  # units.split_large is on by default
    # Untied, the embedding and the head are units of their own; tied, their one weight is
    # held by both and stays with the root, the unit that contains them both.
    expected = ["blocks.0", "blocks.1", "<root>"] if tied else [
        "emb", "blocks.0", "blocks.1", "head", "<root>"]
    assert [f.name for f in engine.runtime.flats] == expected
    train_both(engine, optimizer, reference, reference_optimizer(reference), steps=3)
    assert_parity(engine.full_state_dict(), reference.state_dict())
    assert all(f.residency is Residency.RELEASED for f in engine.runtime.flats)
    engine.close()


class ReadsWeightsElsewhere(nn.Module):
    """Logits from the embedding's weight in the model's own forward (as OLMo ties them), and a
    projection whose module is never called, only its weight read."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(512, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.proj = nn.Linear(16, 16, bias=False)
        self.unused = nn.Linear(16, 512, bias=False)  # never called; as large as a block

    def forward(self, idx):
        h = self.emb(idx)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        h = torch.nn.functional.linear(h, self.proj.weight)
        return torch.nn.functional.linear(h, self.emb.weight) + self.unused.weight.sum(1)


def test_whole_forward_units_may_be_read_anywhere_in_the_forward():
    torch.manual_seed(0)
    model = ReadsWeightsElsewhere()
    reference = copy.deepcopy(model)
    engine, optimizer = fp32_engine(model)  # units.split_large is on by default
    assert [(f.name, f.spec.whole_forward) for f in engine.runtime.flats] == [
        ("emb", True), ("blocks.0", False), ("blocks.1", False), ("unused", True),
        ("<root>", False)]
    train_both(engine, optimizer, reference, reference_optimizer(reference), steps=3)
    assert_parity(engine.full_state_dict(), reference.state_dict())
    assert all(f.residency is Residency.RELEASED for f in engine.runtime.flats)
    with torch.no_grad():  # and outside training, as torch would
        idx = data(1)[0]
        torch.testing.assert_close(engine(idx), reference(idx), rtol=1e-5, atol=1e-6)
    assert all(f.residency is Residency.RELEASED for f in engine.runtime.flats)
    engine.close()


class SharedEmbeddingBlock(nn.Module):
    def __init__(self, emb: nn.Embedding):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.__dict__["emb"] = emb  # shared, not a child: it stays the model's unit

    def forward(self, x, idx):
        return x + torch.tanh(self.fc(x)) + 0.1 * self.emb(idx)


class ReentrantCheckpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(512, 16)
        self.blocks = nn.ModuleList(SharedEmbeddingBlock(self.emb) for _ in range(2))
        self.head = nn.Linear(16, 512, bias=False)

    def forward(self, idx):
        h = self.emb(idx)
        for block in self.blocks:
            h = checkpoint(block, h, idx, use_reentrant=True)
        return self.head(h)


@pytest.mark.parametrize("accumulation_steps", [None, 1])
def test_a_gradient_in_several_backward_passes_is_summed_or_refused(accumulation_steps):
    """Reentrant checkpointing runs each block's backward as a separate pass, and the shared
    embedding gets a gradient in each: summed, it trains like PyTorch; stepping on the first
    one would be silently wrong, so it is refused by name."""
    torch.manual_seed(0)
    model = ReentrantCheckpointed()
    reference = copy.deepcopy(model)
    engine, optimizer = fp32_engine(model, optimizer={"accumulation_steps": accumulation_steps})
    if accumulation_steps == 1:
        idx = data(1)[0]
        with pytest.raises(tiered.TieredError, match="unit emb received a second gradient"):
            next_token_loss(engine(idx), idx).backward()
        engine.close()
        return
    train_both(engine, optimizer, reference, reference_optimizer(reference), steps=3)
    assert_parity(engine.full_state_dict(), reference.state_dict())
    engine.close()


class CheckpointedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class BlocksFirstInBackward(nn.Module):
    """The loss reads the last block's output directly, so the first unit backward uses is a
    block whose forward reentrant checkpointing recomputes inside the backward."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(CheckpointedBlock() for _ in range(3))

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=True)
        return h


@pytest.mark.parametrize("accumulation_steps", [None, 1, 2])
def test_a_backward_that_starts_in_a_recomputed_forward_is_one_iteration(accumulation_steps):
    """Each block's backward is a nested backward pass; its end is not the iteration's end
    (which used to count a second backward and release every unit mid-backward)."""
    torch.manual_seed(0)
    model = BlocksFirstInBackward()
    reference = copy.deepcopy(model)
    engine, optimizer = fp32_engine(model, optimizer={"accumulation_steps": accumulation_steps})
    ref_optimizer = reference_optimizer(reference)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        for _ in range(accumulation_steps or 2):
            x = torch.randn(4, 8, generator=g)
            engine(x).pow(2).sum().backward()
            reference(x).pow(2).sum().backward()
        optimizer.step(), ref_optimizer.step()
        optimizer.zero_grad(), ref_optimizer.zero_grad()
    assert_parity(engine.full_state_dict(), reference.state_dict())
    names = [f.name for f in engine.runtime.flats]
    blocks = [f"blocks.{i}" for i in range(3)]
    assert [names[i] for i in engine.runtime.prefetcher.trace] == \
        ["<root>", *blocks, *reversed(blocks)]
    engine.close()


def test_units_by_class_name_and_unknown_class():
    engine, _ = fp32_engine(make_gpt(), units={"classes": ["Block", "LayerNorm"]})
    # The final LayerNorm becomes a unit of its own; block LayerNorms are inside Block units
    # and stay with their block, since a parameter belongs to its innermost unit.
    names = [f.name for f in engine.runtime.flats]
    assert "ln" in names and "blocks.0.ln1" in names and names[-1] == "<root>"
    engine.close()
    with pytest.raises(tiered.PolicyError, match="Blok.*does not contain.*Block"):
        fp32_engine(make_gpt(), units={"classes": ["Blok"]})


def test_tied_weights_export_as_one_tensor_under_both_keys():
    model = make_gpt()
    reference = copy.deepcopy(model)
    engine, _ = fp32_engine(model)
    state = engine.full_state_dict()
    assert state["emb.weight"] is state["head.weight"]
    fresh = make_gpt()
    fresh.load_state_dict(state, strict=True)
    idx = data(1)[0]
    torch.testing.assert_close(engine(idx), reference(idx), rtol=0, atol=0)
    torch.testing.assert_close(fresh(idx), reference(idx), rtol=0, atol=0)
    engine.close()


def test_multihead_attention_trains_like_pytorch():
    model = make_gpt(block=MHABlock)
    reference = copy.deepcopy(model)
    engine, optimizer = fp32_engine(model)
    train_both(engine, optimizer, reference, reference_optimizer(reference), steps=4)
    assert_parity(engine.full_state_dict(), reference.state_dict())
    engine.close()


def test_every_unit_is_released_after_forward_backward_and_eval():
    engine, optimizer = fp32_engine(make_gpt())
    idx = data(1)[0]
    loss = next_token_loss(engine(idx), idx)
    assert all(f.residency is Residency.RELEASED for f in engine.runtime.flats)
    assert engine.memory_report()["hbm"]["current"] == 0
    loss.backward()
    assert all(f.residency is Residency.RELEASED for f in engine.runtime.flats)
    train_logits = engine(idx).detach()
    with torch.no_grad():
        eval_logits = engine.eval()(idx)
    assert torch.equal(train_logits, eval_logits)
    assert engine.memory_report()["hbm"]["current"] == 0
    engine.close()


def test_lr_scheduler_drives_the_step_size():
    model = make_gpt()
    reference = copy.deepcopy(model)
    engine, optimizer = fp32_engine(model)
    ref_optimizer = reference_optimizer(reference)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: 0.5 ** step)
                 for o in (optimizer, ref_optimizer)]
    for idx in data(4):
        next_token_loss(engine(idx), idx).backward()
        next_token_loss(reference(idx), idx).backward()
        for o, s in zip((optimizer, ref_optimizer), schedules):
            o.step()
            o.zero_grad()
            s.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5 ** 4)
    assert_parity(engine.full_state_dict(), reference.state_dict())
    engine.close()


@pytest.mark.parametrize("set_to_none", [True, False])
def test_unit_skipped_on_some_steps_matches_pytorch(set_to_none):
    # With set_to_none a skipped block has no gradient and is not stepped (grad=None in
    # PyTorch); without it, it is stepped with a zero gradient (momentum and decay still act).
    torch.manual_seed(0)
    model = SkippingGPT(VOCAB, 32, 2, 2, max_seq=SEQ, tied=True, qkv_bias=False)
    reference = copy.deepcopy(model)
    engine, optimizer = fp32_engine(model)
    train_both(engine, optimizer, reference, reference_optimizer(reference), steps=4,
               set_to_none=set_to_none)
    assert_parity(engine.full_state_dict(), reference.state_dict())
    engine.close()


def test_fp16_needs_engine_backward():
    engine, _ = tiered.initialize(make_gpt(), "configs/cpu.yaml", compute_dtype="fp16",
                                  device="cpu")
    idx = data(1)[0]
    with pytest.raises(tiered.TieredError, match=r"engine\.backward\(loss\)"):
        next_token_loss(engine(idx), idx).backward()
    engine.close()


def test_fp16_overflow_skips_the_step_and_lowers_the_scale():
    engine, optimizer = tiered.initialize(
        make_gpt(), "configs/cpu.yaml", compute_dtype="fp16", device="cpu",
        loss_scale={"initial_scale": 2.0**40, "growth_interval": 2}, optimizer={"lr": 1e-3})
    before = engine.full_state_dict()
    idx = data(1)[0]
    engine.backward(next_token_loss(engine(idx), idx))  # 2**40 overflows fp16 gradients
    optimizer.step()
    optimizer.zero_grad()
    assert optimizer.skipped_steps == 1 and engine.scaler.scale == 2.0**39
    after = engine.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "a skipped step moved weights"

    engine.scaler.scale = 2.0**10  # small enough for fp16: steps run and the scale grows
    for idx in data(2, seed=2):
        engine.backward(next_token_loss(engine(idx), idx))
        optimizer.step()
        optimizer.zero_grad()
    assert optimizer.skipped_steps == 1 and engine.scaler.scale == 2.0**11
    moved = engine.full_state_dict()
    assert not torch.equal(moved["blocks.0.fc.weight"], before["blocks.0.fc.weight"])
    engine.close()


def test_bf16_compute_matches_autocast_pytorch_on_cpu():
    model = make_gpt()
    reference = copy.deepcopy(model)
    engine, optimizer = tiered.initialize(model, "configs/cpu.yaml", compute_dtype="bf16",
                                          device="cpu", optimizer={"lr": 1e-3})
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.0)
    for idx in data(4):
        next_token_loss(engine(idx), idx).backward()
        with torch.autocast("cpu", torch.bfloat16):
            loss = next_token_loss(reference(idx), idx)
        loss.backward()
        optimizer.step(), ref_optimizer.step()
        optimizer.zero_grad(), ref_optimizer.zero_grad()
    # Pure bf16 weights (norms and all) against autocast, which keeps norms in fp32: the model
    # as a whole within 1e-2, and each parameter's update within a quarter of its size.
    state, ref, initial = engine.full_state_dict(), reference.state_dict(), make_gpt().state_dict()
    flat = lambda d: torch.cat([d[k].flatten() for k in ref])  # noqa: E731
    assert (flat(state) - flat(ref)).norm() / flat(ref).norm() <= 1e-2
    for name in ref:
        update_error = (state[name] - ref[name]).norm() / (ref[name] - initial[name]).norm()
        assert update_error <= 0.25, f"{name}: update differs by {update_error:.1%}"
    engine.close()


def test_floating_inputs_take_the_compute_dtype():
    class Regressor(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))

        def forward(self, x):
            return self.layers(x)

    engine, _ = tiered.initialize(Regressor(), "configs/cpu.yaml", compute_dtype="bf16",
                                  device="cpu")
    out = engine(torch.randn(2, 8))  # fp32 input, bf16 weights
    assert out.dtype is torch.bfloat16
    engine.close()


def test_optimizer_step_with_closure_and_state_dict_refusal():
    engine, optimizer = fp32_engine(make_gpt())
    idx = data(1)[0]

    def closure():
        loss = next_token_loss(engine(idx), idx)
        loss.backward()
        return loss

    loss = optimizer.step(closure)
    assert torch.isfinite(loss)
    with pytest.raises(tiered.TieredError, match="lives in tiers"):
        optimizer.state_dict()
    engine.close()


def test_stepping_on_arrival_matches_pytorch_and_refuses_an_extra_backward():
    # With the step's backward count known, units are stepped as their gradients arrive.
    model = make_gpt()
    reference = copy.deepcopy(model)
    engine, optimizer = fp32_engine(model, optimizer={"accumulation_steps": 2})
    assert engine.runtime.arrival_allowed
    ref_optimizer = reference_optimizer(reference)
    for step in range(3):
        for idx in data(2, seed=step):
            (next_token_loss(engine(idx), idx) / 2).backward()
            (next_token_loss(reference(idx), idx) / 2).backward()
        optimizer.step(), ref_optimizer.step()
        optimizer.zero_grad(), ref_optimizer.zero_grad()
    assert_parity(engine.full_state_dict(), reference.state_dict())
    for idx in data(2):
        next_token_loss(engine(idx), idx).backward()
    with pytest.raises(tiered.TieredError, match="accumulation_steps is 2"):
        next_token_loss(engine(idx), idx).backward()
    engine.close()
