"""Quantized records in checkpoints: a unit that keeps its frozen weights as a record of bytes
(``params.frozen_dtype`` int8 or nf4; [Note: quantized frozen weights] in tiers/quantized.py).

[Note: records in checkpoints]
Each rank saves its shard of the record's bytes as they are (``unit<i>.record``, uint8), and
the manifest's unit says what they are (``record``: the format, the compute dtype its other
tensors are in, the record's bytes before padding and each rank's shard). A load stores the
bytes as they were: nothing is quantized again, so a resume computes with the very weights the
saved run did, bit for bit. The record is cut among ranks by bytes, evenly, and its layout does
not depend on the world size (only its padding does), so a load under another world size cuts
the saved bytes anew: rank r of W takes bytes [r*S, (r+1)*S) of the whole record, read from the
saved shards that hold them, the padding zeros.

A record loads only into a unit of the same parameters kept in the same format and compute
dtype: its bytes are not elements, and the original weights they were quantized from are gone.
So a load whose ``params.frozen_dtype`` differs from the checkpoint's is refused by name (both
values), and so is a load that would cut a quantized unit otherwise, or take its weights into
a unit that is not quantized alike (unfrozen, or under another compute dtype).
"""
from __future__ import annotations

import torch

from .format import CheckpointError, Reader
from .layout import Read, Segment

ENTRY = "record"
"""A quantized unit's state in a rank file: ``unit<i>.record``."""


def manifest_record(flat) -> dict | None:
    """What the manifest says of a unit's record, if it keeps one."""
    record = flat.record
    if record is None:
        return None
    return {"format": record.format.name, "dtype": str(record.dtype).removeprefix("torch."),
            "bytes": record.data_bytes, "shard_bytes": record.shard_bytes}


def check_frozen_dtype(manifest: dict, policy) -> None:
    """A checkpoint's quantized records load only under its ``params.frozen_dtype``."""
    params = manifest["policy"].get("params", {})  # none before the policy had params
    saved = params.get("frozen_dtype", "compute") if isinstance(params, dict) else params
    ours = policy.params.frozen_dtype.value
    if saved != ours:
        raise CheckpointError(
            f"the checkpoint was saved with params.frozen_dtype {saved!r}, this engine's is "
            f"{ours!r}: a checkpoint keeps quantized frozen weights as the bytes they were "
            f"saved as, never quantized again (see [Note: records in checkpoints]); load it "
            f"with params.frozen_dtype {saved!r}")


def check_records(flats, runs: list[list[Segment]], saved_units: list[dict]) -> None:
    """Every quantized unit of the engine is one saved unit whole, quantized alike; no unit
    that is not quantized takes elements of one that was."""
    for flat, unit_runs in zip(flats, runs):
        ours = manifest_record(flat)
        if ours is None:
            quantized = [run.unit for run in unit_runs if "record" in saved_units[run.unit]]
            if quantized:
                raise CheckpointError(
                    f"unit {flat.name} keeps its weights in the compute dtype, but the "
                    f"checkpoint holds some of them quantized (saved unit {quantized[0]}): a "
                    f"record's bytes are not elements; load with the units, frozen parameters "
                    f"and params.frozen_dtype it was saved with")
            continue
        if len(unit_runs) != 1 or unit_runs[0] != Segment(0, flat.numel, unit_runs[0].unit, 0):
            raise CheckpointError(
                f"unit {flat.name} keeps its frozen weights quantized, but the checkpoint "
                f"holds them in other units' parts: a record loads only into the unit it was "
                f"saved from; load with the units cut as when saved")
        saved = saved_units[unit_runs[0].unit].get("record")
        mine = {key: ours[key] for key in ("format", "dtype", "bytes")}
        theirs = {key: (saved or {}).get(key) for key in mine}
        if mine != theirs:
            raise CheckpointError(
                f"unit {flat.name} keeps its frozen weights as {_said(mine)}, the checkpoint "
                f"as {_said(theirs) if saved else 'elements, not quantized'}: a record "
                f"loads only into a unit quantized alike (the same format and compute dtype)")


def _said(record: dict) -> str:
    return f"{record['format']} with {record['dtype']} ({record['bytes']} bytes)"


def plan_read(readers: dict[str, Reader], rank_file, saved_units: list[dict], flat,
              unit_runs: list[Segment]) -> Read:
    """This rank's shard of the unit's record from the saved shards that hold its bytes
    (the unit checked by :func:`check_records`), each entry checked first; the padding past
    the record's bytes is zeros."""
    record = flat.record
    index = unit_runs[0].unit
    name, size = f"unit{index}.{ENTRY}", saved_units[index]["record"]["shard_bytes"]
    mine = flat.rank * record.shard_bytes
    first, stop = mine, min(mine + record.shard_bytes, record.data_bytes)
    pieces = []
    while first < stop:
        rank = first // size
        reader = readers[rank_file(rank)]
        entry = reader.entry(name) if name in reader.entries else None
        if entry is None or entry.shape != (size,) or entry.dtype is not torch.uint8:
            found = "missing" if entry is None else f"{entry.dtype} {list(entry.shape)}"
            raise CheckpointError(f"{reader.path}: {name!r} is {found}, expected the {size} "
                                  f"bytes (uint8) of a rank's shard of the unit's record")
        count = min(stop - first, (rank + 1) * size - first)
        pieces.append((reader, name, first - mine, count, first - rank * size))
        first += count
    return RecordRead(torch.uint8, record.shard_bytes, tuple(pieces))


class RecordRead(Read):
    """A record's bytes: read as they are (a Read of uint8 would take them for packed 8-bit
    moments' codes)."""

    def fetch(self) -> torch.Tensor:
        out = torch.zeros(self.numel, dtype=torch.uint8)
        for reader, name, at, count, start in self.pieces:
            reader.read(name, out[at:at + count], start=start)
        return out
