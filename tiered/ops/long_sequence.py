"""The memory of a long sequence that is not a saved activation: the MLP's intermediate and the
logits, bounded by computing them a tile of tokens at a time (opt-in, exact per token).

[Note: tiles of the sequence]
An MLP and the vocabulary head with its cross entropy compute each token's row from that
token's input alone, so they can run a tile of tokens at a time. Each tile runs under
non-reentrant activation checkpointing: the forward keeps only the tile's input (a view of the
whole input, which the untiled computation keeps too), and the backward recomputes one tile at a
time. The largest intermediate alive is one tile's: for 128K tokens and a 128K-token vocabulary,
8K-token chunks hold 4 GiB of fp32 logits at a time instead of 63 GiB. Checkpointing restores
the random state for the recomputation, so dropout inside a tile draws the same mask twice.

Exactness, against the untiled computation in plain PyTorch (tests/ops/test_long_sequence.py):
each token's output and each token's gradient toward the input are the same bits wherever the
matrix product computes a row the same whatever the number of rows (the CPU's kernels do). A
weight's gradient sums over the tokens; tiled, autograd adds the tiles' sums, in another order,
which rounds differently (within a few units in the last place of the gradient's dtype per
tile). The loss is the sum of the chunks' sums divided by the count of tokens with a label, the
mean cross entropy computes in one sum: equal to within the rounding of the sum's order; its
gradient toward the logits, the count's reciprocal at each label, is the same bits.

[Note: weights a recomputation reads]
A tile's checkpoint keeps its input and none of the weights its recomputation reads, so autograd
never shows them saved: an engine that holds a unit's weights in backward from the first unpack
of a saved view of them (tiered's hooks) would let the recomputation read released weights.
So the tiled output passes through a step that saves the module's parameters for backward: its
backward, which runs before any tile's (it comes after them in the forward), unpacks them, and
the unit is gathered by then. Without an engine the step costs a reference per parameter.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100
"""The label of a token that counts for no loss (PyTorch's and Hugging Face's)."""


def tiled(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile_tokens: int,
          dim: int = -2, reads: Iterable[torch.Tensor] | None = None) -> torch.Tensor:
    """``fn(x)`` for a token-wise ``fn``, computed ``tile_tokens`` tokens of ``x`` at a time
    along ``dim`` (see [Note: tiles of the sequence]); the output is whole, as ``fn``'s.

    ``reads``: the weights ``fn`` computes with (default: the parameters of ``fn``'s module, when
    it is a module or a module's method; see [Note: weights a recomputation reads])."""
    _check_tile(tile_tokens, "tile_tokens")
    # One tile is checkpointed too: what a forward keeps is then the same kind at any length
    # (the planner's longest sequence draws a line through two counts).
    out = torch.cat([_one_tile(fn, piece) for piece in x.split(tile_tokens, dim)], dim)
    return _read_in_backward(out, _weights_of(fn) if reads is None else reads)


def chunked_cross_entropy(hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor],
                          labels: torch.Tensor, chunk_tokens: int,
                          num_items: torch.Tensor | int | None = None,
                          ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The cross entropy of ``head(hidden)`` (the logits, taken in fp32) against ``labels``,
    without the logits of more than ``chunk_tokens`` tokens at a time: what
    ``F.cross_entropy(head(hidden).float().flatten(0, -2), labels.flatten(),
    ignore_index=ignore_index)`` gives, or its sum divided by ``num_items`` where that is given
    (Hugging Face's loss over a batch's tokens).

    ``hidden``: (..., H) with the leading shape of ``labels``; ``head``: the vocabulary head (a
    module, so that whatever wraps it, a LoRA adapter, runs as in the model's forward)."""
    _check_tile(chunk_tokens, "chunk_tokens")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"chunked_cross_entropy: hidden states {tuple(hidden.shape)} and "
                         f"labels {tuple(labels.shape)} differ in their tokens")
    rows, targets = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)

    def chunk_loss(piece: torch.Tensor, piece_labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(head(piece).float(), piece_labels, ignore_index=ignore_index,
                               reduction="sum")

    total = torch.stack([_one_tile(chunk_loss, piece, piece_labels) for piece, piece_labels
                         in zip(rows.split(chunk_tokens), targets.split(chunk_tokens))]).sum()
    total = _read_in_backward(total, _weights_of(head))
    if num_items is None:
        return total / (targets != ignore_index).sum().to(total.dtype)
    if torch.is_tensor(num_items):
        num_items = num_items.to(total.device)
    return total / num_items


def _one_tile(fn: Callable[..., torch.Tensor], *pieces: torch.Tensor) -> torch.Tensor:
    """``fn`` over one tile: checkpointed where a backward will need what it computes."""
    if torch.is_grad_enabled():
        return checkpoint(fn, *pieces, use_reentrant=False)
    return fn(*pieces)


class _ReadInBackward(torch.autograd.Function):
    """``out`` as it is, with ``weights`` saved for backward (see [Note: weights a
    recomputation reads])."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*weights)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        weights = ctx.saved_tensors  # the unpack is what matters: an engine gathers for it
        return (grad,) + (None,) * len(weights)


def _read_in_backward(out: torch.Tensor, weights: Iterable[torch.Tensor]) -> torch.Tensor:
    weights = tuple(weights)
    if not weights or not torch.is_grad_enabled():
        return out
    return _ReadInBackward.apply(out, *weights)


def _weights_of(fn: Callable) -> Iterable[torch.Tensor]:
    """The parameters of the module ``fn`` is, or is a method of; none for another callable.
    Read as attributes, not from ``parameters()``: an engine may bind what a module computes
    with there (tiered binds views of a gathered unit)."""
    module = fn if isinstance(fn, nn.Module) else getattr(fn, "__self__", None)
    if not isinstance(module, nn.Module):
        return ()
    places = (name.rpartition(".") for name, _ in module.named_parameters())
    return [getattr(module.get_submodule(owner), leaf) for owner, _, leaf in places]


def _check_tile(tokens: int, name: str) -> None:
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"{name} must be a positive number of tokens, not {tokens!r}")
