"""Parameter groups inside units: which part of each rank's shard is stepped with which group's
hyperparameters.

A unit's flat parameter lays its parameters end to end (flat.py), so a group is a set of
ranges in it: a block's biases and norm weights sit between its matrices. The layout is not
reordered by group, so checkpoints and exports do not depend on the groups; a shard is stepped
range by range instead, one kernel call per run of parameters of one group (about ten per
transformer block when norms and biases have a group of their own, one without groups).
"""
from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase

from ..core.errors import PolicyError
from ..policy.config import ParamGroupPolicy

FROZEN = None
"""The group of frozen parameters (``requires_grad=False``): never stepped. Not a number, so
that code forgetting it fails instead of indexing the last group's values."""


@dataclass(frozen=True)
class GroupRange:
    """Elements ``[start, stop)`` of a shard, stepped with ``param_groups[group]`` (not at all
    when ``group`` is FROZEN)."""

    start: int
    stop: int
    group: int | None


def group_of(names: tuple[str, ...], groups: tuple[ParamGroupPolicy, ...]) -> int:
    """The param group of a parameter with these names: the first policy group with a pattern
    matching one of them (1-based, as in ``optimizer.param_groups``), else 0."""
    for index, group in enumerate(groups, start=1):
        if any(fnmatchcase(name, pattern) for name in names for pattern in group.match):
            return index
    return 0


def shard_ranges(flats, groups: tuple[ParamGroupPolicy, ...]) -> list[tuple[GroupRange, ...]]:
    """Per unit, this rank's shard cut into runs of one param group (or FROZEN), in shard
    coordinates and covering all of it (the padding goes with the last parameter's group: its
    values and gradients are zeros, which AdamW leaves at zero).

    Raises a PolicyError naming a group that matches no parameter: a misspelt pattern would
    otherwise leave its parameters stepped with the wrong values, silently."""
    matched = set()
    out = []
    for flat in flats:
        runs: list[tuple[int, int, int | None]] = []  # (start, stop, group) in the padded flat
        shard_start, shard_stop = flat.shard_range
        offset = 0
        for index, param in enumerate(flat.spec.params):
            matching = group_of(param.names, groups)
            matched.add(matching)  # a group of frozen parameters only is still a right pattern
            group = matching if param.trainable else FROZEN
            last = index == len(flat.spec.params) - 1
            stop = flat.padded_numel if last else offset + param.numel
            start, stop = max(offset, shard_start), min(stop, shard_stop)
            offset += param.numel
            if start >= stop:
                continue
            if runs and runs[-1][2] == group:
                start = runs.pop()[0]
            runs.append((start, stop, group))
        out.append(tuple(GroupRange(start - shard_start, stop - shard_start, group)
                         for start, stop, group in runs))
    unmatched = [i for i in range(1, len(groups) + 1) if i not in matched]
    if unmatched:
        index = unmatched[0] - 1
        names = [name for flat in flats for param in flat.spec.params for name in param.names]
        raise PolicyError(
            f"optimizer.param_groups[{index}] (match {list(groups[index].match)}) matches no "
            f"parameter of the model, or only ones an earlier group took; its parameter names "
            f"look like: {', '.join(names[:6])}")
    return out
