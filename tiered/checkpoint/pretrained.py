"""Weights by name into the engine's shards: ``engine.load_state_dict``, ``engine.load_pretrained``
and ``tiered.initialize(model, weights=...)``.

Names are those of the original ``model.state_dict()``, as ``full_state_dict`` and
``save_pretrained`` give them. A TiledLinear's tiles read their blocks of the layer's ``weight``
and ``bias``; a tied parameter loads from the first of its names the source has. Each rank
reads only the elements of its own shards (sources.py), so ranks read in parallel and nothing
is broadcast, and a unit's values pass through DRAM one shard at a time.

[Note: what a load replaces]
The weights: each unit's fp32 master weights and its compute-dtype weights (both buffers of the
delayed update), and the model's persistent buffers. Not the optimizer: the Adam moments and
step counts stay as they were, as ``model.load_state_dict`` leaves a torch optimizer's state.
A pending update is finished first, so that it cannot write over what was loaded. Each value is
rounded to the dtype the model gave its parameter, as ``param.copy_(value)`` rounds in PyTorch,
then widened into the masters. A parameter or buffer the source lacks keeps its value (with
``initialize``: is initialized as it would be without weights), and is listed in ``missing``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from ..ops.tiled_linear import TiledLinear, layer_of_tile, tiled_layers
from ..plan import StateKind
from .format import CheckpointError
from .sources import WeightSource, open_source


class LoadResult(NamedTuple):
    """What did not match, as ``nn.Module.load_state_dict`` reports it."""

    missing_keys: list[str]
    """The model's names the source lacks (a parameter or buffer keeps its value)."""
    unexpected_keys: list[str]
    """The source's names the model does not have (not read)."""


@dataclass(frozen=True)
class Place:
    """Where a model parameter's elements lie in a source tensor, in row-major order: runs of
    ``row`` elements, ``stride`` apart, from element ``offset``. A whole tensor is one run; a
    TiledLinear tile is a block of its layer's weight, one run per row."""

    tensor: str
    offset: int
    row: int
    stride: int

    def runs(self, start: int, stop: int):
        """(first element of the parameter, first element in the source, count) covering the
        parameter's elements ``[start, stop)``."""
        while start < stop:
            line, column = divmod(start, self.row)
            count = stop - start if self.row == self.stride else min(stop - start,
                                                                     self.row - column)
            yield start, self.offset + line * self.stride + column, count
            start += count


def _candidates(names: tuple[str, ...], shape: torch.Size,
                tiled: dict[str, TiledLinear]) -> list[tuple[str, tuple[int, ...], Place]]:
    """(source name, the shape it must have, where the parameter lies in it) for each name of
    a parameter, in the order of its names."""
    out = []
    for name in names:
        prefix = layer_of_tile(name, tiled)
        if prefix is None:
            out.append((name, tuple(shape), Place(name, 0, shape.numel(), shape.numel())))
            continue
        layer = tiled[prefix]
        tile, leaf = name[len(f"{prefix}tiles."):].split(".")
        first_row, rows, first_column, columns = layer.block(int(tile))
        if leaf == "weight":
            out.append((f"{prefix}weight", (layer.out_features, layer.in_features),
                        Place(f"{prefix}weight", first_row * layer.in_features + first_column,
                              columns, layer.in_features)))
        else:
            out.append((f"{prefix}bias", (layer.out_features,),
                        Place(f"{prefix}bias", first_row, rows, rows)))
    return out


def persistent_buffers(model: nn.Module, state_dict_keys) -> dict[str, torch.Tensor]:
    """The model's buffers that its state dict holds, by state-dict name."""
    keys = set(state_dict_keys)
    return {name: buffer for name, buffer in model.named_buffers(remove_duplicate=False)
            if name in keys}


