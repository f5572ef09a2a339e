"""Building a model without materializing it: ``with tiered.init(policy): model = Model()``.

Inside the context every parameter a module registers is replaced by a meta tensor of the same
shape at once, so building costs no memory however large the model; buffers stay real (they are
small and often computed in ``__init__``, like rotary frequencies). ``tiered.initialize`` then
materializes the model one unit at a time on the compute device: real storage for that unit's
parameters, initialization, partitioning, each shard sent to its tier, the unit freed.

Initialization runs ``param_init_fn(module)`` (default: the module's ``reset_parameters``) for
every module that holds parameters, children before parents as in eager construction, so a parent
that re-initializes a child's parameter (``nn.MultiheadAttention`` zeroing ``out_proj.bias``) wins.
A module whose parameter has already been initialized through another holder (tied weights) is
not run again. Initialization that a model runs after its modules are built (``self.apply(...)``
at the end of ``__init__``) sees meta tensors and does nothing: put it in ``param_init_fn``.
"""
from __future__ import annotations

import weakref
from typing import Callable

import torch
from torch import nn

from ..errors import TieredError
from ..policy import Policy, resolve
from .units import ParamSpec, UnitSpec

_built_under: "weakref.WeakKeyDictionary[nn.Module, init]" = weakref.WeakKeyDictionary()


class init:
    """Context manager: modules built inside hold meta parameters until ``tiered.initialize``.

    ``policy`` is resolved and validated here (so a bad policy fails before the model is built)
    and becomes the default for ``tiered.initialize`` of a model built inside.
    """

    def __init__(self, policy=None, *, param_init_fn: Callable[[nn.Module], None] | None = None,
                 **overrides):
        self.policy: Policy = resolve(policy, overrides)
        self.param_init_fn = param_init_fn
        self._saved = None

    def __enter__(self) -> "init":
        original = nn.Module.register_parameter
        context = self

        def register_parameter(module, name, param):
            original(module, name, param)
            if param is not None and not param.is_meta:
                module._parameters[name] = nn.Parameter(
                    torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
            _built_under[module] = context

        self._saved = original
        nn.Module.register_parameter = register_parameter
        return self

    def __exit__(self, *exc) -> None:
        nn.Module.register_parameter = self._saved


def init_context_of(model: nn.Module) -> init | None:
    """The ``tiered.init`` context the model (or any of its modules) was built under."""
    for module in model.modules():
        if module in _built_under:
            return _built_under[module]
    return None


def reset_module(module: nn.Module) -> None:
    """Default initialization: the module's own ``reset_parameters``."""
    for name in ("reset_parameters", "_reset_parameters"):
        fn = getattr(module, name, None)
        if callable(fn):
            fn()
            return
    names = [n for n, p in module.named_parameters(recurse=False)]
    raise TieredError(
        f"{type(module).__name__} holds parameters {names} built under tiered.init but has no "
        f"reset_parameters() to initialize them; define one, or pass "
        f"tiered.init(param_init_fn=fn) where fn(module) initializes a module's own parameters")


def _current(spec: ParamSpec) -> torch.Tensor:
    module, attr = spec.holders[0]
    return module._parameters[attr]


class Materializer:
    """Gives real, initialized storage to a unit's meta parameters, one unit at a time."""

    def __init__(self, model: nn.Module, units: list[UnitSpec], device: torch.device,
                 param_init_fn: Callable[[nn.Module], None] | None):
        self.device = device
        self.init_fn = param_init_fn or reset_module
        self.spec_of = {id(_current(p)): p for u in units for p in u.params}
        self.post_order = {id(m): i for i, m in enumerate(_post_order(model))}
        self.initialized: set[int] = set()

    def device_bytes(self, units: list[UnitSpec]) -> int:
        """Bytes :meth:`materialize` will allocate on the device: the units' meta parameters,
        and any other meta parameter of the modules holding them (materialized alongside)."""
        return sum(t.numel() * t.element_size()
                   for t in self._to_materialize(_meta(units)).values())

    def materialize(self, units: list[UnitSpec]) -> None:
        """Give the units' meta parameters storage, then initialize them: units built together
        (the two halves of a split module) are materialized at once, since a module's init may
        touch any of its parameters."""
        pending = _meta(units)
        if pending:
            self._materialize(pending)

    def values(self, unit: UnitSpec) -> list[torch.Tensor]:
        """The unit's parameter values in spec order, materializing meta ones first."""
        self.materialize([unit])
        return [_current(p) for p in unit.params]

    def _to_materialize(self, specs: list[ParamSpec]) -> dict[int, nn.Parameter]:
        """The meta parameters that get storage with ``specs``: theirs, and every other one of
        the modules holding them (a module's init may touch all of its parameters)."""
        chosen = {id(_current(spec)): _current(spec) for spec in specs}
        for module in _holders(specs):
            for param in module._parameters.values():
                if param is not None and param.is_meta:
                    chosen.setdefault(id(param), param)
        return chosen

    def _materialize(self, specs: list[ParamSpec]) -> None:
        # All of the unit's parameters get storage before any init runs, so a module's init may
        # touch a child's parameter of the same unit (MultiheadAttention does).
        for param in self._to_materialize(specs).values():
            self._give_storage(param)
        with torch.no_grad():
            for module in sorted(_holders(specs), key=lambda m: self.post_order[id(m)]):
                # Keyed by spec: specs live as long as this object, so their ids stay unique
                # (a freed parameter's id is soon reused by the next unit's).
                own = [id(self.spec_of[id(p)]) for p in module._parameters.values()
                       if p is not None]
                if all(key in self.initialized for key in own):
                    continue
                self.init_fn(module)
                self.initialized.update(own)

    def _give_storage(self, meta: nn.Parameter) -> None:
        if not meta.is_meta:
            return
        spec = self.spec_of[id(meta)]
        real = nn.Parameter(torch.empty_like(meta, device=self.device),
                            requires_grad=meta.requires_grad)
        self.spec_of[id(real)] = spec
        for module, attr in spec.holders:
            module._parameters[attr] = real


def _meta(units: list[UnitSpec]) -> list[ParamSpec]:
    """The units' parameters still on the meta device."""
    return [p for unit in units for p in unit.params if _current(p).is_meta]


def _post_order(model: nn.Module) -> list[nn.Module]:
    order: list[nn.Module] = []
    seen: set[int] = set()

    def visit(module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        for child in module.children():
            visit(child)
        order.append(module)

    visit(model)
    return order


def _holders(specs: list[ParamSpec]) -> list[nn.Module]:
    """The modules holding ``specs``' parameters, each once."""
    return list({id(module): module for spec in specs for module, _ in spec.holders}.values())
