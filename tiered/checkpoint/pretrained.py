"""Weights by name into the engine's shards: ``engine.load_state_dict``, ``engine.load_pretrained``
and ``tiered.initialize(model, weights=...)``.

Names are those of the original ``model.state_dict()``, as ``full_state_dict`` and
``save_pretrained`` give them. A TiledLinear's tiles read their blocks of the layer's ``weight``
and ``bias``. A tied parameter loads from the last of its names the source has (torch's last
write wins), each of them checked. Each rank reads only the elements of its own shards
(sources.py), so ranks read in parallel and nothing is broadcast, and a unit's values pass
through DRAM one shard at a time.

[Note: what a load replaces]
The weights: each unit's fp32 master weights and its compute-dtype weights (both buffers of the
delayed update), the model's persistent buffers and its modules' extra states. Not the
optimizer: the Adam moments and step counts stay as they were, as ``model.load_state_dict``
leaves a torch optimizer's state. A pending update is finished first, so that it cannot write
over what was loaded. Each value is rounded to the dtype the model gave its parameter, as
``param.copy_(value)`` rounds in PyTorch, then widened into the masters. What the source lacks
keeps its value (with ``initialize``: starts as the model initializes it), and is listed in
``missing_keys``.

A unit that keeps its frozen weights as a quantized record ([Note: quantized frozen weights]
in tiers/quantized.py) is quantized from whole weights, as at ``initialize``: rank 0 reads the
unit whole (one unit's fp32 copy at a time), quantizes it and sends the record's bytes to the
others. So it loads only whole: a source that holds some of its parameters and not others is
refused before anything changes (what it lacks would have to be its dequantized values
quantized again, which is not the weights it held).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
from torch import nn

from ..core.errors import TieredError
from ..ops.tiled_linear import TiledLinear, layer_of_tile, tiled_layers
from ..placement.plan import StateKind
from .format import DTYPES, CheckpointError
from .sources import WeightSource, open_source

PARAMETER_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
"""What a parameter loads from, rounded to its own dtype as torch's load_state_dict rounds. An
export holds buffers of any dtype (format.DTYPES), but an F8 or complex tensor is no weight."""


EXTRA_STATE = "_extra_state"
"""The suffix of a module's ``get_extra_state()`` in its state dict (torch's)."""


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


def extra_state_module(model: nn.Module, key: str) -> nn.Module:
    """The module whose ``get_extra_state()`` is the state dict's ``key``."""
    return model.get_submodule(key[:-len(EXTRA_STATE)].rstrip("."))


@torch.no_grad()
def store_model_state(model: nn.Module, values: dict[str, object]) -> None:
    """Copy buffers (by state-dict name, into them wherever they are now) and set extra
    states (``<module>._extra_state``): the model's state outside the units."""
    buffers = dict(model.named_buffers(remove_duplicate=False))
    for key, value in values.items():
        if key.endswith(EXTRA_STATE):
            extra_state_module(model, key).set_extra_state(value)
        else:
            assert isinstance(value, torch.Tensor), f"{key} is a buffer, not {type(value)}"
            buffers[key].copy_(value)


def extra_states(model: nn.Module, state_dict_keys) -> dict[str, object]:
    """The model's modules' ``get_extra_state()``, by state-dict key."""
    return {key: extra_state_module(model, key).get_extra_state()
            for key in state_dict_keys if key.endswith(EXTRA_STATE)}


RNG_STATES = ("rng.cpu", "rng.cuda")
"""The names a checkpoint and a step record keep the RNG states under."""


