"""A checkpoint's manifest read back: UTF-8 JSON, and every field a load uses checked for its
type and range before anything reads it, so that a damaged or hand-edited manifest is a
CheckpointError naming the file, the key and what is allowed (``world_size: "two"`` loaded,
and ``steps_called: -5`` resumed at step -4), never a KeyError, a TypeError or a resume from
nonsense. Its ``files`` must be exactly the rank files of its world size: a name there is
joined to the folder's path."""
from __future__ import annotations

import json
import math
import os
import re
import stat

from .format import CheckpointError
from .latest import MANIFEST, read_text

FORMAT_VERSION = 3
"""2 added ``optimizer.group_hypers`` (the hyperparameters of each param group after group 0)
and ``frozen`` (the names of the frozen parameters). 3: a unit of frozen parameters only has
no moments, and where it keeps no fp32 masters its compute-dtype weights are saved instead
(plan.unit_state_kinds); each unit lists its parameters, so a load maps them by name into
units cut otherwise (layout.py). Buffers and extra states were added within 3 (``buffer.*``
and ``extra.*`` entries, the manifest's ``extra_states``): a reader of 3 ignores them, and a
checkpoint without them leaves the model's as they are. So was ``tiles``, each tiled layer's
cut (layout.tile_grids), which a load under another tiling reads; without it a tiled layer
loads into the same tiles only. So was a quantized unit's ``record`` (its format, compute
dtype, bytes and shard: checkpoint/records.py), saved as ``unit<i>.record`` bytes in place of
its weights: a reader before it finds no weights of that unit and refuses the load."""
READABLE_FORMATS = (1, 2, 3)
MANIFEST_LIMIT = 1 << 30
"""A manifest lists units and parameters: megabytes for the largest models, never a gigabyte."""
SHA256 = re.compile(r"^[0-9a-f]{64}$")


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def read_manifest(folder: str) -> dict:
    path = os.path.join(folder, MANIFEST)
    try:
        text = read_text(path, MANIFEST_LIMIT)
    except FileNotFoundError:
        raise CheckpointError(f"{folder} is not a complete checkpoint (no {MANIFEST})") from None
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: cannot be read: {e}") from None
    check_manifest(path, manifest)
    return manifest


def check_rank_file(folder: str, manifest: dict, name: str) -> str:
    """The path of the rank file ``name`` of the checkpoint ``folder``, checked against the
    manifest without reading it: listed, there, a regular file (a link to ``/dev/zero`` would
    be hashed for ever) and of the listed size (a file cut short)."""
    path = os.path.join(folder, name)
    expected = manifest["files"].get(name)
    try:
        found = os.stat(path)
    except FileNotFoundError:
        found = None
    except OSError as error:
        raise CheckpointError(f"{path}: cannot be read: {error.strerror}") from None
    if expected is None or found is None:
        raise CheckpointError(f"{path}: missing from the checkpoint")
    if not stat.S_ISREG(found.st_mode):
        kind = "a folder" if stat.S_ISDIR(found.st_mode) else "a device, FIFO or socket"
        raise CheckpointError(f"{path}: is {kind}, not a regular file as a rank file is")
    if found.st_size != expected["size"]:
        raise CheckpointError(f"{path}: {found.st_size} bytes, the manifest says "
                              f"{expected['size']} (truncated?)")
    return path


def intact_steps(folder: str) -> int:
    """The optimizer steps of the checkpoint ``folder`` where it is intact: its manifest reads
    and every rank file it lists passes :func:`check_rank_file` (not hashed: see [Note: a load
    without 'latest'] in latest.py); else a CheckpointError naming what is not."""
    manifest = read_manifest(folder)
    for name in manifest["files"]:
        check_rank_file(folder, manifest, name)
    return manifest["optimizer"]["steps_called"]


