"""Where a load finds each element of the engine's shards in a checkpoint.

A saved unit is a padded flat of its parameters, cut into one shard per rank that saved it
(flat.py). The engine loading it may cut the model differently: other ranks (other shards of the
same units), or other units: ``units.split_frozen`` makes two units of a partly frozen one, so a
resume that freezes or unfreezes parameters moves them between units. Since format 3 the
manifest lists each unit's parameters, and a load maps every parameter by name (a tiled layer's
tiles by where they lie in the layer: [Note: tiles in checkpoints]): a *segment* is a run of a
new unit's flat that lies contiguous in one saved unit's flat. Without that list (formats 1 and
2) the units must be the same.

What a state's segment is read from depends on what the saved unit has (plan.unit_state_kinds):
a unit of frozen parameters only was saved without moments (they load as zeros, which is
exact: unit_steps refuses to unfreeze a parameter whose saved unit has stepped) and, where it
kept no masters, with its compute-dtype weights, which then stand for the masters.
"""
from __future__ import annotations

import bisect
import dataclasses
import re
from dataclasses import dataclass

import torch

from ..ops.tiled_linear import LinearTile
from ..optim.compact import random_bits
from ..placement.plan import StateKind
from ..placement.units import ParamSpec
from ..tiers.moments import (FIRST_MOMENT, INT8, PACKED, QBLOCK, QBLOCK_BYTES, SECOND_MOMENT,
                             CodeMap, stored_numel)
from .format import CheckpointError, Reader


@dataclass(frozen=True)
class Segment:
    at: int
    """First element in the new unit's flat."""
    count: int
    unit: int
    """The saved unit it comes from."""
    start: int
    """First element in the saved unit's flat."""


def saved_params(unit: dict) -> list[tuple[str, int]]:
    return [(name, numel) for name, numel in unit["params"]]


def unchanged(runs: list[list[Segment]], flats) -> bool:
    """Whether every unit is the saved unit of its index, whole."""
    return all(unit_runs == [Segment(0, flat.numel, index, 0)]
               for index, (unit_runs, flat) in enumerate(zip(runs, flats)))


# [Note: tiles in checkpoints]
# A TiledLinear's tiles are parameters named ``<layer>.tiles.<k>.weight`` (and ``.bias``), each
# a block of the layer's weight; the cut into tiles is the policy's (tiling.max_unit_bytes, in
# compute-dtype bytes), so a load under another limit, another compute dtype or no tiling
# finds other names and other blocks. Parameters are therefore mapped by where their elements
# lie in the model's state-dict tensors (``<layer>.weight``, row-major), not by name.

_TILE = re.compile(r"^(?P<layer>(?:.*\.)?)tiles\.(?P<k>\d+)\.(?P<leaf>weight|bias)$")


@dataclass(frozen=True)
class _Grid:
    """A tiled layer's cut: the row counts of its rows of tiles, the column counts of its
    columns of tiles; tile k is (k // columns, k % columns), as TiledLinear orders them."""

    rows: tuple[int, ...]
    cols: tuple[int, ...]

    def runs(self, k: int, leaf: str) -> list[tuple[int, int]]:
        """(first element in the layer's tensor, elements) of tile ``k``'s ``leaf``, in the
        tile's own element order."""
        i, j = divmod(k, len(self.cols))
        first_row, first_col = sum(self.rows[:i]), sum(self.cols[:j])
        if leaf == "bias":
            return [(first_row, self.rows[i])]
        width = sum(self.cols)
        if self.cols[j] == width:  # whole rows: one run
            return [(first_row * width, self.rows[i] * width)]
        return [((first_row + row) * width + first_col, self.cols[j])
                for row in range(self.rows[i])]


def tile_grids(flats) -> dict[str, dict[str, list[int]]]:
    """Per tiled layer (its prefix), its cut as the manifest records it: a load under another
    cut then reads the saved one (sizes alone do not tell it: _unrecorded_grids)."""
    return {layer: {"rows": list(grid.rows), "cols": list(grid.cols)}
            for layer, grid in _model_grids(flats).items()}