class PretrainedWeights:
    """A source matched against the engine's units: which parameters and buffers it holds,
    checked (names, shapes, dtypes) before anything is read."""

    def __init__(self, source: WeightSource, flats, model: nn.Module,
                 state_dict_keys: list[str]):
        """``state_dict_keys``: the model's own state-dict names (before any tiling)."""
        self.source = source
        tiled = tiled_layers(model)
        self.places: dict[str, Place] = {}
        """Parameter (its first name) -> where the source holds it."""
        self.buffer_names: list[str] = []
        """The model's buffers the source holds."""
        expected, missing = set(), []
        for flat in flats:
            for spec in flat.spec.params:
                candidates = _candidates(spec.names, spec.shape, tiled)
                expected.update(name for name, _, _ in candidates)
                found = next((c for c in candidates if c[0] in source.tensors), None)
                if found is None:
                    missing.append(candidates[0][0])
                    continue
                name, shape, place = found
                self._check(name, shape, floating=True)
                self.places[spec.names[0]] = place
        for name, buffer in persistent_buffers(model, state_dict_keys).items():
            expected.add(name)
            if name in source.tensors:
                self._check(name, tuple(buffer.shape), floating=False)
                self.buffer_names.append(name)
            else:
                missing.append(name)
        order = {name: i for i, name in enumerate(state_dict_keys)}
        self.result = LoadResult(sorted(set(missing), key=order.__getitem__),
                                 [name for name in source.tensors if name not in expected])

    def _check(self, name: str, shape: tuple[int, ...], floating: bool) -> None:
        have, dtype = self.source.tensors[name]
        if tuple(have) != shape:
            raise CheckpointError(f"{self.source.where}: {name} has shape {list(have)}, the "
                                  f"model's is {list(shape)}")
        if floating and not dtype.is_floating_point:
            raise CheckpointError(f"{self.source.where}: {name} is {dtype}; a parameter loads "
                                  f"from a floating-point tensor")

    def check_strict(self) -> None:
        missing, unexpected = self.result
        if not missing and not unexpected:
            return
        parts = [f"{len(found)} {what}: {', '.join(found[:5])}{' ...' if len(found) > 5 else ''}"
                 for what, found in (("missing", missing), ("unexpected", unexpected)) if found]
        raise CheckpointError(
            f"{self.source.where} does not match the model's state dict ({'; '.join(parts)}); "
            f"pass strict=False to load what matches (what is missing keeps its value, or is "
            f"initialized as without weights)")

    def covers(self, flat) -> bool:
        """Whether the source holds every parameter of the unit."""
        return all(spec.names[0] in self.places for spec in flat.spec.params)

    def fill(self, flat, out: torch.Tensor) -> None:
        """Write into ``out`` (this rank's shard of the unit, any device) the elements the
        source holds, each rounded to its parameter's dtype first."""
        start, end = flat.shard_range
        offset = 0
        for spec in flat.spec.params:
            place = self.places.get(spec.names[0])
            first, stop = max(start, offset), min(end, offset + spec.numel)
            if place is not None and first < stop:
                for at, source_at, count in place.runs(first - offset, stop - offset):
                    value = self.source.read(place.tensor, source_at, count)
                    here = offset + at - start
                    out[here:here + count].copy_(value.to(spec.dtype))
            offset += spec.numel

    def load_unit(self, manager, flat) -> None:
        """Make the source's values this rank's weights of the unit (see [Note: what a load
        replaces]); elements it lacks keep theirs."""
        index = flat.spec.index
        held = [spec.names[0] in self.places for spec in flat.spec.params]
        if not any(held):
            return
        values = torch.zeros(flat.shard_numel, dtype=torch.float32)
        if not all(held):
            has_masters = manager.has(index, StateKind.MASTER)
            manager.copy_out(index, StateKind.MASTER if has_masters else StateKind.PARAM, values)
        self.fill(flat, values)
        manager.store_weights(index, values)

    @torch.no_grad()
    def load_buffers(self, model: nn.Module) -> None:
        """Copy the source's values into the model's buffers (wherever they are now)."""
        buffers = dict(model.named_buffers(remove_duplicate=False))
        for name in self.buffer_names:
            buffer = buffers[name]
            buffer.copy_(self.source.read(name, 0, buffer.numel()).view(buffer.shape))

    def close(self) -> None:
        self.source.close()


def open_weights(weights, flats, model: nn.Module, state_dict_keys: list[str], strict: bool,
                 group) -> PretrainedWeights:
    """Open and check ``weights`` (a path or a state dict) on every rank: if any rank cannot
    use them, every rank raises, before anything is read."""
    failure, matched, source = None, None, None
    try:
        source = open_source(weights)
        matched = PretrainedWeights(source, flats, model, state_dict_keys)
        if strict:
            matched.check_strict()
    except Exception as error:  # any error: the other ranks wait in the agreement below
        failure = error
        if source is not None:
            source.close()
    if not group.agree(failure is None):
        raise failure or CheckpointError("another rank cannot use the weights; nothing loaded")
    return matched


def load(engine, weights, strict: bool) -> LoadResult:
    """``engine.load_state_dict`` and ``engine.load_pretrained``: replace the weights (see
    [Note: what a load replaces]). Every rank must call it."""
    runtime = engine.runtime
    engine.optimizer.synchronize()
    gathered = [flat.name for flat in runtime.flats
                if runtime.gatherer.is_gathered(flat.spec.index)]
    if gathered:
        raise CheckpointError(f"cannot load weights while units are gathered (between a forward "
                              f"and its backward): {', '.join(gathered[:3])}")
    matched = open_weights(weights, runtime.flats, engine.module, engine._state_dict_keys,
                           strict, runtime.group)
    try:
        for flat in runtime.flats:
            matched.load_unit(runtime.manager, flat)
        matched.load_buffers(engine.module)
    finally:
        matched.close()
    return matched.result
