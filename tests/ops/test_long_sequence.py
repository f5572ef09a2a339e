"""Tiled MLPs and the chunked loss (issue 34, item 3): the same as plain PyTorch's untiled
computation to the bit where the order of the sums is the same (each token's output, its
gradient toward the input, the loss's gradient), within the rounding of the order elsewhere (a
weight's gradient, summed tile by tile; the loss, a sum of the chunks' sums); what the forward
keeps for backward loses the MLP's intermediates and the logits; the engine trains the tiled
GPT, its activations on the device or in DRAM, as plain PyTorch trains it, tiled or not, within
DESIGN's parity with torch's AdamW.

fp32 on the CPU, whose matrix products give a row the same bits whatever the row count in
blocks of 8 rows or more (so tiles here are multiples of 8 tokens, of 2 rows each)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tiered
from tiered.ops.long_sequence import chunked_cross_entropy, tiled
from tiered.planning.activations import forward_activations

from gpt import GPT
from helpers import CONFIGS
from helpers_models import OPTIM, assert_parity, make_model, run_engine, train_torch

SEQ, DIM, VOCAB, LAYERS = 256, 64, 97, 2
SUM_ORDER = dict(rtol=1e-5, atol=1e-7)
"""A weight's gradient summed tile by tile against one product over all tokens: a few units in
the last place (4.5e-7 of the largest element, measured), bounded by DESIGN's rtol."""


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(VOCAB, DIM, LAYERS, 4)


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))


def _loss_and_gradients(model: GPT, idx: torch.Tensor):
    loss = model(idx, idx)
    names = [name for name, _ in model.named_parameters()]
    return loss, dict(zip(names, torch.autograd.grad(loss, list(model.parameters()))))


@pytest.mark.parametrize("num_items", [None, 300], ids=["mean", "num_items"])
def test_chunked_loss_is_pytorchs_cross_entropy(num_items):
    torch.manual_seed(0)
    hidden = torch.randn(2, SEQ, DIM, requires_grad=True)
    head = torch.nn.Linear(DIM, VOCAB, bias=False)
    labels = torch.randint(0, VOCAB, (2, SEQ))
    labels[0, :40] = -100  # ignored tokens count for nothing, in the mean's count neither
    logits = head(hidden).float().flatten(0, 1)
    if num_items is None:
        expected = F.cross_entropy(logits, labels.flatten())
    else:
        expected = F.cross_entropy(logits, labels.flatten(), reduction="sum") / num_items
    grads = torch.autograd.grad(expected, (hidden, head.weight))

    loss = chunked_cross_entropy(hidden, head, labels, 64, num_items)
    chunked = torch.autograd.grad(loss, (hidden, head.weight))

    ulp = torch.finfo(torch.float32).eps * expected.abs().item()
    assert abs(loss.item() - expected.item()) <= 4 * ulp
    assert torch.equal(chunked[0], grads[0])
    torch.testing.assert_close(chunked[1], grads[1], **SUM_ORDER)


def test_tiled_gpt_gives_pytorchs_logits_and_gradients():
    model, idx = _gpt(), _tokens()
    logits = model(idx)
    loss, grads = _loss_and_gradients(model, idx)

    model.tile_sequence(mlp_tokens=64, loss_tokens=128)
    assert torch.equal(model(idx), logits)
    tiled_loss, tiled_grads = _loss_and_gradients(model, idx)

    assert tiled_loss.item() == pytest.approx(loss.item(), rel=4e-7)
    summed_by_tile = {name for name in grads if name.split(".")[-2] in ("fc", "out", "head")}
    for name, grad in grads.items():
        if name in summed_by_tile:
            torch.testing.assert_close(tiled_grads[name], grad, **SUM_ORDER)
        else:
            assert torch.equal(tiled_grads[name], grad), name


def test_the_forward_keeps_neither_the_mlps_intermediates_nor_the_logits():
    idx = _tokens()
    plain = forward_activations(_gpt(), lambda model: model(idx, idx))
    mlp_tiled = forward_activations(_gpt().tile_sequence(mlp_tokens=64),
                                    lambda model: model(idx, idx))
    both = forward_activations(_gpt().tile_sequence(mlp_tokens=64, loss_tokens=64),
                               lambda model: model(idx, idx))
    tokens, predicted, fp32 = idx.numel(), idx[:, 1:].numel(), 4
    # Each block's fc output and its GELU (4 x DIM a token each), then the log-softmax of the
    # logits of each token that predicts one: what an untiled forward keeps beyond the tiles'
    # inputs (the chunked loss keeps its chunks' sums, a few bytes).
    assert plain - mlp_tiled >= LAYERS * 2 * tokens * 4 * DIM * fp32
    assert mlp_tiled - both >= 0.99 * predicted * VOCAB * fp32


def test_tiles_run_without_gradients_and_refuse_no_tokens():
    mlp = torch.nn.Sequential(torch.nn.Linear(DIM, 4 * DIM), torch.nn.GELU(),
                              torch.nn.Linear(4 * DIM, DIM))
    x = torch.randn(2, SEQ, DIM)
    with torch.no_grad():
        assert torch.equal(tiled(mlp, x, 64), mlp(x))
    with pytest.raises(ValueError, match="tile_tokens must be a positive number of tokens"):
        tiled(mlp, x, 0)


@pytest.mark.parametrize("activations", [None, {"tier": "dram", "dram_bytes": "1MiB",
                                                "min_bytes": 0}], ids=["hbm", "dram"])
def test_the_engine_trains_the_tiled_gpt_as_pytorch_does(activations):
    def tiled_model() -> GPT:
        model = make_model().tile_sequence(mlp_tokens=8, loss_tokens=16)
        model.checkpointed = True
        return model

    def loss(model, idx):
        return model(idx, idx)

    engine, optimizer = tiered.initialize(
        tiled_model(), str(CONFIGS / "cpu.yaml"), compute_dtype="fp32", device="cpu",
        optimizer=dict(OPTIM), **({"activations": activations} if activations else {}))
    try:
        state = run_engine(engine, optimizer, loss=loss)
    finally:
        engine.close()
    reference = tiled_model()
    assert_parity(state, train_torch(reference, torch.optim.AdamW(reference.parameters(),
                                                                  **OPTIM), loss=loss))
    untiled = make_model()
    assert_parity(state, train_torch(untiled, torch.optim.AdamW(untiled.parameters(), **OPTIM)))