def _model_grids(flats) -> dict[str, _Grid]:
    """Per tiled layer of the engine (its prefix), its cut, from its tiles' shapes and their
    layer's input size (each tile keeps it for its initialization)."""
    tiles: dict[str, dict[int, ParamSpec]] = {}
    for flat in flats:
        for param in flat.spec.params:
            match = _TILE.match(param.names[0])
            if match and match["leaf"] == "weight" and isinstance(param.holders[0][0],
                                                                  LinearTile):
                tiles.setdefault(match["layer"], {})[int(match["k"])] = param
    grids = {}
    for layer, by_index in tiles.items():
        shapes = [by_index[k].shape for k in range(len(by_index))]
        layer_module = by_index[0].holders[0][0]
        assert isinstance(layer_module, LinearTile)
        width = layer_module.fan_in
        columns = 0
        while columns < len(shapes) and sum(shape[1] for shape in shapes[:columns]) < width:
            columns += 1
        grids[layer] = _Grid(tuple(shape[0] for shape in shapes[::columns]),
                             tuple(shape[1] for shape in shapes[:columns]))
    return grids


def _unrecorded_grids(saved: dict[str, int], model: dict[str, ParamSpec],
                      grids: dict[str, _Grid]) -> dict[str, _Grid]:
    """The cuts of a checkpoint written before they were recorded: a tiled layer loads into
    the same tiles only (the engine's cut); into other tiles, or an untiled layer, it is
    refused, since tiles' sizes alone do not tell the cut (a bias-free layer's 2 x 2 tiles
    have the sizes of 4 x 1 ones)."""
    tiles: dict[str, dict[str, int]] = {}
    for name, numel in saved.items():
        if match := _TILE.match(name):
            tiles.setdefault(match["layer"], {})[name] = numel
    out = {}
    for layer, names in tiles.items():
        ours = {name: spec.numel for name, spec in model.items()
                if (match := _TILE.match(name)) and match["layer"] == layer}
        if layer in grids and names == ours:
            out[layer] = grids[layer]
        elif layer in grids or f"{layer}weight" in model:
            raise CheckpointError(
                f"the checkpoint does not record how layer {layer.rstrip('.') or '<root>'} "
                f"was cut into tiles (it was written before tiered recorded cuts); load it "
                f"with the tiling it was saved with")
    return out


@dataclass(frozen=True)
class _Piece:
    """Elements of a parameter that lie contiguous in a state-dict tensor."""

    tensor: str
    offset: int
    """First element in the tensor."""
    count: int


def _pieces(name: str, numel: int, grids: dict[str, _Grid]) -> list[_Piece]:
    """Where parameter ``name``'s elements lie, in its own order: a tile's in its layer's
    weight or bias under ``grids``, any other parameter's in the tensor of its name."""
    match = _TILE.match(name)
    if match and match["layer"] in grids:
        tensor = f"{match['layer']}{match['leaf']}"
        return [_Piece(tensor, at, count)
                for at, count in grids[match["layer"]].runs(int(match["k"]), match["leaf"])]
    return [_Piece(name, 0, numel)]


@dataclass(frozen=True)
class _Source:
    """Elements of a state-dict tensor that lie contiguous in a saved unit's flat."""

    offset: int
    """First element in the tensor."""
    count: int
    unit: int
    start: int
    """First element in the saved unit's flat."""