def check_manifest(path: str, manifest) -> None:
    """Raise a CheckpointError naming ``path``, the key and what is allowed at the first field
    a load uses that is missing or of the wrong type or range."""
    top = _Fields(path, "", manifest)
    if manifest.get("format") not in READABLE_FORMATS:
        raise CheckpointError(f"{path}: format {manifest.get('format')!r}; this tiered reads "
                              f"formats {', '.join(map(str, READABLE_FORMATS))}")
    world = top.integer("world_size", least=1)
    units = top.list("units")
    for index, unit in enumerate(units):
        _check_unit(_Fields(path, f"units[{index}]", unit), world)
    for index, name in enumerate(top.list("frozen", required=False)):
        top.text_at(f"frozen[{index}]", name)
    _check_tiles(top)
    top.object("extra_states", required=False)
    _check_optimizer(top.field("optimizer", top.object("optimizer")), len(units))
    policy = top.field("policy", top.object("policy"))
    optimizer = policy.field("optimizer", policy.object("optimizer"))
    for index, group in enumerate(optimizer.list("param_groups", required=False)):
        matches = optimizer.field(f"param_groups[{index}]", group).list("match")
        for at, pattern in enumerate(matches):
            optimizer.text_at(f"param_groups[{index}].match[{at}]", pattern)
    _check_files(top.field("files", top.object("files")), world)


def _check_unit(unit: "_Fields", world: int) -> None:
    unit.text("path")
    numel = unit.integer("numel")
    shard = unit.integer("shard_numel")
    padded = unit.integer("padded_numel")
    if shard != -(-numel // world) or padded != shard * world:
        unit.refuse("shard_numel", shard, f"numel {numel} cut into {world} shards: shard_numel "
                    f"{-(-numel // world)}, padded_numel {-(-numel // world) * world}")
    if "params" in unit.value:
        total = 0
        for index, pair in enumerate(unit.list("params")):
            if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)
                    and type(pair[1]) is int and pair[1] >= 0):
                unit.refuse(f"params[{index}]", pair, "a [name, elements] pair")
            total += pair[1]
        if total != numel:
            unit.refuse("params", f"{total} elements", f"the unit's numel, {numel}")
    if "record" in unit.value:
        _check_record(unit.field("record", unit.object("record")), world)


