"""``engine.save_pretrained(dir)``: consolidated weights as (sharded) safetensors, the layout
Hugging Face's ``from_pretrained`` reads, streamed unit by unit.

Files are ``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` with a
``model.safetensors.index.json`` mapping each name to its file, and a Hugging Face model's
``config.json`` (and ``generation_config.json``). Every rank takes part in
gathering one unit at a time; rank 0 writes it and drops it, so no rank holds the whole model
(only a TiledLinear's tiles wait for each other, to be written as the one layer they are). Names
and shapes are those of the original ``model.state_dict()``; tied parameters are written under
each of their names. The files of an earlier export into the same folder that this one does
not write again are removed (see _remove_stale).
"""
from __future__ import annotations

import json
import os
import re
import warnings
from typing import Any

import torch
from torch import nn

from ..ops.tiled_linear import TiledLinear, layer_of_tile, merge_layer_tiles, tiled_layers
from .format import CheckpointError, Entry, Writer

INDEX = "model.safetensors.index.json"
SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
"""A shard's name, as _assign names them (and Hugging Face does)."""


def save_pretrained(engine, directory: str, dtype: torch.dtype = torch.float32,
                    max_shard_bytes: int = 5 << 30) -> list[str]:
    """Write the weights under ``directory`` (``dtype``: fp32 master weights, or a compute
    dtype cast from them); returns the files written (on rank 0; others return []). The
    weights are those after any pending update (engine.consolidated_units finishes it)."""
    group, model = engine.runtime.group, engine.module
    tiled = tiled_layers(model)
    tile_names = _tile_names(engine, tiled)
    buffers = {}  # and extra states that are tensors: safetensors holds nothing else
    for name, value in nn.Module.state_dict(model).items():  # the buffers' own
        if isinstance(value, torch.Tensor):
            buffers[name] = value
        elif group.rank == 0:
            warnings.warn(f"tiered: save_pretrained leaves out {name} (a "
                          f"{type(value).__name__}, where safetensors holds tensors only)",
                          stacklevel=3)
    plan = _plan(engine, tiled, tile_names, buffers, dtype)
    files = _assign(plan, max_shard_bytes)
    writers: dict[str, Writer] = {}
    failure = None
    if group.rank == 0:
        try:
            os.makedirs(directory, exist_ok=True)
            for name in dict.fromkeys(files.values()):
                entries = [entry for entry in plan if files[entry.name] == name]
                writers[name] = Writer(os.path.join(directory, name), entries, {"format": "pt"})
        except Exception as error:
            failure = error
    if not group.agree(failure is None):
        raise failure or CheckpointError("rank 0 could not create the export's files")
    waiting: dict[str, torch.Tensor] = {}  # tile tensors until their layer is complete
    failure = None
    for flat, full in engine.consolidated_units():  # every rank gathers; rank 0 writes
        if group.rank != 0 or failure is not None:
            continue
        try:
            waiting.update(flat.by_name(full))
            for name, tensor in _ready(waiting, tiled, tile_names):
                writers[files[name]].write(tensor.to(dtype))
        except Exception as error:  # keep gathering with the others, then report
            failure = error
    if group.rank == 0 and failure is None:
        try:
            for name, tensor in buffers.items():
                if name in files:
                    writers[files[name]].write(tensor.detach().cpu())
            for writer in writers.values():
                writer.close()
            _write_index(directory, plan, files)
            _remove_stale(directory, set(writers))
            _write_configs(model, directory)
        except Exception as error:
            failure = error
    if not group.agree(failure is None):
        raise failure or CheckpointError("rank 0 could not write the export")
    return list(writers) if group.rank == 0 else []


def _write_configs(model: nn.Module, directory: str) -> None:
    """A Hugging Face model's ``config.json`` and, for one that generates, its
    ``generation_config.json``: without them ``from_pretrained`` of the folder built the
    default config of the class (a 7 B Llama for a tiny one)."""
    config: Any = getattr(model, "config", None)
    if callable(getattr(config, "save_pretrained", None)):
        config.save_pretrained(directory)
    generation: Any = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", None)
    if (callable(getattr(generation, "save_pretrained", None)) and callable(can_generate)
            and can_generate()):
        generation.save_pretrained(directory)


