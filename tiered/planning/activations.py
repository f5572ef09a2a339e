"""What a forward keeps for its backward: the bytes of the tensors autograd saves, measured the
same way on a training step (engine/hooks.py counts what its saved-tensor hooks keep) and on a
model built on the meta device (``tiered plan --batch --seq``), where nothing is allocated.

A model built on the meta device runs as fake CPU tensors (torch's FakeTensorMode): each op
gives tensors of the shapes, dtypes, layouts and storages the CPU's kernels would, with no data.
On the meta device itself torch would run attention by its math path, which keeps the S x S
weights of every head, where the CPU (and a GPU) runs a fused kernel keeping its inputs, output
and each row's logsumexp; and Hugging Face models skip their data-dependent checks (packed
sequences, masks) on fake tensors, which on meta ones fail. On the CPU the count is, to the
byte, a real step's. Counted for a GPU, attention with dropout is counted as its flash kernel
keeps it (``for_gpu``), where the CPU's fused kernels take no dropout.

Each storage counts once, however many views of it are saved; a unit's weights and the
model's parameters are not activations and are left out by the callers. What a backward
allocates on its way (gradients of activations, a kernel's workspace) and what the caching
allocator holds besides are not saved tensors: a GPU's measured peak shows them, and the
re-plan (engine/replan.py) keeps a margin for them.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode


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

    def add_copy(self, nbytes: int) -> None:
        """Bytes copied out whole (a copy is its own storage, whatever the tensor's was)."""
        self.total += nbytes
        self.peak = max(self.peak, self.total)

    def take_peak(self) -> int:
        peak, self.peak = self.peak, 0
        return peak


def forward_activations(model: nn.Module, run: Callable[[nn.Module], object],
                        for_gpu: bool = False) -> int:
    """The bytes ``run(model)`` (a forward with grad) has autograd keep, its parameters left
    out. A model on the meta device is first made of fake CPU tensors (see the module note):
    nothing is computed or allocated, and ``run`` makes its inputs as it would for the CPU.

    ``for_gpu``: count attention with dropout as a GPU's flash kernel keeps it, a random seed
    where the CPU, whose fused kernels take no dropout, keeps the S x S weights and mask."""
    on_meta = any(p.device.type == "meta" for p in model.parameters())
    with (FakeTensorMode(allow_non_fake_inputs=True) if on_meta else nullcontext(),
          _attention_without_dropout() if for_gpu else nullcontext()):
        if on_meta:
            model = model.to_empty(device="cpu")
        meter = SavedBytes()
        parameters = {p.untyped_storage()._cdata for p in model.parameters()}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.untyped_storage()._cdata not in parameters:
                meter.add(tensor)
            return tensor

        meter.start()
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run(model)
    return meter.peak


@contextmanager
def _attention_without_dropout():
    """``F.scaled_dot_product_attention`` with its dropout left out, for the count only: the
    CPU's fused kernels refuse dropout and its math path keeps the weights, a GPU's flash
    kernel keeps the seed it drew the dropout from (bytes, not counted)."""
    attention = F.scaled_dot_product_attention

    def fused(*args, **kwargs):
        if len(args) > 4:
            args = (*args[:4], 0.0, *args[5:])
        kwargs.pop("dropout_p", None)
        return attention(*args, **kwargs)

    F.scaled_dot_product_attention = fused
    try:
        yield
    finally:
        F.scaled_dot_product_attention = attention
