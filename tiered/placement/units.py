"""Grouping a model's parameters into units.

A unit is a module whose parameters are gathered and released together. By default every
repeated block is a unit (the children of a ``ModuleList``/``Sequential`` that holds two or more
modules of one class with parameters, outermost lists only; a lone module beside such blocks is
searched too), and the root module is one more unit for all remaining parameters.
``units.classes`` in the policy names the classes instead.
``units.split_large`` (on by default) also makes a unit of every module outside them whose own
parameters are as large as the largest of them (a language model's untied token embedding and
output head): gathered through the whole forward like the root, but with a gradient of its own
that leaves as soon as its backward is done, and gathered in backward only if its backward
reads its weights (an embedding's does not).

Each parameter belongs to exactly one unit: the innermost unit containing the module that holds
it. A parameter held by several modules (tied input and output embeddings) belongs to the deepest
unit that contains all of its holders, so it stays gathered while any of them runs.

``units.split_frozen`` (on by default) makes two units of one whose parameters are partly frozen
(``requires_grad=False``): the frozen ones, then the trainable ones, both of the same module, so
gathered together when it runs. A unit of frozen parameters only keeps its weights alone
(plan.unit_state_kinds), so a frozen transformer block with LoRA adapters costs 2 bytes per
frozen parameter, and AdamW state for the adapters only. Each half is released after its own
backward: the trainable one when its gradient is complete, the frozen one when its module's
inputs have their gradients (see [Note: frozen units] in hooks.py).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from ..core.errors import PolicyError
from ..ops.tiled_linear import LinearTile


@dataclass(frozen=True)
class ParamSpec:
    """One original parameter: its state-dict name(s), where modules hold it, and its shape."""

    names: tuple[str, ...]
    """Every fully qualified name it has in ``model.state_dict()`` (several when tied)."""
    holders: tuple[tuple[nn.Module, str], ...]
    """Every (module, attribute) that refers to it; all are rebound when the unit is gathered."""
    shape: torch.Size
    dtype: torch.dtype
    """The dtype the model gave it: whether the compute dtype holds its values exactly."""
    trainable: bool = True
    """``requires_grad``: a frozen parameter is bound as a detached view (autograd computes
    no gradient for it) and is never stepped."""

    @property
    def numel(self) -> int:
        return self.shape.numel()


@dataclass(frozen=True)
class UnitSpec:
    index: int
    path: str
    """Module path of the unit ("" for the root)."""
    module: nn.Module
    params: tuple[ParamSpec, ...]
    whole_forward: bool = False
    """Gathered for the whole model forward, as the root's own parameters are: the model may
    read its weights anywhere in its forward (a head computed as ``F.linear(h, emb.weight)``),
    not only inside the unit's module. In backward it is a unit like any other."""
    frozen_part: bool = False
    """The frozen half of a partly frozen module's parameters (``units.split_frozen``); the
    trainable half is the next unit, of the same module."""


def _is_ancestor(path: str, of: str) -> bool:
    return path == "" or of == path or of.startswith(path + ".")


def _repeated_blocks(model: nn.Module) -> list[str]:
    found: list[str] = []

    def visit(module: nn.Module, path: str) -> None:
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            kinds = Counter(type(child) for child in module.children()
                            if any(True for _ in child.parameters()))
            if any(count >= 2 for count in kinds.values()):
                for name, child in module.named_children():
                    child_path = f"{path}.{name}" if path else name
                    if kinds.get(type(child), 0) >= 2:
                        found.append(child_path)
                    else:  # a lone module beside the blocks may hold blocks of its own
                        visit(child, child_path)
                return
        for name, child in module.named_children():
            visit(child, f"{path}.{name}" if path else name)

    visit(model, "")
    return found


def _as_large_as_a_unit(model: nn.Module, units: list[str]) -> list[str]:
    """Modules outside ``units`` whose own parameters are at least the largest unit's.

    Left in the root, their gradients wait in one root-sized buffer from the output head's
    backward, at the step's activation peak, until the embedding's at its end, and the root's
    backward gathers them all again."""
    modules = dict(model.named_modules())
    largest = max((sum(p.numel() for p in modules[path].parameters()) for path in units),
                  default=0)
    if largest == 0:
        return []
    return [path for path, module in modules.items()
            if path and not any(_is_ancestor(unit, path) for unit in units)
            and sum(p.numel() for p in module._parameters.values() if p is not None) >= largest]


def find_units(model: nn.Module, classes: tuple[str, ...] | None,
               split_large: bool = False, split_frozen: bool = False) -> list[UnitSpec]:
    """Units in forward-registration order, the root last; units without parameters are dropped."""
    if classes is None:
        unit_paths = _repeated_blocks(model)
    else:
        known = {type(m).__name__ for m in model.modules()}
        missing = [c for c in classes if c not in known]
        if missing:
            raise PolicyError(f"units.classes names {missing}, which the model does not contain; "
                              f"its module classes are: {', '.join(sorted(known))}")
        unit_paths = [path for path, m in model.named_modules()
                      if path and type(m).__name__ in classes]
    split = _as_large_as_a_unit(model, unit_paths) if split_large else []
    unit_paths += split
    # Tiles of a TiledLinear are always units of their own: that is what they are for.
    unit_paths += [path for path, m in model.named_modules() if isinstance(m, LinearTile)]
    modules = dict(model.named_modules(remove_duplicate=False))
    candidates = sorted(set(unit_paths), key=lambda p: p.count("."), reverse=True) + [""]

    holders: dict[int, list[tuple[str, str]]] = {}
    tensors: dict[int, nn.Parameter] = {}
    for module_path, module in modules.items():
        for attr, param in module._parameters.items():
            if param is None:
                continue
            holders.setdefault(id(param), []).append((module_path, attr))
            tensors[id(param)] = param

    owned: dict[str, list[ParamSpec]] = {path: [] for path in candidates}
    for key, places in holders.items():
        param = tensors[key]
        owner = next(u for u in candidates if all(_is_ancestor(u, p) for p, _ in places))
        names = tuple(f"{p}.{a}" if p else a for p, a in places)
        owned[owner].append(ParamSpec(
            names=names,
            holders=tuple((modules[p], a) for p, a in places),
            shape=param.shape, dtype=param.dtype, trainable=param.requires_grad))

    order = {path: i for i, path in enumerate(modules)}
    specs = [path for path in sorted(candidates, key=order.__getitem__) if path] + [""]
    units: list[UnitSpec] = []
    for path in specs:
        params = owned[path]
        frozen = [p for p in params if not p.trainable]
        parts = ([(frozen, True), ([p for p in params if p.trainable], False)]
                 if split_frozen and 0 < len(frozen) < len(params) else [(params, False)])
        for part, frozen_part in parts:
            if part:
                units.append(UnitSpec(len(units), path, modules[path], tuple(part),
                                      whole_forward=path in split, frozen_part=frozen_part))
    return units


def module_groups(specs: list[UnitSpec]) -> list[int]:
    """Per unit, the index of the first unit of its module: the halves of a split module share
    one, as they are built and gathered together (the trace's look-ahead and the start-up
    working set count them as one)."""
    groups: list[int] = []
    for index, spec in enumerate(specs):
        same = index > 0 and specs[index - 1].module is spec.module
        groups.append(groups[-1] if same else index)
    return groups
