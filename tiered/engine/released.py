"""What a module holds in place of a parameter while the parameter's unit is released.

[Note: released weights]
A unit's parameters are views of its gathered buffer only while the unit runs (flat.py). In
between, the buffer's storage is freed, and a view of it would read freed memory: a user's code
(or a debugger, or a traceback's repr) reading ``model.head.weight`` after a step crashed the
process. The module holds a ``ReleasedWeight`` instead: a meta tensor of the parameter's shape
and dtype, so ``.shape``, ``.dtype`` and ``repr`` work, while any use of its values (an
operation, a copy) raises a TieredError that names the parameter and its unit. Such a use is
a module reading a unit's weights without calling that unit's module (a parent's
``F.linear(x, child.weight)``): the unit is gathered only around its module's call.
"""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves

from ..core.errors import TieredError

_METADATA = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.stride,
             torch.Tensor.element_size, torch.Tensor.is_floating_point, torch.Tensor.__repr__,
             torch.Tensor.__format__, torch.Tensor.__len__, torch.Tensor.__hash__}
"""Tensor methods that read no values (besides property getters, which all pass)."""
_REQUIRES_GRAD = torch._C.TensorBase.__dict__["requires_grad"]
"""The ``requires_grad`` descriptor: its ``__set__`` is what ``p.requires_grad = x`` calls."""
_GRAD = torch._C.TensorBase.__dict__["grad"]
"""The ``grad`` descriptor: its ``__get__`` is what reading ``p.grad`` calls."""


class ReleasedWeight(torch.Tensor):
    """See [Note: released weights]."""

    released_from: tuple[str, str]
    """The parameter's name and its unit's."""
    compute_device: torch.device

    @staticmethod
    def __new__(cls, shape: torch.Size, dtype: torch.dtype, name: str, unit: str,
                requires_grad: bool = False, device: torch.device | None = None):
        weight = torch.Tensor._make_subclass(cls, torch.empty(shape, dtype=dtype, device="meta"),
                                             requires_grad)
        weight.released_from = (name, unit)
        weight.compute_device = device or torch.device("meta")
        return weight

    @property  # torch's stubs declare a plain attribute: a property reads the same
    def device(self) -> torch.device:  # type: ignore[override]
        """The device the parameter computes on when gathered, as a model's ``device`` (and
        Hugging Face's ``generate``) reads it from its first parameter."""
        return self.compute_device

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__self__", None) is _GRAD:
            name, unit = args[0].released_from
            raise TieredError(
                f"{name}: a tiered model's gradients live in the engine's shards, not on its "
                f"parameters (unit {unit}), so torch-level gradient code (clip_grad_norm_ over "
                f"model.parameters(), an optimizer of one's own) would see none; clip with the "
                f"policy's optimizer.max_grad_norm and step the optimizer tiered.initialize "
                f"returned (with Hugging Face's Trainer: tiered.integrations.transformers."
                f"TieredTrainer)")
        if func in _METADATA or getattr(func, "__name__", None) == "__get__":
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        name, unit = next(leaf.released_from for leaf in tree_leaves((args, kwargs))
                          if isinstance(leaf, ReleasedWeight))
        freezing = getattr(func, "__self__", None) is _REQUIRES_GRAD  # p.requires_grad = x
        if func is torch.Tensor.requires_grad_ or freezing:
            raise TieredError(
                f"{name}: requires_grad cannot change after tiered.initialize, which fixed "
                f"which parameters train (unit {unit}); set requires_grad before initialize")
        raise TieredError(
            f"{name} was used outside the forward of its unit {unit}: a unit holds its weights "
            f"only while its module runs (or its backward needs them). Call the module instead "
            f"of reading its weights, or make the module that reads them the unit "
            f"(policy units.classes)")
