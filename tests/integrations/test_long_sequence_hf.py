"""tile_sequence on Hugging Face causal LMs (issue 34, item 3): a tiny Llama, and a peft LoRA
model over it, give plain transformers' loss and gradients with their MLPs tiled and their loss
chunked (the same bits where the order of the sums is, see [Note: tiles of the sequence]), and
TieredTrainer trains the tiled model, its layers checkpointed by Hugging Face, as plain Trainer
trains the untiled one."""
from __future__ import annotations

import pytest
import torch

from helpers_hf import arguments, assert_close_states, dataset, llama, lora, train_plain

transformers = pytest.importorskip("transformers")

from tiered.core.errors import TieredError  # noqa: E402
from tiered.integrations.transformers import TieredTrainer  # noqa: E402
from tiered.ops.causal_lm import tile_sequence  # noqa: E402

SEQ = 128
SUMMED_BY_TILE = ("mlp", "lm_head")
"""Weights whose gradient sums the tiles' sums: equal within DESIGN's rtol, not to the bit."""


def _batch() -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(4))
    labels = tokens.clone()
    labels[0, :24] = -100  # a prompt the loss ignores
    return {"input_ids": tokens, "labels": labels}


def _loss_and_gradients(model, **extra):
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    loss = model(**_batch(), **extra).loss
    return loss, dict(zip(trainable, torch.autograd.grad(loss, list(trainable.values()))))


@pytest.mark.parametrize("adapters", [False, True], ids=["llama", "peft-lora"])
@pytest.mark.parametrize("num_items", [None, 200], ids=["mean", "num_items_in_batch"])
def test_tiled_model_gives_transformers_loss_and_gradients(adapters, num_items):
    extra = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    model = lora(llama()) if adapters else llama()
    loss, grads = _loss_and_gradients(model, **extra)

    tile_sequence(model, mlp_tokens=32, loss_tokens=64)
    tiled_loss, tiled_grads = _loss_and_gradients(model, **extra)

    assert abs(tiled_loss.item() - loss.item()) <= 4 * torch.finfo(torch.float32).eps * loss.item()
    for name, grad in grads.items():
        if any(part in name for part in SUMMED_BY_TILE):
            torch.testing.assert_close(tiled_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
        else:
            assert torch.equal(tiled_grads[name], grad), name


def test_evaluation_keeps_the_logits_and_zero_tokens_undo_the_tiling():
    model = llama()
    with torch.no_grad():
        logits = model(**_batch()).logits
    tile_sequence(model, mlp_tokens=32, loss_tokens=64)
    with torch.no_grad():
        evaluated = model(**_batch())
    assert torch.equal(evaluated.logits, logits)  # under no_grad the model's own forward runs
    assert model(**_batch()).logits is None  # training's chunked loss never had them all
    tile_sequence(model)
    assert "forward" not in vars(model) and "forward" not in vars(model.model.layers[0].mlp)


def test_a_model_that_caps_its_logits_is_refused_by_name():
    model = llama()
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(TieredError, match="final_logit_softcapping"):
        tile_sequence(model, loss_tokens=64)


def test_tiered_trainer_trains_the_tiled_model_as_plain_trainer_the_untiled(tmp_path):
    data = dataset(seq=SEQ // 2)
    args = dict(gradient_checkpointing=True, max_steps=3)
    expected, _ = train_plain(llama(), arguments(tmp_path / "plain", **args), data)
    trainer = TieredTrainer(model=tile_sequence(llama(), mlp_tokens=16, loss_tokens=32),
                            args=arguments(tmp_path / "tiered", **args), train_dataset=data,
                            policy={"device": "cpu", "activations": {"tier": "dram",
                                                                     "min_bytes": 0}})
    trainer.train()
    got = trainer.engine.full_state_dict()
    trainer.engine.close()
    assert_close_states(got, expected)
