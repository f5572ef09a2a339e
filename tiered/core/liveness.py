"""Which files and folders a live process owns: a lock that dies with its holder.

A run marks what it owns (its NVMe folder, a checkpoint folder it writes into) with an
``flock`` on a file there, taken on a descriptor it keeps open until it exits. The kernel drops
the lock however the process ends (exit, SIGKILL, the OOM killer), so on this host a lock that
no one holds means the owner is gone; a pid alone would not (pids are reused, and a pid of
another host says nothing). ``flock`` locks belong to the open file, so a second lock on the
same file conflicts even inside one process, and a child that ``exec``s does not inherit it
(the descriptor is close-on-exec). A child made by a bare ``fork`` shares it until it exits.

The lock file also says who holds it (host, pid, what for), so a refusal can name the owner.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import time

LOCK_NAME = ".owner.lock"
"""The lock file inside an owned folder."""


class HeldElsewhere(Exception):
    """The lock is held by another live owner; ``owner`` describes it (see describe_owner)."""

    def __init__(self, path: str, owner: str):
        super().__init__(f"{path} is held by {owner}")
        self.path = path
        self.owner = owner


class OwnerLock:
    """An exclusive lock on ``path``, held until :meth:`release` or the process's end.

    Raises HeldElsewhere when a live owner holds it, OSError when the file cannot be made."""

    def __init__(self, path: str, purpose: str):
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise HeldElsewhere(path, describe_owner(path)) from None
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd
        record = json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                             "purpose": purpose, "since": time.time()}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Give the lock up (the file stays: another owner may already wait on it)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the last descriptor of the open file drops the flock


def is_held(path: str) -> bool:
    """Whether a live process holds the lock on ``path``; False when there is no such file.

    Probing takes the lock for an instant; an owner taking it at that instant would fail, so
    owners make their lock file before anyone can see it (see make_owned_folder)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also drops the probe's lock, if it got one
    return False


def describe_owner(path: str) -> str:
    """``pid 1234 on host h (purpose)`` as the lock file records it, or what is known."""
    try:
        with open(path, "rb") as f:
            record = json.loads(f.read(4096))
        return f"pid {record['pid']} on host {record['host']} ({record['purpose']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process (its lock file does not say which)"


def make_owned_folder(path: str, purpose: str, mode: int = 0o700) -> OwnerLock:
    """Create the folder ``path`` with its lock already held, so no one ever sees it unowned:
    it is made under a hidden name beside ``path`` (``MAKING_PREFIX`` + name), locked, then
    renamed into place. Raises OSError (FileExistsError when ``path`` exists) and leaves
    nothing behind on a failure. A process killed in between leaves the hidden folder, holding
    only the lock file; whoever cleans up removes it once its lock is free."""
    parent, name = os.path.split(path)
    if os.path.lexists(path):  # rename(2) would replace an empty folder without a word
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), path)
    hidden = os.path.join(parent, MAKING_PREFIX + name)
    os.mkdir(hidden, mode)
    try:
        lock = OwnerLock(os.path.join(hidden, LOCK_NAME), purpose)
        try:
            os.rename(hidden, path)
        except BaseException:
            lock.release()
            raise
    except BaseException:
        shutil.rmtree(hidden, ignore_errors=True)
        raise
    lock.path = os.path.join(path, LOCK_NAME)
    return lock


MAKING_PREFIX = ".making-"
"""The hidden name's prefix of a folder that make_owned_folder has not yet put in place."""