def _tile_names(engine, tiled: dict[str, TiledLinear]) -> dict[str, set[str]]:
    """Per tiled layer, the names of its tiles' parameters: the layer is written once all
    have been gathered (its tiles' weights and biases may be in different units: a frozen
    weight and a trained bias are split apart, units.py)."""
    names: dict[str, set[str]] = {prefix: set() for prefix in tiled}
    for flat in engine.runtime.flats:
        for spec in flat.spec.params:
            for name in spec.names:
                layer = layer_of_tile(name, tiled)
                if layer is not None:
                    names[layer].add(name)
    return names


def _plan(engine, tiled: dict[str, TiledLinear], tile_names: dict[str, set[str]],
          buffers: dict[str, torch.Tensor], dtype: torch.dtype) -> list[Entry]:
    """Every tensor, in the order it will be written: each unit's parameters as the unit is
    gathered (a tiled layer's weight and bias after its tiles' last parameter), then
    buffers."""
    entries, seen = [], {prefix: 0 for prefix in tiled}
    for flat in engine.runtime.flats:
        for spec in flat.spec.params:
            for name in spec.names:
                layer = layer_of_tile(name, tiled)
                if layer is None:
                    entries.append(Entry(name, dtype, tuple(spec.shape)))
                else:
                    seen[layer] += 1
                    module = tiled[layer]
                    if seen[layer] == len(tile_names[layer]):
                        entries.append(Entry(f"{layer}weight", dtype,
                                             (module.out_features, module.in_features)))
                        if module.has_bias:
                            entries.append(Entry(f"{layer}bias", dtype, (module.out_features,)))
    keys = set(engine.state_dict_keys)
    entries += [Entry(name, t.dtype, tuple(t.shape)) for name, t in buffers.items() if name in keys]
    return entries


def _ready(waiting: dict[str, torch.Tensor], tiled: dict[str, TiledLinear],
           tile_names: dict[str, set[str]]):
    """(name, tensor) pairs that can be written now, removed from ``waiting``."""
    for name in [n for n in waiting if layer_of_tile(n, tiled) is None]:
        yield name, waiting.pop(name)
    for prefix, module in tiled.items():
        if all(name in waiting for name in tile_names[prefix]):
            merge_layer_tiles(module, waiting, prefix)
            yield f"{prefix}weight", waiting.pop(f"{prefix}weight")
            if module.has_bias:
                yield f"{prefix}bias", waiting.pop(f"{prefix}bias")


def _assign(plan: list[Entry], max_shard_bytes: int) -> dict[str, str]:
    """Entry name -> file name, filling files up to ``max_shard_bytes`` in write order."""
    groups: list[list[str]] = [[]]
    size = 0
    for entry in plan:
        if groups[-1] and size + entry.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(entry.name)
        size += entry.nbytes
    if len(groups) == 1:
        return {name: "model.safetensors" for name in groups[0]}
    total = len(groups)
    return {name: f"model-{i + 1:05d}-of-{total:05d}.safetensors"
            for i, names in enumerate(groups) for name in names}


def _remove_stale(directory: str, written: set[str]) -> None:
    """Remove what an earlier export into ``directory`` left and this one did not write: an
    index beside a new single file makes readers of the index (tiered's among them) load the
    old shards, and an old ``model.safetensors`` beside a new index is what ``from_pretrained``
    reads first."""
    kept = written | ({INDEX} if len(written) > 1 else set())  # a single file has no index
    for name in os.listdir(directory):
        if name not in kept and (name in ("model.safetensors", INDEX) or SHARD.fullmatch(name)):
            os.remove(os.path.join(directory, name))


def _write_index(directory: str, plan: list[Entry], files: dict[str, str]) -> None:
    if len(set(files.values())) == 1:
        return
    index = {"metadata": {"total_size": sum(entry.nbytes for entry in plan)},
             "weight_map": {entry.name: files[entry.name] for entry in plan}}
    with open(os.path.join(directory, INDEX), "w") as f:
        json.dump(index, f, indent=2)
