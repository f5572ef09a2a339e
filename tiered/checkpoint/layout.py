"""Where a load finds each element of the engine's shards in a checkpoint.

A saved unit is a padded flat of its parameters, cut into one shard per rank that saved it
(flat.py). The engine loading it may cut the model differently: other ranks (other shards of the
same units), or other units: ``units.split_frozen`` makes two units of a partly frozen one, so a
resume that freezes or unfreezes parameters moves them between units. Since format 3 the
manifest lists each unit's parameters, and a load maps every parameter by name: a *segment* is a
run of a new unit's flat that lies contiguous in one saved unit's flat. Without that list (formats
1 and 2) the units must be the same.

What a state's segment is read from depends on what the saved unit has (plan.unit_state_kinds):
a unit of frozen parameters only was saved without moments (they load as zeros, which is
exact: unit_steps refuses to unfreeze a parameter whose saved unit has stepped) and, where it
kept no masters, with its compute-dtype weights, which then stand for the masters.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..plan import StateKind
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


def _places(saved_units: list[dict]) -> dict[str, tuple[int, int, int]]:
    """Parameter name -> (saved unit, first element in its flat, elements), where the manifest
    lists them (format 3)."""
    places = {}
    for index, unit in enumerate(saved_units):
        offset = 0
        for name, numel in saved_params(unit) if "params" in unit else []:
            places[name] = (index, offset, numel)
            offset += numel
    return places


def unchanged(runs: list[list[Segment]], flats) -> bool:
    """Whether every unit is the saved unit of its index, whole."""
    return all(unit_runs == [Segment(0, flat.numel, index, 0)]
               for index, (unit_runs, flat) in enumerate(zip(runs, flats)))


def segments(flats, saved_units: list[dict]) -> list[list[Segment]]:
    """Per unit of the engine, where its parameters lie in the saved units; raises a
    CheckpointError naming the first difference when they are not the same parameters."""
    if not all("params" in unit for unit in saved_units):  # formats 1 and 2
        ours = [(f.spec.path, f.numel) for f in flats]
        saved = [(u["path"], u["numel"]) for u in saved_units]
        if saved == ours:
            return [[Segment(0, f.numel, i, 0)] for i, f in enumerate(flats)]
        differ = next((f"unit {i}: saved {s}, engine {o}" for i, (s, o) in
                       enumerate(zip(saved, ours)) if s != o),
                      f"{len(saved)} units saved, {len(ours)} in the engine")
        raise CheckpointError(
            f"the checkpoint is of another model: {differ} (path, elements); checkpoints "
            f"before format 3 load only into the units they were saved from (a partly frozen "
            f"model saved by them: set units.split_frozen: false)")
    where = _places(saved_units)
    model = {p.names[0]: p.numel for f in flats for p in f.spec.params}
    for name, (_, _, numel) in where.items():
        if model.get(name) != numel:
            raise CheckpointError(
                f"the checkpoint is of another model: its parameter {name} ({numel} elements) "
                f"is {'not in' if name not in model else f'{model[name]} elements in'} the "
                f"model")
    out = []
    for flat in flats:
        runs: list[Segment] = []
        offset = 0
        for param in flat.spec.params:
            name = param.names[0]
            if name not in where:
                raise CheckpointError(f"the checkpoint is of another model: it has no "
                                      f"parameter {name}")
            unit, start, _ = where[name]
            last = runs[-1] if runs else None
            if last and last.unit == unit and last.start + last.count == start:
                runs[-1] = Segment(last.at, last.count + param.numel, unit, last.start)
            else:
                runs.append(Segment(offset, param.numel, unit, start))
            offset += param.numel
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


@dataclass(frozen=True)
class Read:
    """Where the elements of one state of one unit's new shard come from."""

    dtype: torch.dtype
    numel: int
    pieces: tuple[tuple[Reader, str, int, int, int], ...]
    """(file, tensor, first element of the shard, elements, first element in the tensor); the
    elements no piece covers (padding, moments of a unit saved without) are zeros."""

    def fetch(self) -> torch.Tensor:
        out = torch.zeros(self.numel, dtype=self.dtype)
        for reader, name, at, count, start in self.pieces:
            target = out[at:at + count]
            saved = reader.entry(name).dtype
            if saved is self.dtype:
                reader.read(name, target, start=start)
            else:  # weights saved in another dtype (another compute dtype, or fp32 masters)
                value = torch.empty(count, dtype=saved)
                reader.read(name, value, start=start)
                target.copy_(value)
        return out


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
            weights = source == "param"
            if entry.shape != (size,) or not (entry.dtype.is_floating_point if weights
                                              else entry.dtype is torch.float32):
                raise CheckpointError(
                    f"{reader.path}: {name!r} is {entry.dtype} {entry.shape}, expected "
                    f"{'a float' if weights else 'float32'} ({size},)")
            count = min(stop - first, (rank + 1) * size - position)
            pieces.append((reader, name, first - start, count, position - rank * size))
            first, position = first + count, position + count
    return Read(dtype, end - start, tuple(pieces))


def unit_steps(flats, runs: list[list[Segment]], saved_units: list[dict],
               saved_steps: list[float], saved_frozen: set[str]) -> list[float]:
    """Each new unit's AdamW step count, from the saved units its parameters come from.

    tiered counts steps per unit, PyTorch per parameter, so a unit's parameters must share one
    count: those trainable when saved take their saved unit's; a parameter frozen when saved
    and trainable now starts at 1 in PyTorch, which is exact only in a unit whose count is 0. A
    frozen unit takes the largest count among its sources, so unfreezing it later is refused
    if any of them stepped."""
    owner = {name: place[0] for name, place in _places(saved_units).items()}
    out = []
    for flat, unit_runs in zip(flats, runs):
        def source(param) -> int:
            return owner.get(param.names[0], unit_runs[0].unit)  # one run when unmapped

        trained = {saved_steps[source(p)] for p in flat.spec.params
                   if p.trainable and p.names[0] not in saved_frozen}
        unfrozen = [p.names[0] for p in flat.spec.params
                    if p.trainable and p.names[0] in saved_frozen]
        if len(trained) > 1:
            raise CheckpointError(
                f"the parameters of unit {flat.name} come from units that took different "
                f"numbers of AdamW steps ({', '.join(str(int(s)) for s in sorted(trained))}); "
                f"tiered counts steps per unit: resume with the units cut as when saved")
        if not flat.has_trainable:
            out.append(max((saved_steps[source(p)] for p in flat.spec.params), default=0.0))
            continue
        steps = trained.pop() if trained else 0.0
        # Their own saved unit may have stepped too (frozen after training, or beside
        # trainable parameters in an unsplit unit): their moments then did not start at 1.
        before = max((saved_steps[source(p)] for p in flat.spec.params
                      if p.names[0] in unfrozen), default=0.0)
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
