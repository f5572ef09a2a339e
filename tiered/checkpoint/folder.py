"""The checkpoint folder of a job: checked at its first save or load, and owned by one job.

[Note: one job per checkpoint folder]
Two jobs writing into one folder corrupt each other's saves (a job resumed beside orphaned
ranks of its predecessor died at its next save, while they went on), so a job owns its folder:
rank 0 takes an ``OwnerLock`` (liveness.py) on ``<dir>/.owner.lock`` at its first save or load
there, and holds it until every engine of its process that used the folder is closed, or the
process ends, however it ends. The kernel drops the lock of a dead job, whose folder the next
job simply takes; a live owner is named in the refusal, which every rank raises alike. Engines
of one process are one job, so they share the lock.

Holding the lock, rank 0 knows that no live job is saving there, and that this job's own saves
remove their staging folders however they end short of a SIGKILL: every ``.<tag>.tmp`` found
at the claim was left by a dead job, and is removed (with a ``.<tag>.old`` whose tag is
complete again, a ``.<tag>.del`` that keep_last was deleting and a ``.latest.tmp``), saying
so in one line.
"""
from __future__ import annotations

import os
import shutil
import stat
import warnings
import weakref
from dataclasses import dataclass, field

from ..core.liveness import LOCK_NAME, HeldElsewhere, OwnerLock, make_owned_folder
from .format import CheckpointError
from .latest import LATEST, MANIFEST


def check_folder(directory: str) -> None:
    """Raise a CheckpointError with a one-line reason where ``directory`` cannot hold
    checkpoints: it exists and is not a folder, its parent is not a folder, or the folder (or,
    where it is still to be made, its parent) is not writable by this process."""
    path = os.path.abspath(directory)
    if os.path.lexists(path) and not os.path.exists(path):
        raise CheckpointError(f"checkpoint folder {directory}: a symbolic link to "
                              f"{os.readlink(path)}, which does not exist")
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise CheckpointError(f"checkpoint folder {directory}: exists and is "
                                  f"{_kind(path)}, not a folder")
        where = path
    else:
        where = os.path.dirname(path)
        if not os.path.isdir(where):
            raise CheckpointError(f"checkpoint folder {directory}: its parent {where} does "
                                  f"not exist{'' if not os.path.exists(where) else ' as a folder'}")
    if not os.access(where, os.W_OK | os.X_OK):
        read_only = os.statvfs(where).f_flag & os.ST_RDONLY
        raise CheckpointError(f"checkpoint folder {directory}: {where} is not writable "
                              f"({'a read-only file system' if read_only else 'by this user'})")


def _kind(path: str) -> str:
    mode = os.stat(path).st_mode
    return ("a regular file" if stat.S_ISREG(mode) else "a character device"
            if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode) else "a FIFO"
            if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a file")


@dataclass
class _Claim:
    lock: OwnerLock
    engines: weakref.WeakSet = field(default_factory=weakref.WeakSet)
    """The engines of this process using the folder: the lock goes with the last one."""


_claims: dict[str, _Claim] = {}
"""The folders this process owns, by real path."""


def claim(engine, directory: str, create: bool, world_size: int) -> None:
    """On rank 0: own ``directory`` for this job (see the module note), making it where
    ``create`` (a save) and it is missing, and remove what dead jobs staged there. A load of a
    folder that is not there owns nothing (it finds no checkpoint)."""
    real = os.path.realpath(directory)
    if real in _claims:
        _claims[real].engines.add(engine)
        return
    purpose = f"checkpoints of a tiered job of {world_size} rank(s)"
    if not os.path.isdir(real):
        if not create:
            return
        try:
            lock = make_owned_folder(real, purpose, mode=0o777)  # as mkdir: the umask decides
        except FileExistsError:  # made at this moment by another job: the lock says whose
            lock = _take(real, directory, purpose)
        except OSError as error:
            raise CheckpointError(f"cannot create {directory}: {error.strerror}") from None
    else:
        lock = _take(real, directory, purpose)
    _claims[real] = _Claim(lock)
    _claims[real].engines.add(engine)
    _remove_dead_staging(real, directory)


def _take(real: str, directory: str, purpose: str) -> OwnerLock:
    try:
        return OwnerLock(os.path.join(real, LOCK_NAME), purpose)
    except HeldElsewhere as held:
        raise CheckpointError(f"checkpoint folder {directory} is in use by a live job, "
                              f"{held.owner}: one job at a time may write into it; stop that "
                              f"job or give this one another folder") from None
    except OSError as error:
        raise CheckpointError(f"cannot lock {os.path.join(directory, LOCK_NAME)}: "
                              f"{error.strerror}") from None


def release_folders(engine) -> None:
    """``engine`` is closed: give up the folders no engine of this process uses any more."""
    for real in list(_claims):
        _release(engine, real)


def release_folder(engine, directory: str) -> None:
    """``engine`` is done with ``directory`` (a trainer that saves each checkpoint into a folder
    of its own, which it may delete: Hugging Face's ``checkpoint-<step>``): give it up unless
    another engine of this process uses it."""
    _release(engine, os.path.realpath(directory))


def _release(engine, real: str) -> None:
    held = _claims.get(real)
    if held is None:
        return
    held.engines.discard(engine)
    if not held.engines:
        held.lock.release()
        del _claims[real]


def _remove_dead_staging(real: str, directory: str) -> None:
    """What saves of dead jobs left: staging folders, a ``latest`` written aside, checkpoints
    keep_last was removing (retention.py), and the previous copy of a tag that a save set
    aside (only once that tag is complete again: until then it is the copy a load finds, see
    checkpoint._commit)."""
    removed = []
    for name in sorted(os.listdir(real)):
        path = os.path.join(real, name)
        if name == f".{LATEST}.tmp" and not os.path.isdir(path):
            os.remove(path)
        elif not (name.startswith(".") and os.path.isdir(path) and not os.path.islink(path)):
            continue
        elif name.endswith((".tmp", ".del")):
            shutil.rmtree(path, ignore_errors=True)
        elif name.endswith(".old") and os.path.isfile(
                os.path.join(real, name[1:-len(".old")], MANIFEST)):
            shutil.rmtree(path, ignore_errors=True)
        else:
            continue
        removed.append(name)
    if removed:
        warnings.warn(f"tiered: removed what saves of dead jobs left in {directory}: "
                      f"{', '.join(removed)}", stacklevel=2)
