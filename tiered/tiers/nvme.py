"""NVMe: shard states in preallocated O_DIRECT files (extents) in a folder of this run's own.

Layout: ``<nvme.path>/tiered-<host>-<pid>-<token>-rank<r>/`` (mode 0700) holds the extents
(``extent-NNNNN.bin``, mode 0600), each preallocated to a shard state's full, block-aligned size
when the engine starts, so a full disk shows up then, before any training state exists, and not
in the middle of a step. The folder is removed when the engine closes (and at interpreter exit).

[Note: run folders of dead runs]
A run killed by SIGKILL (or the OOM killer) cannot remove its folder, and its extents would hold
the disk forever. So the folder is made owned (liveness.make_owned_folder): its lock file is
locked for the tier's life and the kernel drops the lock when the process dies, however it
dies. A tier starting on a path first removes the run folders there whose lock no one holds
(and, of the older layout without a lock file, those of this host whose pid is gone), and the
``.making-`` leftovers of a folder being made when its maker died, saying so in one warning
each. A live run's folder is never touched, nor anything not named as a run folder.

[Note: atomic shard writes]
A shard state's current version lives in one extent. A write goes to a spare extent of the same
size; only when every block of it is written does the shard switch to it, and its old extent
becomes a spare. A failed write leaves the shard on its old extent, readable as before, so an
I/O error or a full device never corrupts training state. Each extent size has SPARE_EXTENTS
spares: that many writes of that size may be in flight at once (the optimizer writes a unit's
master weights and two moments together); a further write waits for one to finish.

Transfers go through the I/O engine (aio.py) between an extent and an aligned DRAM block. File
systems without O_DIRECT fall back to buffered I/O with a warning.
"""
from __future__ import annotations

import errno as errno_codes
import fcntl
import os
import re
import secrets
import shutil
import socket
import threading
import warnings
import weakref

import torch

from ..core.errors import NvmeError
from ..core.liveness import (LOCK_NAME, MAKING_PREFIX, HeldElsewhere, OwnerLock, describe_owner,
                             is_held, make_owned_folder)
from ..core.sizes import align_up, format_size
from .aio import Countdown, IoEngine, IoQueue, IoSettings, Transfer, host_buffer
from .dram import BLOCK_ALIGN
from .faces import ShardFile
from .usage import TierUsage

SPARE_EXTENTS = 3
"""Spare extents per extent size (see [Note: atomic shard writes]). A unit's optimizer states
(master weights, two moments) take one each before any switches, so fewer would deadlock."""


RUN_FOLDER = re.compile(r"^tiered-(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]{6}-rank\d+$")
"""A run folder's name (see the layout above); the host may itself hold dashes."""


def check_nvme_path(path: str) -> None:
    """Raise NvmeError unless ``path`` is an existing, writable folder."""
    if not os.path.exists(path):
        raise NvmeError(f"NVMe path {path} does not exist; create it or pass another --nvme PATH",
                        path=path, errno=errno_codes.ENOENT)
    if not os.path.isdir(path):
        raise NvmeError(f"NVMe path {path} is not a folder", path=path, errno=errno_codes.ENOTDIR)
    if os.statvfs(path).f_flag & os.ST_RDONLY:  # no permission would help: say what would
        raise NvmeError(f"NVMe path {path} is on a read-only file system; pass a folder on a "
                        f"writable one", path=path, errno=errno_codes.EROFS)
    if not os.access(path, os.W_OK | os.X_OK):
        raise NvmeError(f"NVMe path {path} is not writable by this user", path=path,
                        errno=errno_codes.EACCES)


def disk_bytes(folder: str) -> int:
    """Bytes of disk the files under ``folder`` take (preallocated extents count whole)."""
    total = 0
    for parent, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(parent, name)).st_blocks * 512
            except OSError:  # removed meanwhile
                pass
    return total


