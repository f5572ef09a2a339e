"""What a forward keeps for its backward: the bytes of the tensors autograd saves, measured the
same way on a training step (engine/hooks.py counts what its saved-tensor hooks keep) and on a
model built on the meta device (``tiered plan --batch --seq``), where nothing is allocated.

On the meta device torch would run attention by its math path, which keeps the S x S weights of
every head; the devices tiered trains on run a fused kernel (flash or memory-efficient on a GPU,
the CPU's flash kernel), which keeps its inputs, its output and each row's logsumexp. So the
meta forward counts what the fused kernel keeps (:class:`_FusedAttention`).

Each storage counts once, however many views of it are saved; a unit's weights and the
model's parameters are not activations and are left out by the callers. What a backward
allocates on its way (gradients of activations, a kernel's workspace) and what the caching
allocator holds besides are not saved tensors: a GPU's measured peak shows them, and the
re-plan (engine/replan.py) keeps a margin for them.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


class SavedBytes:
    """Counts the bytes autograd keeps, one forward at a time; ``peak``: the most any forward
    since :meth:`take_peak` kept."""

    def __init__(self):
        self._storages: set[int] = set()
        self.total = 0
        self.peak = 0

    def start(self) -> None:
        """A forward starts: the previous one's tensors are the backward's, not this one's."""
        self._storages.clear()
        self.total = 0

    def add(self, tensor: torch.Tensor) -> None:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor subclass with no storage
            self.total += tensor.numel() * tensor.element_size()
        else:
            if storage._cdata in self._storages:
                return
            self._storages.add(storage._cdata)
            self.total += storage.nbytes()
        self.peak = max(self.peak, self.total)

    def take_peak(self) -> int:
        peak, self.peak = self.peak, 0
        return peak


def forward_activations(model: nn.Module, run: Callable[[nn.Module], object]) -> int:
    """The bytes ``run(model)`` (a forward with grad) has autograd keep, its parameters left
    out; on the meta device nothing is computed or allocated, and attention is counted as a
    fused kernel keeps it (see the module note)."""
    meter = SavedBytes()
    parameters = {p.untyped_storage()._cdata for p in model.parameters()}
    on_meta = any(p.device.type == "meta" for p in model.parameters())

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.untyped_storage()._cdata not in parameters:
            meter.add(tensor)
        return tensor

    meter.start()
    attention = F.scaled_dot_product_attention
    if on_meta:
        F.scaled_dot_product_attention = _fused_attention
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run(model)
    finally:
        F.scaled_dot_product_attention = attention
    return meter.peak


class _FusedAttention(torch.autograd.Function):
    """Attention on the meta device as a fused kernel runs it, for counting only: the output's
    shape, and for backward the query, key, value, output and each row's logsumexp (fp32).
    The output of a (batch, heads, sequence, dim) query is laid out as the kernels lay it out,
    heads inside the sequence, so that merging the heads back is a view, not a copy kept
    again by the projection after it."""

    @staticmethod
    def forward(ctx, query, key, value):
        if query.dim() == 4:
            batch, heads, length, _ = query.shape
            out = query.new_empty((batch, length, heads, value.shape[-1])).transpose(1, 2)
        else:
            out = query.new_empty((*query.shape[:-1], value.shape[-1]))
        logsumexp = query.new_empty(query.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(query, key, value, out, logsumexp)
        return out

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("a meta-device forward is measured, never differentiated")


def _fused_attention(query, key, value, *args, **kwargs) -> torch.Tensor:
    return _FusedAttention.apply(query, key, value)