def _sources(saved_units: list[dict], grids: dict[str, _Grid],
             ours: dict[str, int]) -> dict[str, list[_Source]]:
    """Per state-dict tensor, where the saved units hold its elements, in the tensor's order;
    raises a CheckpointError for a saved parameter that is not the model's (``ours``: the
    model's tensors and their elements)."""
    out: dict[str, list[_Source]] = {}
    for index, unit in enumerate(saved_units):
        at = 0
        for name, numel in saved_params(unit):
            for piece in _pieces(name, numel, grids):
                out.setdefault(piece.tensor, []).append(
                    _Source(piece.offset, piece.count, index, at))
                at += piece.count
    for tensor, held in out.items():
        held.sort(key=lambda source: source.offset)
        if sum(source.count for source in held) != ours.get(tensor):
            _refuse_saved(tensor, sum(source.count for source in held), ours, saved_units,
                          grids)
    return out


def _refuse_saved(tensor: str, saved: int, ours: dict[str, int], saved_units: list[dict],
                  grids: dict[str, _Grid]) -> None:
    """Raise the CheckpointError for a saved tensor of ``saved`` elements that the model has
    not, or not of that size: by the name of its first saved parameter."""
    name, numel = next((name, numel) for unit in saved_units
                       for name, numel in saved_params(unit)
                       if _pieces(name, numel, grids)[0].tensor == tensor)
    where = ("not in" if tensor not in ours else f"{ours[tensor]} elements in" if name == tensor
             else f"of {tensor}, which has {saved} elements saved and {ours[tensor]} in")
    raise CheckpointError(f"the checkpoint is of another model: its parameter {name} "
                          f"({numel} elements) is {where} the model")


def _find(name: str, piece: _Piece, sources: dict[str, list[_Source]],
          starts: dict[str, list[int]]):
    """(elements, saved unit, first element in its flat) covering ``piece``, in order
    (``starts``: each tensor's sources' first elements); raises a CheckpointError where the
    checkpoint lacks some of them."""
    held = sources.get(piece.tensor, [])
    index = bisect.bisect_right(starts.get(piece.tensor, []), piece.offset) - 1
    at, end = piece.offset, piece.offset + piece.count
    while at < end:
        source = held[index] if 0 <= index < len(held) else None
        if source is None or not source.offset <= at < source.offset + source.count:
            raise CheckpointError(f"the checkpoint is of another model: it has no parameter "
                                  f"{name}")
        count = min(end, source.offset + source.count) - at
        yield count, source.unit, source.start + at - source.offset
        at, index = at + count, index + 1


def segments(flats, saved_units: list[dict],
             saved_tiles: dict[str, dict[str, list[int]]] | None = None) -> list[list[Segment]]:
    """Per unit of the engine, where its parameters lie in the saved units; raises a
    CheckpointError naming the first difference when they are not the same parameters.
    ``saved_tiles``: the saving engine's tile_grids (checkpoints written before they were
    recorded have none: see _unrecorded_grids)."""
    if not all("params" in unit for unit in saved_units):  # formats 1 and 2
        engine_units = [(f.spec.path, f.numel) for f in flats]
        saved_units_numel = [(u["path"], u["numel"]) for u in saved_units]
        if saved_units_numel == engine_units:
            return [[Segment(0, f.numel, i, 0)] for i, f in enumerate(flats)]
        differ = next((f"unit {i}: saved {s}, engine {o}" for i, (s, o) in
                       enumerate(zip(saved_units_numel, engine_units)) if s != o),
                      f"{len(saved_units_numel)} units saved, {len(engine_units)} in the engine")
        raise CheckpointError(
            f"the checkpoint is of another model: {differ} (path, elements); checkpoints "
            f"before format 3 load only into the units they were saved from (a partly frozen "
            f"model saved by them: set units.split_frozen: false)")
    model = {p.names[0]: p for f in flats for p in f.spec.params}
    grids = _model_grids(flats)
    pieces = {name: _pieces(name, spec.numel, grids) for name, spec in model.items()}
    ours: dict[str, int] = {}
    for name, held in pieces.items():
        for piece in held:
            ours[piece.tensor] = ours.get(piece.tensor, 0) + piece.count
    saved = {name: numel for unit in saved_units for name, numel in saved_params(unit)}
    if saved_tiles is None:
        saved_grids = _unrecorded_grids(saved, model, grids)
    else:
        saved_grids = {layer: _Grid(tuple(cut["rows"]), tuple(cut["cols"]))
                       for layer, cut in saved_tiles.items()}
    sources = _sources(saved_units, saved_grids, ours)
    starts = {tensor: [source.offset for source in held] for tensor, held in sources.items()}
    out = []
    for flat in flats:
        runs: list[Segment] = []
        offset = 0
        for param in flat.spec.params:
            name = param.names[0]
            if any(piece.tensor not in sources for piece in pieces[name]):
                raise CheckpointError(f"the checkpoint is of another model: it has no "
                                      f"parameter {name}")
            for piece in pieces[name]:
                for count, unit, start in _find(name, piece, sources, starts):
                    last = runs[-1] if runs else None
                    if last and last.unit == unit and last.start + last.count == start:
                        runs[-1] = Segment(last.at, last.count + count, unit, last.start)
                    else:
                        runs.append(Segment(offset, count, unit, start))
                    offset += count
        out.append(runs)
    return out