def rng_states(device: torch.device) -> dict[str, torch.Tensor]:
    """The RNG states dropout and the like draw from: the CPU's, and ``device``'s on a GPU."""
    states = {"rng.cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["rng.cuda"] = torch.cuda.get_rng_state(device)
    return states


def set_rng_states(states: dict[str, torch.Tensor], device: torch.device) -> None:
    """Undo :func:`rng_states` (a GPU's state only on a GPU, where it was kept)."""
    torch.set_rng_state(states["rng.cpu"])
    if device.type == "cuda" and "rng.cuda" in states:
        torch.cuda.set_rng_state(states["rng.cuda"], device)


def persistent_buffers(model: nn.Module, state_dict_keys) -> dict[str, torch.Tensor]:
    """The model's buffers that its state dict holds, by state-dict name."""
    keys = set(state_dict_keys)
    return {name: buffer for name, buffer in model.named_buffers(remove_duplicate=False)
            if name in keys}


def _holds(source: WeightSource, name: str) -> bool:
    return name in source.tensors or name in source.objects


def shard_buffer(flat) -> torch.Tensor:
    """An fp32 CPU buffer for this rank's shard of the unit, its padding zero and the rest to be
    written (not zeroed first: a pass over memory a load of a large model would pay twice)."""
    values = torch.empty(flat.shard_numel, dtype=torch.float32)
    start, _ = flat.shard_range
    values[max(0, flat.numel - start):].zero_()
    return values


def listing(names: list[str], most: int = 5) -> str:
    """The first ``most`` of ``names`` for a message."""
    return ", ".join(names[:most]) + (" ..." if len(names) > most else "")


class PretrainedWeights:
    """A source matched against the engine's units: which parameters, buffers and extra
    states it holds, checked (names, shapes, dtypes) before anything is read."""

    def __init__(self, source: WeightSource, flats, model: nn.Module,
                 state_dict_keys: list[str]):
        """``state_dict_keys``: the model's own state-dict names (before any tiling)."""
        self.source = source
        tiled = tiled_layers(model)
        self.places: dict[str, Place] = {}
        """Parameter (its first name) -> where the source holds it."""
        expected: set[str] = set()
        missing: list[str] = []
        for flat in flats:
            for spec in flat.spec.params:
                candidates = _candidates(spec.names, spec.shape, tiled)
                expected.update(name for name, _, _ in candidates)
                present = [c for c in candidates if c[0] in source.tensors]
                for name, shape, _ in present:
                    self._check(name, shape, floating=True)
                if present:  # a tied one: the last of its names, as torch's last write wins
                    self.places[spec.names[0]] = present[-1][2]
                else:
                    missing.append(candidates[0][0])
        buffers = persistent_buffers(model, state_dict_keys)
        for name, buffer in buffers.items():
            if name in source.tensors:
                self._check(name, tuple(buffer.shape), floating=False)
        # A module's get_extra_state() (any object) is in the state dict too.
        extra = [key for key in state_dict_keys if key.endswith(EXTRA_STATE)]
        self.buffer_names = [name for name in buffers if name in source.tensors]
        self.extra_names = [key for key in extra if _holds(source, key)]
        expected.update(buffers, extra)
        missing += [key for key in (*buffers, *extra) if not _holds(source, key)]
        order = {name: i for i, name in enumerate(state_dict_keys)}
        self.result = LoadResult(
            sorted(set(missing), key=lambda name: order.get(name, len(order))),
            [name for name in (*source.tensors, *source.objects) if name not in expected])
        self._whole = self._read_whole(flats)

    def _check(self, name: str, shape: tuple[int, ...], floating: bool) -> None:
        have, dtype = self.source.tensors[name]
        if tuple(have) != shape:
            raise CheckpointError(f"{self.source.where}: {name} has shape {list(have)}, the "
                                  f"model's is {list(shape)}")
        if floating and dtype not in PARAMETER_DTYPES:
            stored_as = DTYPES.get(dtype, "no safetensors dtype")
            raise CheckpointError(
                f"{self.source.where}: {name} is {dtype} ({stored_as}); a parameter loads from "
                f"a floating-point tensor of F32, BF16, F16 or F64 (F8 weights are quantized: "
                f"their scales are not applied here)")

    def _read_whole(self, flats) -> list[bool]:
        """Per unit, whether ``initialize`` builds it from the weights alone: they hold all of
        its parameters, and no module holding one of them also holds a parameter they lack. A
        module is initialized whole (its init may touch any of its parameters), so a unit
        sharing one with a parameter the weights lack is built as without weights, and the
        weights then overwrite what they hold (LoRA adapters beside their layer's frozen
        weight; a weight tied across units)."""
        # A unit lacking a parameter holds the module holding it, so it is never read whole.
        lacking = {id(module) for flat in flats for spec in flat.spec.params
                   if spec.names[0] not in self.places for module, _ in spec.holders}
        return [not any(id(module) in lacking for spec in flat.spec.params
                        for module, _ in spec.holders) for flat in flats]

    def reads_whole(self, flat) -> bool:
        """Whether ``initialize`` builds the unit from the weights alone (see _read_whole)."""
        return self._whole[flat.spec.index]

    def check_strict(self) -> None:
        missing, unexpected = self.result
        if not missing and not unexpected:
            return
        parts = [f"{len(found)} {what}: {listing(found)}"
                 for what, found in (("missing", missing), ("unexpected", unexpected)) if found]
        raise CheckpointError(
            f"{self.source.where} does not match the model's state dict ({'; '.join(parts)}); "
            f"pass strict=False to load what matches (what is missing keeps its value, or is "
            f"initialized as without weights)")

    def fill(self, flat, out: torch.Tensor, span: tuple[int, int] | None = None) -> None:
        """Write into ``out`` (this rank's shard of the unit, any device; with ``span``, the
        unit's elements ``[start, end)``) the elements the source holds, each rounded to its
        parameter's dtype first."""
        if out.device.type == "cuda":  # one copy each way, not one per run of elements
            on_host = out.cpu()  # (a tiled layer's tile is a run per row)
            self.fill(flat, on_host, span)
            out.copy_(on_host)
            return
        start, end = span if span is not None else flat.shard_range
        offset = 0
        for spec in flat.spec.params:
            place = self.places.get(spec.names[0])
            first, stop = max(start, offset), min(end, offset + spec.numel)
            if place is not None and first < stop:
                for at, source_at, count in place.runs(first - offset, stop - offset):
                    value = self.source.read(place.tensor, source_at, count)
                    if value.dtype is not spec.dtype and spec.dtype is not out.dtype:
                        value = value.to(spec.dtype)  # rounded as the model would hold it
                    here = offset + at - start
                    out[here:here + count].copy_(value)
            offset += spec.numel

    def load_unit(self, manager, flat) -> None:
        """Make the source's values this rank's weights of the unit (see [Note: what a load
        replaces]); elements it lacks keep theirs."""
        index = flat.spec.index
        held = [spec.names[0] in self.places for spec in flat.spec.params]
        if not any(held):
            return
        values = shard_buffer(flat)
        if not all(held):
            manager.copy_out(index, manager.weights_kind(index), values)
        self.fill(flat, values)
        manager.store_weights(index, values)

    def load_buffers(self, model: nn.Module) -> None:
        """Copy the source's values into the model's buffers and its modules' extra states."""
        values: dict[str, object] = {}
        for key in (*self.buffer_names, *self.extra_names):
            if key in self.source.objects:
                values[key] = self.source.objects[key]
            else:
                shape, _ = self.source.tensors[key]
                values[key] = self.source.read(key, 0, math.prod(shape)).view(shape)
        store_model_state(model, values)

    def close(self) -> None:
        self.source.close()


def open_weights(weights, flats, model: nn.Module, state_dict_keys: list[str], strict: bool,
                 group) -> PretrainedWeights:
    """Open and check ``weights`` (a path or a state dict) on every rank: if any rank cannot
    use them, or they hold other units whole on other ranks (``initialize`` builds units read
    whole without a collective, the others with one), every rank raises, before anything is
    read."""
    failure, matched, source = None, None, None
    try:
        source = open_source(weights)
        matched = PretrainedWeights(source, flats, model, state_dict_keys)
        if strict:
            matched.check_strict()
    except Exception as error:  # any error: the other ranks wait in the agreement below
        failure = error
        matched = None
        if source is not None:
            source.close()
    if not group.agree(failure is None) or matched is None:
        if matched is not None:
            matched.close()
        raise failure or CheckpointError("another rank cannot use the weights; nothing loaded")
    whole = torch.tensor([matched.reads_whole(flat) for flat in flats], dtype=torch.float32,
                         device=group.device)
    group.all_reduce_sum(whole)
    if not all(count in (0, group.world_size) for count in whole.tolist()):
        matched.close()
        raise CheckpointError("the ranks were given weights that hold different parameters; "
                              "give every rank the same weights")
    return matched


def _part_of_a_record(matched: PretrainedWeights, flats) -> CheckpointError | None:
    """The refusal of a source that holds part of a quantized unit, which loads whole or not
    at all (see the module's note); None where it holds none or all of each."""
    for flat in flats:
        held = [spec.names[0] in matched.places for spec in flat.spec.params]
        if flat.record is not None and any(held) and not all(held):
            lacking = [spec.names[0] for spec, has in zip(flat.spec.params, held) if not has]
            return CheckpointError(
                f"unit {flat.name} keeps its frozen weights quantized, which are quantized "
                f"from the whole unit: {matched.source.where} holds some of its parameters "
                f"but not {listing(lacking)}; give all of them, or none")
    return None


def _load_record(matched: PretrainedWeights, manager, flat, group) -> None:
    """The unit's record quantized from the source's values, this rank's shard of it stored."""
    manager.store(flat.spec.index, StateKind.PARAM, quantized_shard(
        flat, group, lambda full: matched.fill(flat, full, (0, flat.numel))))


def quantized_shard(flat, group, read: Callable[[torch.Tensor], None]) -> torch.Tensor:
    """This rank's shard of the unit's quantized record (a view of the whole), quantized by
    rank 0 from the whole unit that ``read`` writes into an fp32 flat copy on the device (zeros
    where it writes none), the record's bytes broadcast: a reduction of a CPU's kernels (a
    block's absmax, nf4's mean of the scales) may round otherwise under another thread count,
    and the ranks' shards must be of one record. A collective: rank 0's failure to read raises
    on every rank."""
    record = flat.record
    whole = torch.empty(record.nbytes, dtype=torch.uint8, device=group.device)
    failure = None
    if group.rank == 0:
        try:
            full = torch.zeros(flat.padded_numel, dtype=torch.float32, device=group.device)
            read(full)
            record.quantize(full, whole)
        except Exception as error:
            failure = error
    if not group.agree(failure is None):
        raise failure or CheckpointError(f"rank 0 failed to read unit {flat.name}")
    group.broadcast(whole)
    return record.shard(whole, group.rank)


def load(engine, weights, strict: bool) -> LoadResult:
    """``engine.load_state_dict`` and ``engine.load_pretrained``: replace the weights (see
    [Note: what a load replaces]). Every rank must call it."""
    runtime = engine.runtime
    if engine.closed:
        raise TieredError("this engine is closed; its weights were freed by close()")
    engine.optimizer.synchronize()
    if runtime.stepped_on_arrival:
        raise CheckpointError(
            "cannot load weights between the step's last backward and optimizer.step(): its "
            "units were already stepped as their gradients arrived "
            "(optimizer.accumulation_steps); load after optimizer.step()")
    matched = open_weights(weights, runtime.flats, engine.module, engine.state_dict_keys,
                           strict, runtime.group)
    partial = _part_of_a_record(matched, runtime.flats)
    if not runtime.group.agree(partial is None):
        matched.close()
        raise partial or CheckpointError("another rank was given part of a quantized unit; "
                                         "nothing loaded")
    failure = None
    with engine.replacing_states("loading weights"):
        try:
            # The records first: each a collective that every rank leaves together, even
            # raising, before any read that may fail on one rank alone.
            for flat in runtime.flats:
                if flat.record is not None and flat.spec.params[0].names[0] in matched.places:
                    _load_record(matched, runtime.manager, flat, runtime.group)
            for flat in runtime.flats:
                if flat.record is None:
                    matched.load_unit(runtime.manager, flat)
            matched.load_buffers(engine.module)
        except Exception as error:  # a read failing on one rank: every rank says so
            failure = error
        finally:
            matched.close()
        if not runtime.group.agree(failure is None):
            raise failure or CheckpointError(
                "another rank failed while reading the weights: they are partly loaded "
                "there; load them again")
    # What is still gathered or read ahead holds the old weights, and a graph kept past its
    # backward (retain_graph) saved them: its next backward refuses them, as torch's would.
    runtime.drop_gathered()
    return matched.result
