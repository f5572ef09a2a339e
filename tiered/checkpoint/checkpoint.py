"""Checkpoints: every tier's state saved per rank in parallel, atomically, and loaded back into
any world size and any policy.

Layout of ``<dir>``::

    <tag>/manifest.json            written last: what the engine was, and each file's size and
                                   sha256
    <tag>/rank00000.safetensors    one per rank: for each unit, its shard of the fp32 master
                                   weights and both Adam moments (and, with a delayed update
                                   pending, its current compute-dtype weights); its RNG states
    latest                         the newest complete tag

[Note: atomic checkpoints]
A save writes into ``.<tag>.tmp``: each rank streams its file from wherever its shards live
(NVMe extents piece by piece through a staging buffer, never the whole model) and fsyncs it;
rank 0 then writes the manifest, fsyncs it and the folder, renames the folder to ``<tag>`` and
only then replaces ``latest`` (written aside, fsynced, renamed). A crash or a full disk at any
point leaves the previous checkpoint and ``latest`` as they were; a folder without a manifest
is never loaded. A load checks the manifest against the engine and every file's size and sha256
before it changes anything, and reads only JSON and raw tensor bytes (no pickle).

Compute-dtype weights are the master weights cast, so they are recomputed on load, except under
a pending delayed update: then the weights the next forward uses are the previous step's, and
they are saved too.
"""
from __future__ import annotations

import json
import os
import shutil

import torch

from .. import __version__
from ..errors import TieredError
from ..plan import OPTIMIZER_STATES, StateKind, state_kinds
from .format import CheckpointError, Entry, Reader, Writer, file_digest

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def save(engine, directory: str, tag: str | None) -> str:
    """Write a checkpoint of ``engine`` under ``directory`` (see the module note); returns its
    folder. Every rank must call it."""
    runtime, group = engine.runtime, engine.runtime.group
    state = engine.optimizer.checkpoint_state()
    tag = tag or f"step{state['steps_called']:08d}"
    if not tag or "/" in tag or tag.startswith(".") or tag == LATEST:
        raise CheckpointError(f"checkpoint tag {tag!r}: use letters, digits, '-' or '_'")
    staging = os.path.join(directory, f".{tag}.tmp")
    if group.rank == 0:
        os.makedirs(directory, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)  # left by a save that crashed
        os.mkdir(staging)
    group.barrier()
    pending = set(state["pending"]["written"]) if state["pending"] else set()
    failure = None
    try:
        size, digest = _write_rank(engine, os.path.join(staging, rank_file(group.rank)), pending)
    except (TieredError, OSError) as error:  # every rank must still reach the gather below
        failure, size, digest = error, -1, "0" * 64
    sizes, digests = _gather_files(group, size, digest)
    if any(s < 0 for s in sizes):
        if group.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        group.barrier()
        raise failure or CheckpointError(f"another rank failed to write its part of {tag}")
    folder = os.path.join(directory, tag)
    if group.rank == 0:
        manifest = {
            "format": FORMAT_VERSION, "tiered": __version__, "torch": torch.__version__,
            "world_size": group.world_size, "policy": engine.policy.to_dict(),
            "units": [{"path": f.spec.path, "numel": f.numel, "padded_numel": f.padded_numel,
                       "shard_numel": f.shard_numel} for f in runtime.flats],
            "optimizer": state,
            "files": {rank_file(r): {"size": sizes[r], "sha256": digests[r]}
                      for r in range(group.world_size)},
        }
        _commit(staging, folder, manifest, directory, tag)
    group.barrier()
    return folder


def _write_rank(engine, path: str, pending: set[int]) -> tuple[int, str]:
    manager, flats = engine.manager, engine.runtime.flats
    compute = engine.policy.compute_dtype.torch_dtype
    entries, sources = [], []
    for flat in flats:
        unit = flat.spec.index
        for kind in OPTIMIZER_STATES:
            entries.append(Entry(f"unit{unit}.{kind.value}", torch.float32, (flat.shard_numel,)))
            sources.append((unit, kind))
        if unit in pending:
            entries.append(Entry(f"unit{unit}.param", compute, (flat.shard_numel,)))
            sources.append((unit, StateKind.PARAM))
    rng = _rng_states(engine.device)
    entries += [Entry(name, torch.uint8, tuple(value.shape)) for name, value in rng.items()]
    writer = Writer(path, entries)
    try:
        for unit, kind in sources:
            for _, piece in manager.pieces(unit, kind):
                writer.write(piece)
        for value in rng.values():
            writer.write(value)
    except BaseException:
        writer.abort()
        raise
    return writer.size, writer.close()