@dataclass(frozen=True)
class _Saved:
    """Whether saved unit ``unit`` has a state, by the names of a rank file's tensors."""

    entries: dict
    unit: int

    def __call__(self, state: str) -> bool:
        return f"unit{self.unit}.{state}" in self.entries


def _source(kind: StateKind, weights_alone: bool, pending: bool, has: _Saved) -> str | None:
    """The saved state a ``kind`` of a saved unit is read from, given ``has(state)``; None for
    zeros. ``weights_alone``: the new unit keeps weights and no masters (they are read from
    the saved masters where there are any). ``pending``: a delayed update had written the
    saved unit's next weights, so its current ones were saved beside the masters (else the
    masters are its current weights)."""
    wanted: tuple[str, ...]
    if kind is StateKind.PARAM and pending and not weights_alone:
        wanted = ("param",)
    elif kind in (StateKind.PARAM, StateKind.MASTER):
        wanted = ("master", "param")
    else:
        wanted = (kind.value,)
    found = next((name for name in wanted if has(name)), None)
    if found is None and kind in (StateKind.PARAM, StateKind.MASTER):
        raise CheckpointError(
            f"the checkpoint has no {' or '.join(wanted)} of saved unit {has.unit}")
    return found


def dtype_name(dtype: torch.dtype) -> str:
    """How a state's dtype is named to a user: a moment's format name (int8 for packed codes),
    else torch's."""
    return INT8.name if dtype is PACKED else str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Read:
    """Where the elements of one state of one unit's new shard come from."""

    dtype: torch.dtype
    """What the state is held in (PACKED: 8-bit moments, tiers/moments.py)."""
    numel: int
    """Parameters of the shard."""
    pieces: tuple[tuple[Reader, str, int, int, int], ...]
    """(file, tensor, first element of the shard, elements, first element in the tensor); the
    elements no piece covers (padding, moments of a unit saved without) are zeros."""
    code_map: CodeMap | None = None
    """A moment's 8-bit code map (to decode a packed one saved, or encode one held)."""

    def saved_dtypes(self) -> set[torch.dtype]:
        return {reader.entry(name).dtype for reader, name, *_ in self.pieces}

    def fetch(self) -> torch.Tensor:
        """The state as it is held: fp32 or bf16 values, or packed 8-bit codes (read as they
        are where the checkpoint holds this very shard packed, else encoded anew)."""
        if self.dtype is PACKED:
            return self._fetch_packed()
        out = torch.zeros(self.numel, dtype=self.dtype)
        for reader, name, at, count, start in self.pieces:
            target = out[at:at + count]
            saved = reader.entry(name).dtype
            if saved is self.dtype:
                reader.read(name, target, start=start)
            elif saved is PACKED:  # 8-bit moments saved, held in another dtype
                target.copy_(self._decoded(reader, name, start, count))
            else:  # weights saved in another dtype (another compute dtype, or fp32 masters)
                value = torch.empty(count, dtype=saved)
                reader.read(name, value, start=start)
                target.copy_(value)
        return out

    def _fetch_packed(self) -> torch.Tensor:
        out = torch.zeros(stored_numel(PACKED, self.numel), dtype=PACKED)
        whole = [(reader, name) for reader, name, at, count, start in self.pieces
                 if (at, count, start) == (0, self.numel, 0)
                 and reader.entry(name).shape == (stored_numel(PACKED, self.numel),)
                 and reader.entry(name).dtype is PACKED]
        if whole:  # this shard, saved packed: its bytes
            reader, name = whole[0]
            reader.read(name, out)
            return out
        values = dataclasses.replace(self, dtype=torch.float32).fetch()
        # Rounded as every step rounds, with a stream of its own (key 0, no step has it).
        rounding = random_bits(torch.arange(self.numel), 0) >> 24
        assert self.code_map is not None  # a packed moment's read has its code map
        INT8.encode_into(out, values, self.code_map, rounding)
        return out

    def _decoded(self, reader: Reader, name: str, start: int, count: int) -> torch.Tensor:
        """Elements [start, start + count) of a saved packed moment, as fp32."""
        first, stop = start // QBLOCK, -(-(start + count) // QBLOCK)
        codes = torch.empty((stop - first) * QBLOCK_BYTES, dtype=PACKED)
        reader.read(name, codes, start=first * QBLOCK_BYTES)
        assert self.code_map is not None
        values = INT8.decode(codes, (stop - first) * QBLOCK, self.code_map)
        return values[start - first * QBLOCK:start - first * QBLOCK + count]