def _pid_gone(pid: int) -> bool:
    """Whether no process of this host has ``pid`` (signal 0 only asks)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        pass
    return False


def _run_folder_state(root: str, name: str) -> str:
    """Whether the entry ``name`` of ``root`` is the folder of a "live" run, of a "dead" one,
    or "other": not a run folder, or one this host cannot judge (see [Note: run folders of
    dead runs])."""
    making = name.startswith(MAKING_PREFIX)
    match = RUN_FOLDER.match(name[len(MAKING_PREFIX):] if making else name)
    path = os.path.join(root, name)
    if match is None or os.path.islink(path) or not os.path.isdir(path):
        return "other"
    lock = os.path.join(path, LOCK_NAME)
    try:
        if os.path.exists(lock) and is_held(lock):
            return "live"
    except OSError:  # another user's lock file, which this user may not open
        return "other"
    # A folder being made has its lock file made, then locked: in between, only its pid can
    # tell (on this host). So can it of the older layout, without a lock file.
    if making or not os.path.exists(lock):
        if match["host"] != socket.gethostname():
            return "dead" if making and os.path.exists(lock) else "other"
        return "dead" if _pid_gone(int(match["pid"])) else "live"
    return "dead"


def remove_dead_runs(root: str) -> list[tuple[str, int]]:
    """Remove the folders of dead runs in ``root``, each with a warning naming it and the bytes
    it freed; returns (folder, bytes) of each."""
    removed = []
    for name in sorted(os.listdir(root)):
        if _run_folder_state(root, name) != "dead":
            continue
        path = os.path.join(root, name)
        lock_file = os.path.join(path, LOCK_NAME)
        owner = describe_owner(lock_file) if os.path.exists(lock_file) else "its run"
        freed = disk_bytes(path)  # before the claim below writes its own record there
        try:
            # Held while removing, so that two runs starting at once do not both remove it,
            # and a run that finds it locked leaves it alone.
            claim = OwnerLock(lock_file, "removing the NVMe folder of a dead run")
        except HeldElsewhere:  # another run is removing it
            continue
        except OSError:  # removed meanwhile, or another user's, which is theirs to remove
            continue
        try:
            shutil.rmtree(path, ignore_errors=True)
        finally:
            claim.release()
        if not os.path.exists(path):
            removed.append((path, freed))
            warnings.warn(f"tiered: removed {path}, the NVMe folder of a run that is gone "
                          f"({owner}), freeing {format_size(freed)}", stacklevel=3)
    return removed


def live_runs(root: str, own: str | None = None) -> tuple[int, int]:
    """(folders, bytes) of the live runs' folders in ``root`` other than ``own``: the space a
    run short of disk there cannot have, for its message."""
    count = held = 0
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if path != own and _run_folder_state(root, name) == "live":
            count, held = count + 1, held + disk_bytes(path)
    return count, held


def live_runs_hint(root: str, own: str | None = None) -> str:
    """``; N folders of live tiered runs there (tiered-*) hold X``, for a message about the
    space of ``root``; empty when there is none."""
    count, held = live_runs(root, own)
    if not count:
        return ""
    return (f"; {count} folder{'s' if count > 1 else ''} of live tiered runs there "
            f"(tiered-*) hold{'' if count > 1 else 's'} {format_size(held)}")


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def extent_bytes(nbytes: int) -> int:
    return align_up(max(nbytes, 1), BLOCK_ALIGN)


def nvme_bytes(state_sizes: list[int]) -> int:
    """Bytes of extents for shard states of these sizes, spares included."""
    sizes = [extent_bytes(n) for n in state_sizes]
    return sum(sizes) + SPARE_EXTENTS * sum(set(sizes))


def _reserve(fd: int, nbytes: int, direct: bool) -> None:
    """``posix_fallocate``. Where the file system has no fallocate (ext2, ext3 without
    extents), glibc writes one byte per block instead, which O_DIRECT refuses with EINVAL:
    there the reserving writes go through the page cache, on the same descriptor."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if not direct or e.errno != errno_codes.EINVAL:
            raise
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        finally:
            fcntl.fcntl(fd, fcntl.F_SETFL, flags)


