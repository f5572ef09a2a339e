"""Named tensors to load weights from, read by element range: safetensors files on disk, or a
state dict in memory.

A load reads each rank's own elements of each tensor and nothing else, so a source answers
``read(name, start, count)`` rather than handing out whole tensors: for files that is a byte
range (a seek and a read), and a model far larger than DRAM is never held whole.

The files are those ``engine.save_pretrained`` writes and Hugging Face publishes: a folder with
``model.safetensors``, or shards listed by ``model.safetensors.index.json``; or one
``.safetensors`` file. Pickled checkpoints (``pytorch_model.bin``) are refused: unpickling runs
code the file chooses.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Protocol

import torch

from .bnb4 import recognized
from .export import INDEX
from .format import CheckpointError, Reader

SINGLE_FILE = "model.safetensors"


class WeightSource(Protocol):
    """Tensors by name: their shapes and dtypes, and elements of their row-major flattening."""

    where: str
    """What to name in messages: the file, folder or "the state dict"."""
    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]]
    """Name -> (shape, dtype) of every tensor the source holds."""
    objects: dict[str, object]
    """Values that are not tensors (a module's extra state in a state dict), by name."""

    def read(self, name: str, start: int, count: int) -> torch.Tensor:
        """Elements ``[start, start + count)`` of ``name``, flattened, as a CPU tensor of its
        own dtype."""

    def close(self) -> None:
        """Let go of open files."""


class StateDictSource:
    def __init__(self, state_dict: Mapping[str, torch.Tensor]):
        self.where = "the state dict"
        self._values: dict[str, torch.Tensor] = {}
        self.objects: dict[str, object] = {}
        for name, value in state_dict.items():
            if isinstance(value, torch.Tensor):
                self._values[name] = value.detach()
            elif name.endswith("_extra_state"):
                self.objects[name] = value
            else:
                raise CheckpointError(f"the state dict's {name!r} is a {type(value).__name__}, "
                                      f"not a tensor")
        self.tensors = {name: (tuple(t.shape), t.dtype) for name, t in self._values.items()}
        self._copies: dict[str, torch.Tensor] = {}
        """Flattened copies of non-contiguous tensors: reshaping one copies it, so once per
        tensor, not once per read (a tile reads its layer's weight row by row)."""

    def read(self, name: str, start: int, count: int) -> torch.Tensor:
        value = self._values[name]
        if value.is_contiguous():
            flat = value.view(-1)
        else:
            copy = self._copies.get(name)
            if copy is None:
                copy = self._copies[name] = value.reshape(-1)
            flat = copy
        return flat[start:start + count].cpu()

    def close(self) -> None:
        self._copies.clear()


class SafetensorsSource:
    """A folder (``model.safetensors``, or the shards its index lists) or one file; every
    file's header is read and checked when opened."""

    def __init__(self, path: str | os.PathLike):
        path = os.fspath(path)
        self.where = path
        self._readers: list[Reader] = []
        self._owner: dict[str, Reader] = {}
        self.tensors: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self.objects: dict[str, object] = {}
        try:
            for file in _files(path):
                reader = Reader(file)
                self._readers.append(reader)
                for name, (entry, _) in reader.entries.items():
                    if name in self._owner:
                        raise CheckpointError(f"{file}: {name!r} is also in "
                                              f"{self._owner[name].path}")
                    self._owner[name] = reader
                    self.tensors[name] = (entry.shape, entry.dtype)
        except BaseException:
            self.close()
            raise

    def read(self, name: str, start: int, count: int) -> torch.Tensor:
        reader = self._owner[name]
        out = torch.empty(count, dtype=reader.entry(name).dtype)
        reader.read(name, out, start)
        return out

    def close(self) -> None:
        for reader in self._readers:
            reader.close()
        self._readers = []


class RenamedSource:
    """Another source's tensors under the model's names: ``names`` maps a model name to the
    source's name for it (a ``peft`` model's ``base_model.model.<...>.base_layer.weight`` to the
    base checkpoint's ``<...>.weight``). The source's tensors no name maps to keep their own."""

    def __init__(self, source: WeightSource, names: Mapping[str, str]):
        self._source = source
        self.where = source.where
        self.objects = source.objects
        self._name_in_source = {ours: theirs for ours, theirs in names.items()
                                if theirs in source.tensors}
        renamed = set(self._name_in_source.values())
        self.tensors = {name: value for name, value in source.tensors.items()
                        if name not in renamed}
        self.tensors.update({ours: source.tensors[theirs]
                             for ours, theirs in self._name_in_source.items()})

    def read(self, name: str, start: int, count: int) -> torch.Tensor:
        return self._source.read(self._name_in_source.get(name, name), start, count)

    def close(self) -> None:
        self._source.close()


def open_source(weights) -> WeightSource:
    """A source for ``weights``: a path (folder or file), a mapping of tensors, or a source
    already open (RenamedSource). The bitsandbytes 4-bit weights of a path or a mapping read as
    the weights they stand for ([Note: bitsandbytes exports] in bnb4.py)."""
    if isinstance(weights, RenamedSource):
        return weights
    if isinstance(weights, Mapping):
        return recognized(StateDictSource(weights))
    if isinstance(weights, (str, os.PathLike)):
        return recognized(SafetensorsSource(weights))
    raise CheckpointError(f"weights must be a folder or .safetensors file, or a state dict; got "
                          f"a {type(weights).__name__}")


def _files(path: str) -> list[str]:
    """The safetensors files of ``path``, shards in the order the index names them."""
    if os.path.basename(path) == INDEX:  # the index names the folder's shards
        path = os.path.dirname(path) or "."
    elif os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such file or folder (expected a folder holding "
                              f"{SINGLE_FILE} or {INDEX}, or a .safetensors file)")
    index = os.path.join(path, INDEX)
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = list(dict.fromkeys(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise CheckpointError(f"{index}: cannot be read as an index with a weight_map "
                                  f"({error})") from None
        missing = [name for name in files if not os.path.isfile(os.path.join(path, name))]
        if missing:
            raise CheckpointError(f"{index} lists {', '.join(missing[:3])}, not in {path}")
        return [os.path.join(path, name) for name in files]
    if os.path.isfile(os.path.join(path, SINGLE_FILE)):
        return [os.path.join(path, SINGLE_FILE)]
    try:
        names = sorted(os.listdir(path))
    except OSError as error:
        raise CheckpointError(f"{path}: cannot list the folder: {error.strerror}") from None
    found = [name for name in names if name.endswith(".safetensors")]
    if len(found) == 1:
        return [os.path.join(path, found[0])]
    pickled = [name for name in names if name.endswith((".bin", ".pt", ".pth"))]
    hint = (f"; {', '.join(pickled[:3])} are pickled, which tiered does not read (convert them "
            f"to safetensors)" if pickled else "")
    raise CheckpointError(f"{path}: holds no {SINGLE_FILE} and no {INDEX}"
                          f"{f', but {len(found)} .safetensors files' if found else ''}{hint}")