def _check_record(record: "_Fields", world: int) -> None:
    """A quantized unit's record (checkpoint/records.py): its bytes cut into ``world``
    shards as tiers/quantized.QuantizedUnit cuts them."""
    record.text("format")
    record.text("dtype")
    data = record.integer("bytes")
    shard = record.integer("shard_bytes")
    if shard != -(-max(data, 1) // world):
        record.refuse("shard_bytes", shard, f"{data} bytes cut into {world} shards: "
                      f"{-(-max(data, 1) // world)}")


def _check_tiles(top: "_Fields") -> None:
    for layer, cut in (top.object("tiles", required=False) or {}).items():
        grid = top.field(f"tiles[{layer!r}]", cut)
        for key in ("rows", "cols"):
            for index, count in enumerate(grid.list(key)):
                if type(count) is not int or count < 1:
                    grid.refuse(f"{key}[{index}]", count, "an integer >= 1")


def _check_optimizer(state: "_Fields", units: int) -> None:
    state.integer("steps_called")
    state.integer("skipped_steps")
    state.number("last_grad_norm", none=True, finite=False)  # inf or nan after an overflow
    _check_hyper(state.field("hyper", state.object("hyper")))
    for index, hyper in enumerate(state.list("group_hypers", required=False)):
        _check_hyper(state.field(f"group_hypers[{index}]", hyper))
    steps = state.list("unit_steps")
    if len(steps) != units:
        state.refuse("unit_steps", f"{len(steps)} counts", f"one per unit, {units}")
    for index, step in enumerate(steps):
        state.number_at(f"unit_steps[{index}]", step, least=0)
    scale = state.object("loss_scale", none=True)
    if scale is not None:
        scaler = state.field("loss_scale", scale)
        scaler.number("scale", least=0)
        scaler.integer("good_steps")
    pending = state.object("pending", none=True)
    if pending is not None:
        update = state.field("pending", pending)
        written = update.list("written")
        for index, unit in enumerate(written):
            if type(unit) is not int or not 0 <= unit < units:
                update.refuse(f"written[{index}]", unit, f"a unit's index, 0 to {units - 1}")
        update.number("norm", none=True, finite=False)
        update.boolean("overflowed")
        update.number("loss_scale", none=True)


def _check_hyper(hyper: "_Fields") -> None:
    hyper.number("lr", least=0)
    betas = hyper.list("betas")
    if len(betas) != 2 or not all(_is_number(b) and 0 <= b < 1 for b in betas):
        hyper.refuse("betas", betas, "two numbers in [0, 1)")
    hyper.number("eps", least=0)
    hyper.number("weight_decay", least=0)


def _check_files(files: "_Fields", world: int) -> None:
    expected = [rank_file(rank) for rank in range(world)]
    if sorted(files.value) != expected:
        files.refuse("", sorted(files.value)[:4], f"the rank files of world_size {world}, "
                     f"{expected[0]} to {expected[-1]}")
    for name in expected:
        entry = files.field(name, files.object(name))
        entry.integer("size")
        digest = entry.text("sha256")
        if not SHA256.match(digest):
            entry.refuse("sha256", digest, "64 lowercase hexadecimal digits")


def _is_number(value) -> bool:
    return type(value) in (int, float)


class _Fields:
    """The fields of one JSON object of the manifest at ``prefix`` (``units[3].``), each
    getter refusing a missing key or a value of the wrong type or range by name."""

    def __init__(self, path: str, prefix: str, value):
        self.path, self.prefix, self.value = path, prefix, value
        if not isinstance(value, dict):
            self.refuse("", value, "a JSON object")

    def field(self, key: str, value) -> "_Fields":
        return _Fields(self.path, self._name(key), value)

    def refuse(self, key: str, value, allowed: str):
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        where = self._name(key) or "the manifest"
        raise CheckpointError(f"{self.path}: {where} is {shown}; expected {allowed}")

    def _name(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.prefix and key else self.prefix or key

    def _get(self, key: str, required: bool):
        if key not in self.value:
            if required:
                raise CheckpointError(f"{self.path}: no {self._name(key)!r}; a checkpoint's "
                                      f"manifest has one")
            return None
        return self.value[key]

    def integer(self, key: str, least: int = 0) -> int:
        value = self._get(key, True)
        if type(value) is not int or value < least:
            self.refuse(key, value, f"an integer >= {least}")
        return value

    def number(self, key: str, least: float | None = None, none: bool = False,
               finite: bool = True) -> float | None:
        value = self._get(key, True)
        if value is None and none:
            return None
        return self.number_at(key, value, least, finite, none)

    def number_at(self, key: str, value, least: float | None = None, finite: bool = True,
                  none: bool = False) -> float:
        if not _is_number(value) or (finite and not math.isfinite(value)) or (
                least is not None and not value >= least):
            self.refuse(key, value, f"{'a finite ' if finite else 'a '}number"
                        f"{f' >= {least}' if least is not None else ''}"
                        f"{' or null' if none else ''}")
        return value

    def boolean(self, key: str) -> bool:
        value = self._get(key, True)
        if type(value) is not bool:
            self.refuse(key, value, "true or false")
        return value

    def text(self, key: str) -> str:
        return self.text_at(key, self._get(key, True))

    def text_at(self, key: str, value) -> str:
        if not isinstance(value, str):
            self.refuse(key, value, "a string")
        return value

    def list(self, key: str, required: bool = True) -> list:
        """The list at ``key``; an absent one that is not ``required`` is empty."""
        value = self._get(key, required)
        if key not in self.value:
            return []
        if not isinstance(value, list):
            self.refuse(key, value, "a JSON list")
        return value

    def object(self, key: str, required: bool = True, none: bool = False) -> dict | None:
        """``none``: null is allowed (the key is still required)."""
        value = self._get(key, required)
        if key not in self.value or (value is None and none):
            return None
        if not isinstance(value, dict):
            self.refuse(key, value, f"a JSON object{' or null' if none else ''}")
        return value