class Extent:
    """A preallocated file of ``nbytes`` (a multiple of BLOCK_ALIGN), open for the run."""

    def __init__(self, path: str, nbytes: int, direct: bool):
        self.path = path
        self.nbytes = nbytes
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if direct else 0)
        try:
            self.fd = os.open(path, flags, 0o600)
        except OSError as e:
            # Wrapped so that it is a tiered error naming the file (EMFILE is the likely one: every
            # extent keeps its file open).
            hint = ("; each NVMe extent keeps a file open: raise the open-file limit "
                    "(ulimit -n)" if e.errno == errno_codes.EMFILE else "")
            raise NvmeError(f"NVMe file {path}: cannot create it: {e.strerror}{hint}",
                            errno=e.errno, path=path) from None
        try:
            _reserve(self.fd, nbytes, direct)
        except OSError as e:
            os.close(self.fd)
            self.fd = -1
            # Leave no empty or partly reserved file behind for the failed request.
            try:
                os.unlink(path)
            except OSError:
                pass
            raise NvmeError(
                f"NVMe file {path}: cannot reserve {format_size(nbytes)}: {e.strerror}",
                errno=e.errno, path=path, offset=0, size=nbytes) from None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class NvmeShard:
    """One shard state on NVMe: the extent holding its current version."""

    def __init__(self, tier: "NvmeTier", extent: Extent):
        self._tier = tier
        self.extent = extent

    @property
    def nbytes(self) -> int:
        return self.extent.nbytes

    @property
    def path(self) -> str:
        return self.extent.path

    def start_read(self, block: torch.Tensor, offset: int = 0,
                   nbytes: int | None = None) -> Transfer:
        """Start filling ``block`` with ``nbytes`` (default: all) of the current version from
        byte ``offset`` (both multiples of BLOCK_ALIGN)."""
        extent = self.extent
        nbytes = extent.nbytes - offset if nbytes is None else nbytes
        return self._tier.io.read(extent.fd, extent.path, offset, host_buffer(block, nbytes))

    def read_into(self, block: torch.Tensor) -> None:
        self.start_read(block).wait()

    def next_version(self) -> "NextVersion":
        """A spare extent to write this shard's next version into (waits while all are busy)."""
        return NextVersion(self, self._tier.take_spare(self.extent.nbytes))

    def start_write(self, block: torch.Tensor) -> "NextVersion":
        """Start writing the shard's size of ``block`` as the next version."""
        version = self.next_version()
        version.write(block)
        version.commit()
        return version

    def write_from(self, block: torch.Tensor) -> None:
        self.start_write(block).wait()


class NextVersion:
    """A shard's next version, written into a spare extent in one or more pieces.

    Once :meth:`commit` has been called and every piece is written, the shard switches to it,
    on whichever thread finishes last; if any piece failed, the spare goes back and the shard
    keeps its version. Nobody has to wait for that to happen, so a writer blocked waiting for a
    spare never waits on itself. :meth:`wait` waits for it and raises the failure (every time).
    """

    def __init__(self, shard: NvmeShard, spare: Extent):
        self._shard, self._spare = shard, spare
        self._group: VersionGroup | None = None
        self._lock = threading.Lock()
        self._pending = 0
        self._committed = False
        self._failure: BaseException | None = None
        self._settled = threading.Event()

    @property
    def nbytes(self) -> int:
        return self._spare.nbytes

    def write(self, block: torch.Tensor, offset: int = 0, nbytes: int | None = None) -> Transfer:
        """Start writing ``nbytes`` (default: all) of ``block`` at byte ``offset``; ``block``
        must stay untouched until the returned transfer is done."""
        nbytes = self._spare.nbytes - offset if nbytes is None else nbytes
        with self._lock:
            assert not self._committed, "write after commit"
            self._pending += 1
        try:
            transfer = self._shard._tier.io.write(self._spare.fd, self._spare.path, offset,
                                                  host_buffer(block, nbytes))
        except BaseException as error:
            self._finished(error)
            raise
        transfer.on_done(self._finished)
        return transfer

    def commit(self) -> None:
        """No more pieces: switch once they are all written."""
        with self._lock:
            self._committed = True
            ready = self._pending == 0
        if ready:
            self._settle()

    def abandon(self) -> None:
        """Give the spare back once pieces in flight are done; the shard keeps its version."""
        with self._lock:
            self._failure = self._failure or NvmeError(
                f"next version of {self._shard.path} abandoned", path=self._spare.path)
        self.commit()

    def wait(self) -> None:
        self._settled.wait()
        if self._failure is not None:
            raise self._failure

    def _finished(self, failure: BaseException | None) -> None:
        with self._lock:
            self._pending -= 1
            self._failure = self._failure or failure
            ready = self._committed and self._pending == 0
        if ready:
            self._settle()

    def _settle(self) -> None:
        if self._group is not None:
            self._group.ready()
        else:
            self._apply(self._failure)

    def _apply(self, failure: BaseException | None) -> None:
        """Switch to the new version, or (on ``failure``) keep the old one."""
        tier = self._shard._tier
        self._failure = self._failure or failure
        if self._failure is not None:
            tier.give_back(self._spare)  # the old version stays current
        else:
            old, self._shard.extent = self._shard.extent, self._spare
            tier.give_back(old)
        self._settled.set()


