"""Building a model without materializing it: ``with tiered.init(policy): model = Model()``.

Inside the context every parameter a module registers is replaced by a meta tensor of the same
shape at once, so building costs no memory however large the model; buffers stay real (they are
small and often computed in ``__init__``, like rotary frequencies). ``tiered.initialize`` then
materializes the model one unit at a time on the compute device: real storage for that unit's
parameters, initialization, partitioning, each shard sent to its tier, the unit freed.

Initialization runs ``param_init_fn(module)`` (default: the module's ``reset_parameters``, or a
Hugging Face ``transformers`` model's own ``_init_weights``, see own_init_of) for
every module that holds parameters, children before parents as in eager construction, so a parent
that re-initializes a child's parameter (``nn.MultiheadAttention`` zeroing ``out_proj.bias``) wins.
A tied parameter takes the init of the module that created it (the embedding, not the head tied
to it afterwards), as in eager construction: every holder of a tied parameter is initialized
with it, the others first. A parameter no init writes (a ``torch.ones`` one its module's
``reset_parameters`` forgets) is refused by name, since its constructor value was never kept.
Initialization that a model runs after its modules are built (``self.apply(...)`` at the end of
``__init__``) sees meta tensors and does nothing: put it in ``param_init_fn``. A buffer computed
from a parameter in ``__init__`` would be a meta tensor, and is refused when registered.

Values equal eager construction's for deterministic inits; random ones draw from the generator
in unit order, not construction order, so they differ from an eager model's under the same seed.
"""
from __future__ import annotations

import inspect
import weakref
from typing import Callable, Protocol, TypeGuard

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from ..core.errors import TieredError
from ..placement.units import ParamSpec, UnitSpec
from ..policy.config import Policy, resolve

_built_under: "weakref.WeakKeyDictionary[nn.Module, init]" = weakref.WeakKeyDictionary()
# The module that first registered each meta parameter: in eager construction its init gives a
# tied parameter's value. Weak both ways, so neither keeps a model alive.
_creator: WeakIdKeyDictionary = WeakIdKeyDictionary()


class init:
    """Context manager: modules built inside hold meta parameters until ``tiered.initialize``.

    ``policy`` is resolved and validated here (so a bad policy fails before the model is built)
    and becomes the default for ``tiered.initialize`` of a model built inside.
    """

    def __init__(self, policy=None, *, param_init_fn: Callable[[nn.Module], None] | None = None,
                 **overrides):
        self.policy: Policy = resolve(policy, overrides)
        self.param_init_fn = param_init_fn
        # One (register_parameter, register_buffer) pair per entry: the same context may be
        # entered again inside itself, and each exit restores what its entry found.
        self._saved: list[tuple[Callable, Callable]] = []

    def __enter__(self) -> "init":
        original, original_buffer = nn.Module.register_parameter, nn.Module.register_buffer
        context = self
        # A real parameter registered on several modules (tied at construction) gets one meta
        # replacement, so it stays one parameter.
        meta_of: WeakIdKeyDictionary = WeakIdKeyDictionary()

        def register_parameter(module, name, param):
            original(module, name, param)
            if param is not None and not param.is_meta:
                if param not in meta_of:
                    meta_of[param] = nn.Parameter(torch.empty_like(param, device="meta"),
                                                  requires_grad=param.requires_grad)
                module._parameters[name] = meta_of[param]
            if param is not None and module._parameters[name] not in _creator:
                _creator[module._parameters[name]] = weakref.ref(module)
            _built_under[module] = context

        def register_buffer(module, name, tensor, persistent=True):
            _refuse_meta_buffer(module, name, tensor)
            original_buffer(module, name, tensor, persistent)

        self._saved.append((original, original_buffer))
        # torch's own methods, patched on the class for the context's extent (as accelerate's
        # init_empty_weights does): the checker takes any method assignment for a mistake.
        nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
        nn.Module.register_buffer = register_buffer  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc) -> None:
        parameter, buffer = self._saved.pop()  # torch's own (or an enclosing context's)
        nn.Module.register_parameter = parameter  # type: ignore[method-assign]
        nn.Module.register_buffer = buffer  # type: ignore[method-assign]


def _refuse_meta_buffer(module: nn.Module, name: str, tensor: torch.Tensor | None) -> None:
    """Buffers stay real under tiered.init; one on the meta device was computed from a
    parameter (which has no values yet) and would fail far from here, at initialize."""
    if tensor is not None and tensor.is_meta:
        raise TieredError(
            f"{type(module).__name__} registers buffer {name!r} on the meta device under "
            f"tiered.init, computed from a parameter that has no values yet; register it as "
            f"None and compute it in reset_parameters (or param_init_fn), or build the module "
            f"outside tiered.init")


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