def _saved_shape_ok(entry, size: int, source: str) -> bool:
    """Whether a saved state has the shape and dtype its kind may have: weights and masters
    any float (another compute dtype; bf16 masters), moments fp32, bf16 or packed."""
    if entry.dtype is PACKED:
        return source in ("exp_avg", "exp_avg_sq") and entry.shape == (stored_numel(PACKED, size),)
    if entry.shape != (size,):
        return False
    if source in ("param", "master"):
        return entry.dtype.is_floating_point
    return entry.dtype in (torch.float32, torch.bfloat16)


def plan_read(readers: dict[str, Reader], rank_file, saved_units: list[dict],
              runs: list[Segment], kind: StateKind, weights_alone: bool, shard: tuple[int, int],
              dtype: torch.dtype, written: set[int]) -> Read:
    """Elements ``[start, end)`` of a new unit's flat state ``kind`` (its ``runs``), every
    entry checked first: rank k saved elements ``[k*S, (k+1)*S)`` of each saved flat.
    ``written``: the saved units whose next weights a pending delayed update had written."""
    entries = next(iter(readers.values())).entries  # every rank saved the same names
    start, end = shard
    pieces = []
    for run in runs:
        first, stop = max(start, run.at), min(end, run.at + run.count)
        if first >= stop:
            continue
        saved = saved_units[run.unit]
        source = _source(kind, weights_alone, run.unit in written, _Saved(entries, run.unit))
        if source is None:
            continue
        name, size = f"unit{run.unit}.{source}", saved["shard_numel"]
        position = run.start + first - run.at
        while first < stop:
            rank = position // size
            reader = readers[rank_file(rank)]
            entry = reader.entry(name)
            if not _saved_shape_ok(entry, size, source):
                raise CheckpointError(
                    f"{reader.path}: {name!r} is {entry.dtype} {entry.shape}, expected "
                    f"{'a float' if source in ('param', 'master') else 'fp32, bf16 or int8'} "
                    f"of {size} elements")
            count = min(stop - first, (rank + 1) * size - position)
            pieces.append((reader, name, first - start, count, position - rank * size))
            first, position = first + count, position + count
    code_map = {StateKind.EXP_AVG: FIRST_MOMENT, StateKind.EXP_AVG_SQ: SECOND_MOMENT}.get(kind)
    return Read(dtype, end - start, tuple(pieces), code_map)