class VersionGroup:
    """Next versions of several shards (a unit's master weights and moments) that switch
    together: all of them once every piece of each is written, or, if any piece failed, none."""

    def __init__(self, versions: list[NextVersion]):
        self.versions = versions
        self._countdown = Countdown(len(versions), self._switch)
        for version in versions:
            version._group = self

    def ready(self) -> None:
        """One of the versions has all its pieces written (or failed)."""
        self._countdown.count()

    def _switch(self) -> None:
        failure = next((v._failure for v in self.versions if v._failure), None)
        for member in self.versions:
            member._apply(failure)

    def commit(self) -> None:
        for version in self.versions:
            version.commit()

    def abandon(self) -> None:
        for version in self.versions:
            version.abandon()

    def wait(self) -> None:
        for version in self.versions:
            version.wait()


def _remove_run_folder(run_dir: str, owner: OwnerLock) -> None:
    """Remove a run folder, then give up its lock: the other order would show a live run's
    folder as a dead one's to a tier starting meanwhile."""
    shutil.rmtree(run_dir, ignore_errors=True)
    owner.release()


def own_shard(shard: ShardFile) -> NvmeShard:
    """``shard`` as this process's own extent, where only such a one can be: the optimizer's
    stream and a re-plan's removal run beside an NvmeTier (in the trainer, or in the service's
    host over the rank's adopted files), never over a trainer's view of the service's files."""
    assert isinstance(shard, NvmeShard), f"{shard.path} is not held by this process"
    return shard


