"""Identical siblings counted once: a model's repeated blocks (a decoder's eighty layers) keep
the same bytes for backward each, so ``tiered plan --batch --seq`` counts a copy of the model
with one, two and three of them and extrapolates (issue 33, item 2).

Counting a forward on fake tensors dispatches every op through Python: eighty decoder layers
of a 70 B model with LoRA took about 10 s a forward here, and the plan counts two forwards (the
batch, and one more sequence). A block is repeated when it sits in an ``nn.ModuleList`` of
blocks of one structure (class, parameters' names, shapes, dtypes and ``requires_grad``,
buffers, submodules' classes). Each block's forward keeps tensors of its own (storages counted
once: activations.SavedBytes), and what all of them share (the rotary tables, a mask) is kept
once whatever their number, so the count grows by the same bytes with each block: with one,
two and three blocks that step is measured and checked to be the same twice over; where it is
not (blocks that behave differently by their position), or a copy with fewer blocks fails to
run, the whole model is counted instead.
"""
from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

from torch import nn

LEAST_REPEATED = 4
"""Fewer blocks than this are counted as they are: three are counted to extrapolate anyway."""


@dataclass(frozen=True)
class RepeatedBlocks:
    """A ``nn.ModuleList`` of ``count`` blocks of one structure, at ``path`` in the model."""

    path: str
    count: int


def _structure(module: nn.Module) -> tuple:
    """What makes two blocks keep the same bytes, given the same input."""
    return (type(module),
            tuple((name, tuple(p.shape), p.dtype, p.requires_grad)
                  for name, p in module.named_parameters()),
            tuple((name, tuple(b.shape), b.dtype) for name, b in module.named_buffers()),
            tuple((name, type(sub)) for name, sub in module.named_modules()))


def repeated_blocks(model: nn.Module) -> list[RepeatedBlocks]:
    """The model's lists of identical blocks, outermost only (a list inside a block is part of
    the block)."""
    found: list[RepeatedBlocks] = []
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < LEAST_REPEATED:
            continue
        if any(path.startswith(outer.path + ".") for outer in found):
            continue
        first = _structure(module[0])
        if all(_structure(block) == first for block in module):
            found.append(RepeatedBlocks(path, len(module)))
    return found


@contextmanager
def _truncated(model: nn.Module, counts: dict[str, int]) -> Iterator[None]:
    """``model`` with each list of ``counts`` holding only its first blocks, for a while."""
    kept = {}
    try:
        for path, count in counts.items():
            blocks = model.get_submodule(path)
            kept[path] = blocks._modules
            blocks._modules = dict(list(blocks._modules.items())[:count])
        yield
    finally:
        for path, modules in kept.items():
            model.get_submodule(path)._modules = modules


def with_blocks(model: nn.Module, counts: dict[str, int]) -> nn.Module:
    """A copy of ``model`` whose lists of ``counts`` hold only their first blocks (the model is
    left as it was; on the meta device nothing is copied but the modules)."""
    with _truncated(model, counts):
        return copy.deepcopy(model)


def extrapolated(count: Callable[[nn.Module], int], model: nn.Module,
                 blocks: list[RepeatedBlocks]) -> int | None:
    """``count(model)`` from copies with one, two and three of each list's blocks (see the
    module note); None when the step from one block to two is not the step from two to three,
    or a copy fails to run (the caller counts the whole model)."""
    base = {repeated.path: 1 for repeated in blocks}
    try:
        one = count(with_blocks(model, base))
        total = one
        for repeated in blocks:
            two = count(with_blocks(model, {**base, repeated.path: 2}))
            three = count(with_blocks(model, {**base, repeated.path: 3}))
            if three - two != two - one:
                return None
            total += (repeated.count - 1) * (two - one)
    except Exception:  # a model whose forward needs all its blocks: counted whole instead
        return None
    return total