def own_init_of(model: nn.Module) -> Callable[[nn.Module], None]:
    """The initialization a model gives its modules when built eagerly: a Hugging Face
    ``transformers`` model's ``_init_weights(module)`` (its ``post_init`` runs it over every
    module, after they are built, on the meta tensors under tiered.init), else each module's
    own ``reset_parameters`` (reset_module); in a ``peft`` model, each adapter as its LoRA layer
    initializes it (see _AdapterInit), the base model as above."""
    peft = _peft_parts(model)
    if peft is not None:
        base, peft_config = peft
        return _AdapterInit(model, peft_config, own_init_of(base))
    own = getattr(model, "_init_weights", None)
    if callable(own) and hasattr(model, "config") and hasattr(model, "post_init"):
        return own
    return reset_module


def peft_base_of(model: nn.Module) -> nn.Module | None:
    """The base model a ``peft`` model wraps; None for any other model."""
    peft = _peft_parts(model)
    return peft[0] if peft is not None else None


def _peft_parts(model: nn.Module) -> tuple[nn.Module, dict] | None:
    """A ``peft`` model's base model and its adapters' configs, by adapter name; None for any
    other model."""
    peft_config = getattr(model, "peft_config", None)
    get_base_model = getattr(model, "get_base_model", None)
    if isinstance(peft_config, dict) and callable(get_base_model):
        return get_base_model(), peft_config
    return None


class _LoraLayer(Protocol):
    """What tiered.init uses of a ``peft`` LoRA layer (peft ships no type information)."""

    lora_A: nn.ModuleDict

    def reset_lora_parameters(self, adapter_name: str, init_lora_weights: object) -> None: ...


def _is_lora_layer(module: nn.Module) -> TypeGuard[_LoraLayer]:
    """Whether ``module`` is a ``peft`` LoRA layer: it initializes its adapters itself."""
    return callable(getattr(module, "reset_lora_parameters", None))


class _AdapterInit:
    """A ``peft`` model's initialization. Its LoRA layers initialize their adapters in
    ``reset_lora_parameters(adapter, init_lora_weights)`` when built, which under tiered.init
    writes meta tensors: without this, ``lora_B`` took ``nn.Linear``'s init instead of PEFT's
    zeros, and a fine-tune started from another model than the base. Each (layer, adapter) is
    initialized once, whichever of its modules (``lora_A[name]``, ``lora_B[name]``, the
    embedding adapters' ParameterDicts, the layer) comes first; any other module as the base
    model initializes it."""

    def __init__(self, model: nn.Module, peft_config: dict,
                 base_init: Callable[[nn.Module], None]):
        self.base_init = base_init
        self.init_of = {name: getattr(config, "init_lora_weights", True)
                        for name, config in peft_config.items()}
        self.layer_of: dict[int, _LoraLayer] = {}
        for layer in model.modules():
            if not _is_lora_layer(layer):
                continue
            self.layer_of[id(layer)] = layer
            for kind in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B",
                         "lora_magnitude_vector"):
                container = getattr(layer, kind, None)
                if isinstance(container, nn.ModuleDict):
                    self.layer_of.update({id(m): layer for m in container.values()})
                if isinstance(container, (nn.ModuleDict, nn.ParameterDict)):
                    self.layer_of[id(container)] = layer
        self.done: set[tuple[int, str]] = set()

    def __call__(self, module: nn.Module) -> None:
        layer = self.layer_of.get(id(module))
        if layer is None:
            self.base_init(module)
            return
        for adapter in list(layer.lora_A) + list(getattr(layer, "lora_embedding_A", {})):
            if (id(layer), adapter) in self.done:
                continue
            self._initialize(layer, adapter, self.init_of.get(adapter, True))
            self.done.add((id(layer), adapter))

    @staticmethod
    def _initialize(layer: _LoraLayer, adapter: str, init: object) -> None:
        what = f"{type(layer).__name__} adapter {adapter!r}"
        if len(inspect.signature(layer.reset_lora_parameters).parameters) != 2 or \
                getattr(layer, "use_dora", {}).get(adapter, False):
            raise TieredError(f"{what}: tiered.init builds LoRA adapters only (not DoRA's "
                              f"magnitude, computed from the base weights, nor other peft "
                              f"tuners); build this peft model outside tiered.init")
        if init is False:  # peft leaves them as their layers' own init made them
            for kind in ("lora_A", "lora_B"):
                getattr(layer, kind)[adapter].reset_parameters()
            return
        if not (init is True or init == "gaussian"):
            raise TieredError(f"{what}: init_lora_weights={init!r} computes the adapter from "
                              f"the base weights, which tiered.init has not loaded yet; use "
                              f"True, False or 'gaussian', or build the peft model outside "
                              f"tiered.init")
        layer.reset_lora_parameters(adapter, init)