class NvmeTier:
    def __init__(self, root: str, budget: int | None, rank: int, io: IoSettings,
                 ranks: int = 1, queue: IoQueue | None = None):
        """``budget`` None: one of ``ranks`` equal shares (the ranks on this node, whose run
        folders share ``root``) of the free space there. ``queue``: the I/O queue it shares
        with other tiers (IoEngine), else one of its own."""
        root = os.path.abspath(root)  # the run folder is removed at close, whatever the cwd
        check_nvme_path(root)
        self.root = root
        self.removed = remove_dead_runs(root)  # before measuring: what they held is free again
        """(folder, bytes) of each dead run's folder removed, each said in a warning."""
        self.usage = TierUsage("nvme", free_bytes(root) // max(1, ranks) if budget is None
                               else budget)
        name = f"tiered-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}-rank{rank}"
        self.run_dir = os.path.join(root, name)
        try:
            owner = make_owned_folder(self.run_dir, f"NVMe extents of rank {rank}")
        except OSError as e:
            raise NvmeError(f"NVMe path {root}: cannot create {name}: {e.strerror}",
                            errno=e.errno, path=self.run_dir) from None
        # Also when the tier is dropped unclosed, or at the interpreter's exit: a SIGTERM turned
        # into SystemExit may come between any two lines of whoever builds the tier, before
        # it can hold the tier to close it.
        self._remove_run_dir = weakref.finalize(self, _remove_run_folder, self.run_dir, owner)
        try:
            self.direct = self._supports_direct_io()
            if not self.direct:
                warnings.warn(f"{root} does not support O_DIRECT; the NVMe tier uses buffered "
                              f"I/O there (the page cache will hold copies of what it writes)")
            self.io = IoEngine(io, queue)
        except BaseException:
            # The folder is this tier's, and no tier object will exist to remove it at close.
            self._remove_run_dir()
            raise
        self._extents: list[Extent] = []
        self._spares: dict[int, list[Extent]] = {}
        self._shards_of_size: dict[int, int] = {}
        """How many shard states hold an extent of each size (its spares serve them)."""
        self._spare_returned = threading.Condition()

    def _supports_direct_io(self) -> bool:
        probe = os.path.join(self.run_dir, ".direct-probe")
        try:
            os.close(os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600))
            return True
        except OSError as e:
            if e.errno != errno_codes.EINVAL:
                raise NvmeError(f"NVMe path {self.root}: cannot create files: {e.strerror}",
                                errno=e.errno, path=probe) from None
            return False
        finally:
            if os.path.exists(probe):
                os.unlink(probe)

    def create(self, what: str, nbytes: int) -> NvmeShard:
        """A shard state of ``nbytes`` on this tier (contents zero), with its size's spares.

        All or nothing: when an extent cannot be had (budget, full disk, no descriptors), the
        extents this call made are removed and no longer counted."""
        size = extent_bytes(nbytes)
        made: list[Extent] = []
        # Spares kept past a failure would hold files and bytes no shard uses, unregistered,
        # so that a retry would make three more.
        try:
            if size not in self._spares:
                for _ in range(SPARE_EXTENTS):
                    made.append(self._new_extent(size, f"spare for {what}"))
            made.append(self._new_extent(size, what))
        except BaseException:
            for extent in reversed(made):  # the newest extents: numbering stays consecutive
                self._drop_extent(extent)
            raise
        if len(made) > 1:
            self._spares[size] = made[:-1]
        self._shards_of_size[size] = self._shards_of_size.get(size, 0) + 1
        return NvmeShard(self, made[-1])

    def scratch(self, what: str, nbytes: int) -> Extent:
        """An extent of ``nbytes`` (block-aligned) written and read in place, without spares or
        versions: for bytes that live within a step (scratch.py), which no failure needs to
        keep readable. Removed with the tier."""
        return self._new_extent(extent_bytes(nbytes), what)

    def _new_extent(self, size: int, what: str) -> Extent:
        self.usage.acquire(size, f"NVMe extent for {what}")
        path = os.path.join(self.run_dir, f"extent-{len(self._extents):05d}.bin")
        try:
            extent = Extent(path, size, self.direct)
        except BaseException:
            self.usage.release(size)
            raise
        self._extents.append(extent)
        return extent

    def _drop_extent(self, extent: Extent) -> None:
        """Undo :meth:`_new_extent`: close and remove the file, stop counting its bytes."""
        extent.close()
        try:
            os.unlink(extent.path)
        except OSError:
            pass
        self._extents.remove(extent)
        self.usage.release(extent.nbytes)

    def remove(self, shard: ShardFile) -> None:
        """A shard state that left the drive (moved to the device by a re-plan), with no write
        of it in flight: its extent's file is removed and no longer counted, and so are the
        spares of its size once no shard state of that size is left (as nvme_bytes counts)."""
        extent = own_shard(shard).extent
        size = extent.nbytes
        self._drop_extent(extent)
        self._shards_of_size[size] -= 1
        if not self._shards_of_size[size]:
            for extent in self._spares.pop(size, []):
                self._drop_extent(extent)

    def take_spare(self, size: int) -> Extent:
        with self._spare_returned:
            self._spare_returned.wait_for(lambda: self._spares[size])
            return self._spares[size].pop()

    def give_back(self, extent: Extent) -> None:
        with self._spare_returned:
            if extent.nbytes not in self._spares:  # the tier closed meanwhile: nothing to keep
                return
            self._spares[extent.nbytes].append(extent)
            self._spare_returned.notify_all()

    def close(self) -> None:
        """Close every extent and remove this run's folder; safe to call more than once."""
        if self._extents:
            self.io.close()
        for extent in self._extents:
            extent.close()
        self._extents.clear()
        self._spares.clear()
        self._remove_run_dir()
        self.usage.release(self.usage.current)

    def bytes_moved(self) -> dict[str, int]:
        """Bytes read and written so far (IoEngine.bytes_moved)."""
        return self.io.bytes_moved()

    def live_runs_hint(self) -> str:
        """What the folders of other live runs hold on this path (see :func:`live_runs_hint`)."""
        return live_runs_hint(self.root, self.run_dir)