def _rng_states(device: torch.device) -> dict[str, torch.Tensor]:
    states = {"rng.cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["rng.cuda"] = torch.cuda.get_rng_state(device)
    return states


def _gather_files(group, size: int, digest: str) -> tuple[list[int], list[str]]:
    """Every rank's (file size, sha256), on every rank, without pickling."""
    mine = torch.tensor([size] + list(bytes.fromhex(digest)), dtype=torch.int64,
                        device=group.device)
    everyone = torch.empty(mine.numel() * group.world_size, dtype=torch.int64,
                           device=group.device)
    group.all_gather(everyone, mine)
    rows = everyone.view(group.world_size, -1).cpu().tolist()
    return [row[0] for row in rows], [bytes(row[1:]).hex() for row in rows]


def _commit(staging: str, folder: str, manifest: dict, directory: str, tag: str) -> None:
    manifest_path = os.path.join(staging, MANIFEST)
    with open(manifest_path, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(staging)
    if os.path.exists(folder):  # saving a tag again: the new one replaces it whole
        shutil.rmtree(folder)
    os.rename(staging, folder)
    _fsync_dir(directory)
    latest_tmp = os.path.join(directory, f".{LATEST}.tmp")
    with open(latest_tmp, "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.rename(latest_tmp, os.path.join(directory, LATEST))
    _fsync_dir(directory)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load(engine, directory: str, tag: str | None) -> str:
    """Load the checkpoint ``tag`` (default: ``latest``) of ``directory`` into ``engine``, which
    may have another world size or policy than the one that saved it; returns the tag."""
    tag = tag or _latest(directory)
    folder = os.path.join(directory, tag)
    manifest = _read_manifest(folder)
    _check_units(manifest, engine)
    group = engine.runtime.group
    same_layout = manifest["world_size"] == group.world_size
    needed = ([rank_file(group.rank)] if same_layout else list(manifest["files"]))
    readers = _open_verified(folder, manifest, needed)
    try:
        _load_states(engine, manifest, readers, same_layout)
    finally:
        for reader in readers.values():
            reader.close()
    return tag


def _latest(directory: str) -> str:
    try:
        with open(os.path.join(directory, LATEST)) as f:
            return f.read().strip()
    except OSError:
        raise CheckpointError(f"no checkpoint in {directory} (no '{LATEST}' file)") from None


def _read_manifest(folder: str) -> dict:
    path = os.path.join(folder, MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{folder} is not a complete checkpoint (no {MANIFEST})") from None
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot be read: {e}") from None
    if manifest.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format {manifest.get('format')!r}; this tiered reads "
                              f"format {FORMAT_VERSION}")
    return manifest


def _check_units(manifest: dict, engine) -> None:
    saved = [(u["path"], u["numel"]) for u in manifest["units"]]
    ours = [(f.spec.path, f.numel) for f in engine.runtime.flats]
    if saved != ours:
        differ = next((f"unit {i}: saved {s}, engine {o}" for i, (s, o) in
                       enumerate(zip(saved, ours)) if s != o),
                      f"{len(saved)} units saved, {len(ours)} in the engine")
        raise CheckpointError(f"the checkpoint is of another model: {differ} (path, elements)")


def _open_verified(folder: str, manifest: dict, names: list[str]) -> dict[str, Reader]:
    readers = {}
    for name in names:
        path = os.path.join(folder, name)
        expected = manifest["files"].get(name)
        if expected is None or not os.path.exists(path):
            raise CheckpointError(f"{path}: missing from the checkpoint")
        size, digest = file_digest(path)
        if size != expected["size"]:
            raise CheckpointError(f"{path}: {size} bytes, the manifest says {expected['size']} "
                                  f"(truncated?)")
        if digest != expected["sha256"]:
            raise CheckpointError(f"{path}: sha256 {digest} differs from the manifest's "
                                  f"{expected['sha256']} (corrupted)")
        readers[name] = Reader(path)
    return readers


def _load_states(engine, manifest: dict, readers: dict[str, Reader], same_layout: bool) -> None:
    manager, group, flats = engine.manager, engine.runtime.group, engine.runtime.flats
    state = manifest["optimizer"]
    pending = set(state["pending"]["written"]) if state["pending"] and same_layout else set()
    delayed = engine.policy.optimizer.delayed_update.enabled
    for flat, saved in zip(flats, manifest["units"]):
        unit = flat.spec.index
        start, end = flat.shard_range
        masters = None
        for kind in OPTIMIZER_STATES:
            values = _read_range(readers, saved, f"unit{unit}.{kind.value}", start, end,
                                 torch.float32)
            manager.store(unit, kind, values)
            if kind is StateKind.MASTER:
                masters = values
        if unit in pending and delayed:
            current = _read_range(readers, saved, f"unit{unit}.param", start, end,
                                  engine.policy.compute_dtype.torch_dtype)
            manager.store(unit, StateKind.PARAM, current)
            manager.store(unit, StateKind.PARAM_NEXT, masters)
        else:
            for kind in state_kinds(engine.policy):
                if kind in (StateKind.PARAM, StateKind.PARAM_NEXT):
                    manager.store(unit, kind, masters)
    if not (delayed and pending):
        state = dict(state, pending=None)  # its update is applied: the weights are its master's
    engine.runtime.grads.zero_grad(set_to_none=True)
    engine.optimizer.restore_state(state)
    if same_layout:
        reader = readers[rank_file(group.rank)]
        torch.set_rng_state(_read_whole(reader, "rng.cpu"))
        if engine.device.type == "cuda" and "rng.cuda" in reader.entries:
            torch.cuda.set_rng_state(_read_whole(reader, "rng.cuda"), engine.device)


def _read_range(readers: dict[str, Reader], saved: dict, name: str, start: int, end: int,
                dtype: torch.dtype) -> torch.Tensor:
    """Elements ``[start, end)`` of a unit's padded flat state, from the saved rank files (rank
    k saved elements ``[k*S, (k+1)*S)`` of the same flat); zeros past the unit's real ones."""
    out = torch.zeros(end - start, dtype=dtype)
    shard = saved["shard_numel"]
    stop = min(end, saved["numel"])
    position = start
    while position < stop:
        rank = position // shard
        reader = readers[rank_file(rank)]
        entry = reader.entry(name)
        if entry.dtype is not dtype or entry.shape != (shard,):
            raise CheckpointError(f"{reader.path}: {name!r} is {entry.dtype} {entry.shape}, "
                                  f"expected {dtype} ({shard},)")
        offset = position - rank * shard
        count = min(stop, (rank + 1) * shard) - position
        reader.read(name, out[position - start:position - start + count], start=offset)
        position += count
    return out


def _read_whole(reader: Reader, name: str) -> torch.Tensor:
    entry = reader.entry(name)
    out = torch.empty(entry.shape, dtype=entry.dtype)
    reader.read(name, out)
    return out
