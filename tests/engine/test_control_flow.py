"""Control flow the trace does not expect, checked against plain PyTorch + torch.optim.AdamW
(fp32 on the CPU): a forward whose backward never comes, then a step or a checkpoint load (the
units kept for that backward must not be computed on again); blocks reordered and run twice;
non-reentrant activation checkpointing, which must still recompute."""
from __future__ import annotations

import copy

import pytest
import torch

from tiered.engine import hooks
from tiered.engine.flat import Residency

from gpt import GPT, next_token_loss
from helpers_models import (SEQ, VOCAB, CheckpointedGPT, assert_parity, batch, fp32_engine,
                            make_gpt, reference_optimizer)


def train_step(models, optimizers, idx) -> None:
    for model in models:
        next_token_loss(model(idx), idx).backward()
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("policy", ["cpu", "nvme"])
def test_a_forward_without_backward_then_a_step_computes_on_the_new_weights(policy, tmp_path):
    """A forward run with grad enabled whose loss is dropped (a metric computed after the
    backward, before the step) must not leave units gathered, nor NVMe shards read ahead, across
    optimizer.step(): the next forward would read the weights of before the step."""
    model = make_gpt(qkv_bias=False)
    reference = copy.deepcopy(model)
    engine, optimizer = fp32_engine(model, f"configs/{policy}.yaml",
                                    nvme={"path": str(tmp_path)})
    ref_optimizer = reference_optimizer(reference)
    models, optimizers = (engine, reference), (optimizer, ref_optimizer)
    train_step(models, optimizers, batch(0))  # records the trace
    for seed in (1, 2):
        idx = batch(seed)
        for m in models:
            next_token_loss(m(idx), idx).backward()
        for m in models:
            m(batch(10 + seed))  # grad enabled, no backward
        for o in optimizers:
            o.step()
            o.zero_grad()
    train_step(models, optimizers, batch(3))
    assert_parity(engine.full_state_dict(), reference.state_dict())
    engine.close()


@pytest.mark.skipif(hooks._top_saved_hooks is None,
                    reason="this torch cannot say which saved-tensor hooks are in force")
def test_non_reentrant_checkpointing_still_recomputes_the_blocks():
    """The units' saved-tensor hooks, pushed inside the checkpoint's own, used to replace them:
    every activation of a checkpointed block was saved as without checkpointing, and nothing
    was recomputed in backward (the memory checkpointing exists to save was spent). Each block
    runs twice per step, as in PyTorch, and training still matches it."""
    torch.manual_seed(0)
    model = CheckpointedGPT(VOCAB, 32, 3, 2, max_seq=SEQ, tied=True, qkv_bias=False)
    calls = []
    for block in model.blocks:  # registered first: runs before the engine's own pre-hook
        block.register_forward_pre_hook(lambda module, args: calls.append(module))
    reference = copy.deepcopy(model)
    engine, optimizer = fp32_engine(model)
    ref_optimizer = reference_optimizer(reference)
    for seed in range(3):
        idx = batch(seed)
        for m, o in ((reference, ref_optimizer), (engine, optimizer)):
            calls.clear()
            next_token_loss(m(idx), idx).backward()
            assert len(calls) == 2 * len(model.blocks), (m is engine, len(calls))
            o.step()
            o.zero_grad()
    assert_parity(engine.full_state_dict(), reference.state_dict())
    engine.close()


def test_a_checkpoint_loaded_after_a_forward_without_backward_is_what_the_next_forward_reads(
        tmp_path):
    """load_checkpoint refuses nothing after a forward whose backward never came (the units the
    trace kept for that backward are still gathered); the next forward must read the loaded
    weights, not those kept units."""
    model = make_gpt(qkv_bias=False)
    reference = copy.deepcopy(model)
    engine, optimizer = fp32_engine(model)
    ref_optimizer = reference_optimizer(reference)
    models, optimizers = (engine, reference), (optimizer, ref_optimizer)
    train_step(models, optimizers, batch(0))
    engine.save_checkpoint(str(tmp_path), "saved")
    saved = copy.deepcopy((reference.state_dict(), ref_optimizer.state_dict()))
    train_step(models, optimizers, batch(1))
    engine(batch(2))  # grad enabled, no backward: the units kept for it stay gathered
    engine.load_checkpoint(str(tmp_path), "saved")
    reference.load_state_dict(saved[0])
    ref_optimizer.load_state_dict(saved[1])
    train_step(models, optimizers, batch(3))
    assert_parity(engine.full_state_dict(), reference.state_dict())
    engine.close()


class ReorderingGPT(GPT):
    """Runs its blocks in another order on each call, one of them twice in some: control flow
    that changes other than by skipping a unit (the existing tests skip one)."""

    ORDERS = ([0, 1, 2], [2, 0, 1, 0], [1, 1, 2], [0, 1, 2])
    checkpointed = False

    def forward(self, idx):
        order = self.ORDERS[self.calls % len(self.ORDERS)]
        self.calls += 1
        x = self.emb(idx) + self.pos[: idx.shape[1]]
        for i in order:
            x = (torch.utils.checkpoint.checkpoint(self.blocks[i], x, use_reentrant=False)
                 if self.checkpointed else self.blocks[i](x))
        return self.head(self.ln(x))


@pytest.mark.parametrize("checkpointed", [False, True])
def test_blocks_reordered_and_reused_match_pytorch_with_weights_on_nvme(checkpointed, tmp_path):
    """Coverage of a gap, not a bug found: the trace diverging by order and by a unit needed
    twice in one forward (kept between its uses), with ZeRO-Infinity's placement (weights read
    ahead from NVMe along a trace that no longer holds)."""
    torch.manual_seed(0)
    model = ReorderingGPT(VOCAB, 32, 3, 2, max_seq=SEQ, tied=True, qkv_bias=False)
    model.calls, model.checkpointed = 0, checkpointed
    reference = copy.deepcopy(model)
    engine, optimizer = fp32_engine(model, "configs/nvme.yaml", nvme={"path": str(tmp_path)})
    ref_optimizer = reference_optimizer(reference)
    for seed in range(6):
        train_step((engine, reference), (optimizer, ref_optimizer), batch(seed))
    assert_parity(engine.full_state_dict(), reference.state_dict())
    assert all(f.residency is Residency.RELEASED for f in engine.runtime.flats)
    engine.close()