def _origins(flat, unit_runs: list[Segment],
             saved_units: list[dict]) -> list[set[tuple[int, str]]]:
    """Per parameter of a new unit, the (saved unit, saved parameter) its elements come from:
    by its name before format 3 (the units are the saved ones), else found through
    ``unit_runs`` (a tile of another cut comes from several saved tiles)."""
    if not all("params" in unit for unit in saved_units):
        return [{(unit_runs[0].unit, p.names[0])} for p in flat.spec.params]
    out, offset = [], 0
    for param in flat.spec.params:
        found = set()
        for run in unit_runs:
            first, stop = max(offset, run.at), min(offset + param.numel, run.at + run.count)
            if first < stop:
                found |= _saved_names(saved_units[run.unit], run.unit,
                                      run.start + first - run.at, run.start + stop - run.at)
        out.append(found)
        offset += param.numel
    return out


def _saved_names(unit: dict, index: int, first: int, stop: int) -> set[tuple[int, str]]:
    """The parameters of saved unit ``index`` with elements in ``[first, stop)`` of its flat."""
    found, offset = set(), 0
    for name, numel in saved_params(unit):
        if offset < stop and first < offset + numel:
            found.add((index, name))
        offset += numel
    return found


def unit_steps(flats, runs: list[list[Segment]], saved_units: list[dict],
               saved_steps: list[float], saved_frozen: set[str]) -> list[float]:
    """Each new unit's AdamW step count, from the saved units its parameters come from.

    tiered counts steps per unit, PyTorch per parameter, so a unit's parameters must share one
    count: those trainable when saved take their saved unit's; a parameter frozen when saved
    and trainable now starts at 1 in PyTorch, which is exact only in a unit whose count is 0. A
    frozen unit takes the largest count among its sources, so unfreezing it later is refused
    if any of them stepped."""
    out = []
    for flat, unit_runs in zip(flats, runs):
        origins = _origins(flat, unit_runs, saved_units)
        trained = {saved_steps[unit] for p, found in zip(flat.spec.params, origins)
                   if p.trainable for unit, name in found if name not in saved_frozen}
        unfrozen = [p.names[0] for p, found in zip(flat.spec.params, origins)
                    if p.trainable and any(name in saved_frozen for _, name in found)]
        if len(trained) > 1:
            raise CheckpointError(
                f"the parameters of unit {flat.name} come from units that took different "
                f"numbers of AdamW steps ({', '.join(str(int(s)) for s in sorted(trained))}); "
                f"tiered counts steps per unit: resume with the units cut as when saved")
        if not flat.has_trainable:
            out.append(max((saved_steps[unit] for found in origins for unit, _ in found),
                           default=0.0))
            continue
        steps = trained.pop() if trained else 0.0
        # Their own saved unit may have stepped too (frozen after training, or beside
        # trainable parameters in an unsplit unit): their moments then did not start at 1.
        before = max((saved_steps[unit] for p, found in zip(flat.spec.params, origins)
                      if p.names[0] in unfrozen for unit, _ in found), default=0.0)
        if unfrozen and max(steps, before) > 0:
            raise CheckpointError(
                f"{', '.join(unfrozen[:3])}{' ...' if len(unfrozen) > 3 else ''} of unit "
                f"{flat.name} were frozen when the checkpoint was saved and are trainable now, "
                f"but the unit has taken {int(max(steps, before))} steps: tiered counts AdamW "
                f"steps per unit, so their moments would start at its count where PyTorch "
                f"starts at 1. Unfreeze only units with no step taken (all frozen until now), "
                f"or freeze as when saved")
        out.append(steps)
    return out
