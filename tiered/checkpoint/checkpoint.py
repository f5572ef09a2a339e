"""Checkpoints: every tier's state saved per rank in parallel, atomically, and loaded back into
any world size, any policy with the same param groups and any cut of the model into units (see
:func:`load` for what else a load checks).

Layout of ``<dir>``::

    <tag>/manifest.json            written last: what the engine was, and each file's size and
                                   sha256
    <tag>/rank00000.safetensors    one per rank: for each unit, its shard of the fp32 master
                                   weights and both Adam moments (a frozen unit: its masters,
                                   or its compute-dtype weights where it keeps none, or its
                                   shard of a quantized record's bytes: [Note: records in
                                   checkpoints] in records.py; with a
                                   delayed update pending, also the current compute-dtype
                                   weights); its RNG states; the model's persistent buffers
                                   (``buffer.<name>``) and tensor extra states
                                   (``extra.<key>``) as this rank has them
    latest                         the newest complete tag

[Note: atomic checkpoints]
A save writes into ``.<tag>.tmp``: each rank streams its file from wherever its shards live
(NVMe extents piece by piece through a staging buffer, never the whole model) and fsyncs it;
rank 0 then writes the manifest, fsyncs it and the folder, renames the folder to ``<tag>`` and
only then replaces ``latest`` (written aside, fsynced, renamed). A crash or a full disk at any
point leaves the previous checkpoint and ``latest`` as they were (saving a tag again sets its
previous folder aside until ``latest`` is written); a folder without a manifest is never
loaded. A load checks the manifest against the engine and every file's size and sha256 before
it changes anything, and reads only JSON and raw tensor bytes (no pickle).

Compute-dtype weights are the master weights cast, so they are recomputed on load, except under
a pending delayed update (then the weights the next forward uses are the previous step's, and
they are saved too) and for a frozen unit without masters (its weights are all it has).
Buffers (BatchNorm's running stats) and modules' extra states are the model's state outside the
units: each rank saves its own, a load at the same world size restores each rank's and at
another rank 0's; an extra state that is not a tensor goes into the manifest as JSON (rank
0's). Gradients are not saved, so a save between a backward and its ``optimizer.step()`` is
refused (a load would resume without them). Saves
and loads agree across ranks: a failure on one raises on all (agreement.py), and a load checks
every file and entry it will read before it stores anything: the manifest's fields, their
types and ranges (manifest.py), each rank file's kind and size before its hash.

One job at a time writes into a folder: its first save or load there checks the folder
(folder.check_folder) and takes it, refusing one a live job holds and removing what dead jobs
staged ([Note: one job per checkpoint folder] in folder.py); the engine's close gives it back.
A load without ``tag`` takes the one ``latest`` names, or the newest intact checkpoint where
``latest`` is missing or empty ([Note: a load without 'latest'] in latest.py); a tag that is a
link out of the folder is refused ([Note: a tag that is a link] there). A save with
``keep_last`` removes the older checkpoints beyond that count once its own is complete
([Note: what keep_last removes] in retention.py).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import warnings

import torch

from ..core.version import __version__
from ..placement.plan import OPTIMIZER_STATES, StateKind
from . import layout, records
from .agreement import all_or_raise
from .folder import check_folder, claim, release_folders
from .format import CheckpointError, Entry, Reader, Writer, file_digest
from .latest import LATEST, MANIFEST, check_inside, check_tag, chosen_tag, complete_tags
from .manifest import FORMAT_VERSION, check_rank_file, intact_steps, rank_file, read_manifest
from .pretrained import (RNG_STATES, extra_states, persistent_buffers, rng_states,
                         set_rng_states, store_model_state)
from .retention import check_keep_last, remove_older

__all__ = ["save", "load", "release_folders"]  # release_folders: for engine.close

_log = logging.getLogger("tiered")

_STATE_NAMES = {StateKind.EXP_AVG: "the first Adam moment",
                StateKind.EXP_AVG_SQ: "the second Adam moment",
                StateKind.MASTER: "the master weights", StateKind.PARAM: "the master weights",
                StateKind.PARAM_NEXT: "the master weights"}


def save(engine, directory: str, tag: str | None, keep_last: int | None = None) -> str:
    """Write a checkpoint of ``engine`` under ``directory`` (see the module note), then where
    ``keep_last`` is a count remove the older ones beyond it (retention.py); returns its
    folder. Every rank must call it; a failure on any rank raises on every rank."""
    group = engine.runtime.group
    check_keep_last(keep_last)
    _refuse_held_gradients(engine)
    state = engine.optimizer.checkpoint_state()
    tag = tag or f"step{state['steps_called']:08d}"
    check_tag(tag)
    staging = os.path.join(directory, f".{tag}.tmp")
    _own_folder(engine, directory, create=True)  # before the try: a live owner's staging stays
    failure = None
    try:  # from the staging folder's creation on: a signal may come at any point of it
        if group.rank == 0:
            try:
                shutil.rmtree(staging, ignore_errors=True)  # left by a save that failed here
                os.mkdir(staging)
            except OSError as error:
                failure = CheckpointError(f"cannot create {staging}: {error.strerror}")
        all_or_raise(group, failure, f"rank 0 could not create {staging}")
        return _save_staged(engine, state, staging, directory, tag, keep_last)
    except BaseException:
        # Interrupted (SIGTERM's SystemExit, Ctrl-C's KeyboardInterrupt; torchrun signals
        # every rank) or failed part-way: what was staged is no checkpoint. Rank 0 alone
        # removes it, as rank 0 alone commits it (a no-op once _commit has renamed it).
        if group.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise


def _save_staged(engine, state: dict, staging: str, directory: str, tag: str,
                 keep_last: int | None) -> str:
    """Each rank writes its part into ``staging``; rank 0 commits it as ``directory/tag``,
    then removes what ``keep_last`` leaves out, before the agreement: every rank's save
    returns once the folder holds what it will."""
    runtime, group = engine.runtime, engine.runtime.group
    failure = None
    pending = set(state["pending"]["written"]) if state["pending"] else set()
    try:
        size, digest = _write_rank(engine, os.path.join(staging, rank_file(group.rank)), pending)
    except Exception as error:  # every rank must still reach the gather below
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
                       "shard_numel": f.shard_numel,
                       "params": [[p.names[0], p.numel] for p in f.spec.params],
                       **({"record": records.manifest_record(f)} if f.record else {})}
                      for f in runtime.flats],
            "frozen": [p.names[0] for f in runtime.flats for p in f.spec.params
                       if not p.trainable],
            "tiles": layout.tile_grids(runtime.flats),
            "extra_states": _json_extra_states(engine),
            "optimizer": state,
            "files": {rank_file(r): {"size": sizes[r], "sha256": digests[r]}
                      for r in range(group.world_size)},
        }
        try:
            _commit(staging, folder, manifest, directory, tag)
        except OSError as error:
            failure = CheckpointError(f"cannot complete {folder}: {error.strerror}")
        else:
            if keep_last is not None:
                remove_older(directory, tag, keep_last)
    all_or_raise(group, failure, f"rank 0 could not complete {folder}")
    return folder


def _own_folder(engine, directory: str, create: bool) -> None:
    """At every save and load, before anything is read or written: ``directory`` can hold
    checkpoints, and this job owns it (folder.claim, on rank 0; the same error on every
    rank)."""
    group = engine.runtime.group
    failure = None
    try:
        check_folder(directory)
        if group.rank == 0:
            claim(engine, directory, create, group.world_size)
    except CheckpointError as error:
        failure = error
    all_or_raise(group, failure)


def _refuse_held_gradients(engine) -> None:
    """Gradients are not saved and a load drops them (as DeepSpeed's): a save after a backward
    whose step has not been taken would resume without its gradients, and with
    ``accumulation_steps`` with units already stepped on arrival. Every rank runs the same
    loop, so every rank refuses alike."""
    runtime = engine.runtime
    if runtime.step_state.backwards > 0 and any(runtime.grads.has_grad):
        raise CheckpointError(
            f"save_checkpoint after {runtime.step_state.backwards} backward(s) whose gradients "
            f"wait for optimizer.step(): gradients are not saved; save after optimizer.step() "
            f"(or after zero_grad())")


def _json_extra_states(engine) -> dict[str, object]:
    """The extra states that are not tensors (those are in the rank files), as JSON: a value
    JSON cannot hold is left out with a warning, as save_pretrained leaves it out."""
    out = {}
    for key, value in extra_states(engine.module, engine.state_dict_keys).items():
        if isinstance(value, torch.Tensor):
            continue
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            warnings.warn(f"tiered: save_checkpoint leaves out {key} (a {type(value).__name__}, "
                          f"which JSON cannot hold)", stacklevel=4)
            continue
        out[key] = value
    return out


def _write_rank(engine, path: str, pending: set[int]) -> tuple[int, str]:
    manager, flats = engine.manager, engine.runtime.flats
    compute = engine.policy.compute_dtype.torch_dtype
    entries, sources = [], []
    for flat in flats:
        unit = flat.spec.index
        if flat.record is not None:  # its record's bytes as they are: records.py
            entries.append(Entry(f"unit{unit}.{records.ENTRY}", torch.uint8,
                                 (flat.record.shard_bytes,)))
            sources.append((unit, StateKind.PARAM))
            continue
        for kind in OPTIMIZER_STATES:  # as they are held: compact moments stay compact
            if manager.has(unit, kind):
                shard = manager.shards[(unit, kind)]
                entries.append(Entry(f"unit{unit}.{kind.value}", shard.dtype, (shard.numel,)))
                sources.append((unit, kind))
        # The weights too where they differ from the masters, or are all a frozen unit has.
        has_masters = manager.has(unit, StateKind.MASTER)
        if unit in pending or not has_masters:
            entries.append(Entry(f"unit{unit}.param", compute, (flat.shard_numel,)))
            sources.append((unit, StateKind.PARAM))
        if unit in pending and not has_masters and manager.has(unit, StateKind.EXP_AVG):
            # optimizer.master bf16: the weights are the master, and the pending update's
            # next weights are the masters' place.
            entries.append(Entry(f"unit{unit}.master", compute, (flat.shard_numel,)))
            sources.append((unit, StateKind.PARAM_NEXT))
    small = rng_states(engine.device)  # written whole, after the units
    small.update({f"buffer.{name}": value.detach().cpu() for name, value in
                  persistent_buffers(engine.module, engine.state_dict_keys).items()})
    small.update({f"extra.{key}": value.detach().cpu() for key, value in
                  extra_states(engine.module, engine.state_dict_keys).items()
                  if isinstance(value, torch.Tensor)})
    entries += [Entry(name, value.dtype, tuple(value.shape)) for name, value in small.items()]
    writer = Writer(path, entries)
    try:
        for unit, kind in sources:
            for _, piece in manager.pieces(unit, kind):
                writer.write(piece)
        for value in small.values():
            writer.write(value)
    except BaseException:
        writer.abort()
        raise
    return writer.size, writer.close()


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
    """Manifest last, then the folder renamed into place, then ``latest``. A tag saved again
    sets its previous folder aside (``.<tag>.old``) until ``latest`` is written, so a crash in
    between still leaves one complete copy that :func:`load` finds."""
    manifest_path = os.path.join(staging, MANIFEST)
    with open(manifest_path, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(staging)
    aside = os.path.join(directory, f".{tag}.old")
    if os.path.exists(folder):
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(folder, aside)
    os.rename(staging, folder)
    _fsync_dir(directory)
    latest_tmp = os.path.join(directory, f".{LATEST}.tmp")
    with open(latest_tmp, "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.rename(latest_tmp, os.path.join(directory, LATEST))
    _fsync_dir(directory)
    shutil.rmtree(aside, ignore_errors=True)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load(engine, directory: str, tag: str | None) -> str:
    """Load the checkpoint ``tag`` (default: ``latest``, or where it is missing or empty the
    newest complete one: latest.py) of ``directory`` into ``engine``, which may have another
    world size, policy or cut into units than the one that saved it, but the same model, the
    same ``optimizer.param_groups``, one AdamW step count per unit and no parameter unfrozen
    in a unit that has stepped (layout.unit_steps); returns the tag. Every rank must call it:
    each checks what it will read first, and if any rank cannot use the checkpoint, every
    rank raises before anything is changed."""
    group = engine.runtime.group
    engine.runtime.worker.drain()  # a delayed update may still be writing the shards
    if tag is not None:
        check_tag(tag)
    _own_folder(engine, directory, create=False)
    failure, readers = None, {}
    try:
        tag = tag or chosen_tag(directory, intact_steps, say=group.rank == 0)
        folder = _complete_folder(directory, tag)
        manifest = read_manifest(folder)
        records.check_frozen_dtype(manifest, engine.policy)
        runs = layout.segments(engine.runtime.flats, manifest["units"], manifest.get("tiles"))
        records.check_records(engine.runtime.flats, runs, manifest["units"])
        _check_param_groups(manifest, engine)
        steps = layout.unit_steps(engine.runtime.flats, runs, manifest["units"],
                                  manifest["optimizer"]["unit_steps"],
                                  set(manifest.get("frozen", [])))  # none before format 2
        same_world = manifest["world_size"] == group.world_size
        same_shards = same_world and layout.unchanged(runs, engine.runtime.flats)
        needed = [rank_file(group.rank)] if same_shards else list(manifest["files"])
        readers = _open_verified(folder, manifest, needed)
        reads = _plan_reads(engine, manifest, readers, runs)
        _check_rng(readers[rank_file(group.rank)] if same_world else None)
        model_state = _read_model_state(
            engine, manifest, readers[rank_file(group.rank if same_world else 0)])
    except Exception as error:  # any, a bug's too: the other ranks wait in all_or_raise
        failure = error
    try:
        all_or_raise(group, failure, "another rank cannot use the checkpoint; nothing loaded")
        with engine.replacing_states(f"loading checkpoint {folder}"):
            _load_states(engine, manifest, reads, steps,
                         readers[rank_file(group.rank)] if same_world else None)
            store_model_state(engine.module, model_state)
    finally:
        for reader in readers.values():
            reader.close()
    assert tag is not None  # chosen in the try, or all_or_raise raised
    return tag


def _complete_folder(directory: str, tag: str) -> str:
    """The folder of ``tag``; or, where a save of the same tag crashed after setting the
    previous copy aside, that copy (see :func:`_commit`). Never one out of ``directory``
    (latest.check_inside)."""
    check_inside(directory, tag)
    folder = os.path.join(directory, tag)
    aside = os.path.join(directory, f".{tag}.old")
    if not os.path.exists(os.path.join(folder, MANIFEST)) and \
            os.path.exists(os.path.join(aside, MANIFEST)):
        return aside
    if not os.path.isdir(folder):  # most likely a typo: say what there is
        raise CheckpointError(f"no checkpoint {tag!r} in {directory}; it holds "
                              f"{', '.join(complete_tags(directory)) or 'none'}")
    return folder


def _check_param_groups(manifest: dict, engine) -> None:
    """Each param group's hyperparameters (a scheduler's learning rate among them) are restored
    to the group in the same place, so the groups must be the same: the policy's
    ``optimizer.param_groups`` with the same patterns in the same order."""
    saved = [group["match"] for group in
             manifest["policy"]["optimizer"].get("param_groups", [])]  # none before format 2
    ours = [list(group.match) for group in engine.policy.optimizer.param_groups]
    if saved != ours:
        raise CheckpointError(
            f"the checkpoint's optimizer.param_groups match {saved}, this engine's {ours}: "
            f"each group's hyperparameters are restored to the group in the same place; "
            f"resume with the param_groups it was saved with")


def _open_verified(folder: str, manifest: dict, names: list[str]) -> dict[str, Reader]:
    """Open the rank files ``names``, each checked against the manifest first: its kind and
    size before its hash (a link to ``/dev/zero`` would be hashed for ever), then its sha256.
    Any that is not usable closes those opened."""
    readers = {}
    try:
        for name in names:
            readers[name] = _open_one(folder, manifest, name)
    except BaseException:
        for reader in readers.values():
            reader.close()
        raise
    return readers


def _open_one(folder: str, manifest: dict, name: str) -> Reader:
    path = check_rank_file(folder, manifest, name)
    try:
        _, digest = file_digest(path)
    except OSError as error:
        raise CheckpointError(f"{path}: cannot be read: {error.strerror}") from None
    if digest != manifest["files"][name]["sha256"]:
        raise CheckpointError(f"{path}: sha256 {digest} differs from the manifest's "
                              f"{manifest['files'][name]['sha256']} (corrupted)")
    return Reader(path)


def _plan_reads(engine, manifest: dict, readers: dict[str, Reader],
                runs: list[list[layout.Segment]]) -> dict[tuple[int, StateKind], layout.Read]:
    """What to read for every state this rank loads, every entry checked first (names, dtypes,
    shapes), so that a bad checkpoint is refused before anything is stored."""
    manager, units = engine.manager, manifest["units"]
    pending = manifest["optimizer"]["pending"]
    written = set(pending["written"]) if pending else set()
    reads = {}
    for flat, unit_runs in zip(engine.runtime.flats, runs):
        unit = flat.spec.index
        if flat.record is not None:  # its record's bytes, as saved: records.py
            reads[(unit, StateKind.PARAM)] = records.plan_read(readers, rank_file, units, flat,
                                                               unit_runs)
            continue
        weights_alone = not manager.has(unit, StateKind.MASTER)
        # A delayed update pending when saved wrote the next weights of some saved units: a
        # unit with any of their elements keeps two weights, the current ones read from what
        # was saved (layout._source) and the next from the masters, and swaps at the next
        # step. (A unit without the second buffer, a policy without the delayed update or a
        # unit now frozen, takes the masters' weights at once.)
        swaps = manager.has(unit, StateKind.PARAM_NEXT) and any(
            run.unit in written for run in unit_runs)
        kinds = [kind for kind in OPTIMIZER_STATES if manager.has(unit, kind)]
        if weights_alone or swaps:
            kinds.append(StateKind.PARAM)
        for kind in kinds:
            dtype = manager.shards[(unit, kind)].dtype
            reads[(unit, kind)] = layout.plan_read(
                readers, rank_file, units, unit_runs, kind, weights_alone and not swaps,
                flat.shard_range, dtype, written if swaps else set())
        if weights_alone and swaps:  # bf16 masters: the next weights are read as the masters
            reads[(unit, StateKind.PARAM_NEXT)] = layout.plan_read(
                readers, rank_file, units, unit_runs, StateKind.MASTER, False,
                flat.shard_range, manager.shards[(unit, StateKind.PARAM)].dtype, written)
    _say_conversions(reads, manager)
    return reads


def _say_conversions(reads: dict[tuple[int, StateKind], layout.Read], manager) -> None:
    """Log each state the checkpoint holds otherwise than this run keeps it (fp32 moments into
    an int8 run, fp32 masters into a bf16-master one, and back): what it is converted from and
    to, once per state."""
    said = set()
    for (unit, kind), read in reads.items():
        saved = read.saved_dtypes()
        held = manager.shards[(unit, kind)].dtype
        if kind is StateKind.PARAM and not manager.has(unit, StateKind.EXP_AVG):
            continue  # a frozen unit's weights, as ever
        for dtype in saved - {held}:
            if (kind, dtype) not in said:
                said.add((kind, dtype))
                _log.info("tiered: the checkpoint holds %s as %s, this run keeps it as %s: "
                          "converted on load", _STATE_NAMES.get(kind, kind.value),
                          layout.dtype_name(dtype), layout.dtype_name(held))


def _check_rng(own_file: Reader | None) -> None:
    if own_file is None:  # another world size: the RNG states are not restored
        return
    for name in RNG_STATES:
        if name in own_file.entries and own_file.entry(name).dtype is not torch.uint8:
            raise CheckpointError(f"{own_file.path}: {name!r} is not a byte tensor")


def _read_model_state(engine, manifest: dict, reader: Reader) -> dict[str, object]:
    """The buffers and extra states ``reader`` (this rank's file, or rank 0's at another world
    size) and the manifest hold, by state-dict key, read and checked against the model's
    before anything is stored (pretrained.store_model_state). A checkpoint without them
    (saved before they were) has none."""
    out: dict[str, object] = {}
    for name, buffer in persistent_buffers(engine.module, engine.state_dict_keys).items():
        entry = f"buffer.{name}"
        if entry in reader.entries:
            out[name] = _read_like(reader, entry, buffer.dtype, tuple(buffer.shape))
    saved_objects = manifest.get("extra_states", {})
    for key, value in extra_states(engine.module, engine.state_dict_keys).items():
        entry = f"extra.{key}"
        if entry in reader.entries:
            out[key] = _read_whole(reader, entry)
        elif key in saved_objects:
            out[key] = saved_objects[key]
    return out


def _read_like(reader: Reader, name: str, dtype: torch.dtype,
               shape: tuple[int, ...]) -> torch.Tensor:
    entry = reader.entry(name)
    if entry.dtype is not dtype or entry.shape != shape:
        raise CheckpointError(f"{reader.path}: {name!r} is {entry.dtype} {list(entry.shape)}, "
                              f"the model's is {dtype} {list(shape)}")
    return _read_whole(reader, name)


def _load_states(engine, manifest: dict, reads: dict[tuple[int, StateKind], layout.Read],
                 steps: list[float], own_file: Reader | None) -> None:
    """Store what ``reads`` says, then the optimizer's state with each unit's ``steps``, then
    (``own_file``: the same world size) this rank's RNG states."""
    manager = engine.manager
    state = manifest["optimizer"]
    swapping = set()
    for flat in engine.runtime.flats:
        unit = flat.spec.index
        masters = None
        for kind in OPTIMIZER_STATES:
            if (unit, kind) in reads:
                values = reads[(unit, kind)].fetch()
                manager.store(unit, kind, values)
                masters = values if kind is StateKind.MASTER else masters
        if (unit, StateKind.PARAM_NEXT) in reads:  # bf16 masters: the pending next weights
            masters = reads[(unit, StateKind.PARAM_NEXT)].fetch()
        weights_read = reads.get((unit, StateKind.PARAM))
        if weights_read is not None and masters is not None:
            # A delayed update pending: keep its two weights.
            manager.store(unit, StateKind.PARAM, weights_read.fetch())
            manager.store(unit, StateKind.PARAM_NEXT, masters)
            swapping.add(unit)
        else:
            if masters is None:
                assert weights_read is not None, f"unit {unit}: no weights to load"
                masters = weights_read.fetch()
            values = masters
            for kind in (StateKind.PARAM, StateKind.PARAM_NEXT):
                if manager.has(unit, kind):
                    manager.store(unit, kind, values)
    pending = state["pending"]
    if pending is not None and set(pending["written"]) != swapping:
        # The weights were rebuilt from the master weights: nothing is left to swap to, but the
        # update's outcome (its norm, an fp16 overflow) still counts at the next step.
        pending = dict(pending, written=sorted(swapping))
    engine.runtime.grads.zero_grad(set_to_none=True)
    engine.optimizer.restore_state(dict(state, pending=pending, unit_steps=steps))
    if own_file is not None:
        set_rng_states({name: _read_whole(own_file, name) for name in RNG_STATES
                        if name in own_file.entries}, engine.device)


def _read_whole(reader: Reader, name: str) -> torch.Tensor:
    entry = reader.entry(name)
    out = torch.empty(entry.shape, dtype=entry.dtype)
    reader.read(name, out)
    return out