def _current(spec: ParamSpec) -> nn.Parameter:
    module, attr = spec.holders[0]
    param = module._parameters[attr]
    assert param is not None, f"{spec.names[0]}: a unit's parameter was removed from its module"
    return param


class Materializer:
    """Gives real, initialized storage to a unit's meta parameters, one unit at a time."""

    def __init__(self, model: nn.Module, units: list[UnitSpec], device: torch.device,
                 param_init_fn: Callable[[nn.Module], None] | None):
        self.device = device
        self.init_fn = param_init_fn or own_init_of(model)
        self.spec_of = {id(_current(p)): p for u in units for p in u.params}
        self.post_order = {id(m): i for i, m in enumerate(_post_order(model))}
        # Keyed by spec: specs live as long as this object, so their ids stay unique (a freed
        # parameter's id is soon reused by the next unit's).
        self.initializer = {id(p): self._initializer(p) for u in units for p in u.params}
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

    def _initializer(self, spec: ParamSpec) -> nn.Module:
        """The holder whose init gives the parameter its value: the module that created it
        (eager construction ran its init before any tying), else the first in post order."""
        modules = [module for module, _ in spec.holders]
        ref = _creator.get(_current(spec))
        creator = ref() if ref is not None else None
        if creator is not None and any(creator is module for module in modules):
            return creator
        return min(modules, key=lambda m: self.post_order[id(m)])

    def _to_materialize(self, specs: list[ParamSpec]) -> dict[int, nn.Parameter]:
        """The meta parameters that get storage with ``specs``: theirs, every other one of the
        modules holding them (a module's init may touch all of its parameters), and so on
        through tied parameters, so that every holder of each is initialized with it."""
        chosen: dict[int, nn.Parameter] = {}
        todo = [_current(spec) for spec in specs]
        while todo:
            param = todo.pop()
            if id(param) in chosen:
                continue
            chosen[id(param)] = param
            for module, _ in self.spec_of[id(param)].holders:
                todo += [p for p in _own(module) if p.is_meta]
        return chosen

    def _materialize(self, specs: list[ParamSpec]) -> None:
        # All of the unit's parameters get storage before any init runs, so a module's init may
        # touch a child's parameter of the same unit (MultiheadAttention does).
        chosen = [self.spec_of[key] for key in self._to_materialize(specs)]
        for spec in chosen:
            self._give_storage(_current(spec))
        with torch.no_grad():
            for module in sorted(_holders(chosen), key=self._init_rank):
                # A module runs for the parameters it initializes: not for tied ones another
                # holder initializes (a head's init would be discarded by the tying in eager
                # construction), nor again for ones an earlier unit initialized.
                keys = [id(self.spec_of[id(param)]) for param in _own(module)]
                mine = [key for key in keys if self.initializer[key] is module]
                if all(key in self.initialized for key in mine):
                    continue
                self.init_fn(module)
                self.initialized.update(mine)
        _refuse_unwritten(chosen)

    def _init_rank(self, module: nn.Module) -> float:
        """Post order (children before parents), except that a module holding a tied parameter
        another module creates runs just before that one, whose init then has the last word."""
        rank = float(self.post_order[id(module)])
        for param in _own(module):
            creator = self.initializer[id(self.spec_of[id(param)])]
            if creator is not module:
                rank = min(rank, self.post_order[id(creator)] - 0.5)
        return rank

    def _give_storage(self, meta: nn.Parameter) -> None:
        if not meta.is_meta:
            return
        spec = self.spec_of[id(meta)]
        # NaN until an init writes it: what no init writes is refused (_refuse_unwritten)
        # rather than trained from whatever the allocator held.
        real = nn.Parameter(torch.full_like(meta, float("nan"), device=self.device),
                            requires_grad=meta.requires_grad)
        self.spec_of[id(real)] = spec
        for module, attr in spec.holders:
            module._parameters[attr] = real


def _refuse_unwritten(specs: list[ParamSpec]) -> None:
    """Under tiered.init a parameter's constructor value is never kept: a parameter its
    module's init leaves (NaN still, see _give_storage) would start from no value at all."""
    unwritten = [spec for spec in specs
                 if spec.numel and torch.isnan(_current(spec).detach().amax())]
    if unwritten:
        names = ", ".join(f"{spec.names[0]} ({type(spec.holders[0][0]).__name__})"
                          for spec in unwritten)
        raise TieredError(
            f"{names}: built under tiered.init, not written by the module's reset_parameters "
            f"(or param_init_fn), so it has no value (its constructor's value is never "
            f"allocated); initialize it in reset_parameters, or pass "
            f"tiered.init(param_init_fn=fn)")


def _own(module: nn.Module) -> list[nn.Parameter]:
    return [param for param in module._parameters.values() if param is not None]


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
