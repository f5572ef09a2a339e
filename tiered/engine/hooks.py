"""Module and autograd hooks that gather units before they run and release them after.

[Note: hook order in one training step]
forward:  unit pre-hook   -> gather, bind the modules' attributes to fresh views of ``full``
          unit post-hook  -> put a pre-backward hook on each output that needs a gradient; release
backward: pre-backward    -> (first one of this backward) queue the end-of-backward callback;
                             gather the unit again, into the same storage the saved views use
          post-accumulate -> ``full.grad`` is complete: reduce-scatter, add to the grads tier,
                             release (see [Note: one gradient per unit] in flat.py)
          end callback    -> release whatever is still gathered (a unit whose outputs were used
                             but whose weights got no gradient), ready for the next step
The root unit is the model itself, so its pre-hook runs first and its post-hook last: the root's
own parameters (embeddings, final norm, head) stay gathered through the whole forward.
"""
from __future__ import annotations

from functools import partial
from typing import Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map_only

from .flat import FlatParam
from .runtime import UnitRuntime


class UnitHooks:
    def __init__(self, model: nn.Module, runtime: UnitRuntime, compute_dtype: torch.dtype,
                 on_backward_start: Callable[[], None]):
        self.runtime = runtime
        self.compute_dtype = compute_dtype
        self.on_backward_start = on_backward_start
        self._in_backward = False
        self._handles = []
        self._handles.append(model.register_forward_pre_hook(self._cast_inputs, with_kwargs=True))
        for flat in runtime.flats:
            module = flat.spec.module
            self._handles += [
                module.register_forward_pre_hook(partial(self._pre_forward, flat)),
                module.register_forward_hook(partial(self._post_forward, flat)),
                flat.full.register_post_accumulate_grad_hook(partial(self._post_backward, flat)),
            ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _cast_inputs(self, module, args, kwargs):
        """Floating-point inputs of the model take the compute dtype, as the weights have."""
        if self.compute_dtype is torch.float32:
            return None
        cast = partial(_cast_floating, dtype=self.compute_dtype)
        return tree_map_only(torch.Tensor, cast, (args, kwargs))

    def _pre_forward(self, flat: FlatParam, module, args) -> None:
        self.runtime.gather(flat)
        flat.bind_views()

    def _post_forward(self, flat: FlatParam, module, args, output) -> None:
        if torch.is_grad_enabled():
            for tensor in tree_flatten(output)[0]:
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(partial(self._pre_backward, flat))
        self.runtime.release(flat)

    def _pre_backward(self, flat: FlatParam, grad: torch.Tensor) -> None:
        if not self._in_backward:
            self._in_backward = True
            self.on_backward_start()
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        self.runtime.gather(flat)

    def _post_backward(self, flat: FlatParam, full: torch.Tensor) -> None:
        self.runtime.reduce_grad(flat)

    def _end_backward(self) -> None:
        self.runtime.release_all()
        self._in_backward = False


def _cast_floating(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(dtype) if tensor.is_floating_point() else tensor
