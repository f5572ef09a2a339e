"""Shared memory segments: anonymous ``memfd`` files, handed between processes as descriptors.

A segment has no name in /dev/shm or anywhere else, so nothing is left to leak when its
processes die: the kernel frees it once the last descriptor and the last mapping are gone. Only
a process that was given the descriptor (over the service's socket, ``SCM_RIGHTS``) can map it.

The service makes a segment and reserves all of its pages at once (``fallocate``), so memory the
node does not have is refused when it is asked for, by name, instead of killing a trainer with
SIGBUS at the first touch of a page that cannot be had. The trainer maps it and, on a GPU,
registers the mapping with CUDA itself (tiers/dram.py's ``PinnedSlabSource`` does the same for
its own memory): the service never touches CUDA.
"""
from __future__ import annotations

import errno
import mmap
import os
import threading
from typing import Callable

import torch

from ..core.errors import BudgetError, TieredError
from ..core.sizes import format_size


def create_segment(nbytes: int, name: str) -> int:
    """A new memfd of ``nbytes`` with every page reserved; returns its descriptor.

    Raises BudgetError when the node cannot hold it (shared memory is counted against the
    cgroup of the process that first touches it: here, the service)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise BudgetError(f"the node's memory cannot hold a segment of "
                              f"{format_size(nbytes)} for {name}: {e.strerror}",
                              {"dram": (nbytes, 0)}) from None
        raise
    return fd


def map_segment(fd: int, nbytes: int, populate: bool = False) -> torch.Tensor:
    """The segment as a uint8 CPU tensor of ``nbytes`` (page aligned); the tensor keeps the
    mapping alive, and the descriptor may be closed once it is made. ``populate``: every page is
    mapped now, in one pass of the kernel's, for a trainer that touches all of them at once.
    Measured here, 1 GB: pages another mapping had touched, 0.08 s against 0.16-0.19 s of
    faults at the first touch; pages never mapped, 0.40 s against 0.21 s (so only the former
    are populated)."""
    mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate
                                                             else 0),
                        prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(mapping, dtype=torch.uint8)


class SpareSegments:
    """Segments of jobs that ended, kept for the next reservations of their size: the warm
    start. A segment is made by zeroing every page of it (``fallocate``, 0.3 s per GB here); a
    spare is handed out as it is, its pages still there, with what the last job left in them
    (the same user's: a tier writes every state before it reads it, or zeroes it). Spares are
    the pool's too: they count against its budget, and go first when a reservation needs
    their room. Not thread-safe: the registry's lock guards it."""

    def __init__(self):
        self._by_size: dict[int, list[int]] = {}
        self.nbytes = 0

    def take(self, nbytes: int) -> int | None:
        """A spare's descriptor of exactly ``nbytes``, or None."""
        fds = self._by_size.get(nbytes)
        if not fds:
            return None
        self.nbytes -= nbytes
        return fds.pop()

    def give(self, fd: int, nbytes: int) -> None:
        self._by_size.setdefault(nbytes, []).append(fd)
        self.nbytes += nbytes

    def evict(self, needed: int) -> None:
        """Free spares, the largest first, until ``needed`` bytes of them are gone (or all)."""
        for size in sorted(self._by_size, reverse=True):
            fds = self._by_size[size]
            while fds and needed > 0:
                os.close(fds.pop())
                self.nbytes -= size
                needed -= size

    def close(self) -> None:
        self.evict(self.nbytes)


class SegmentViews:
    """Bytes of a rank's segments named by descriptor (segment, byte offset, bytes), as tensors
    over this process's own mapping of each segment, made at its first use: how the service
    reaches what a trainer names (a host's states, a file transfer's block)."""

    def __init__(self, segment_of: Callable[[int], tuple[int, int]]):
        """``segment_of``: a segment's descriptor and size, refused (TieredError) for a segment
        that is not the rank's; asked at every view, not only the first (a segment the rank
        released may be another job's by now), and never under this object's lock (it takes
        the registry's, whose holder may be closing these views)."""
        self._segment_of = segment_of
        self._mapped: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()

    def view(self, segment: int, at: int, nbytes: int) -> torch.Tensor:
        fd, size = self._segment_of(segment)
        with self._lock:
            mapping = self._mapped.get(segment)
        if mapping is None:
            made = map_segment(fd, size)
            with self._lock:
                mapping = self._mapped.setdefault(segment, made)
        if not (0 <= at and 0 < nbytes and at + nbytes <= mapping.numel()):
            raise TieredError(f"bytes {at}..{at + nbytes} are outside segment {segment} "
                              f"({mapping.numel()} bytes)")
        return mapping[at:at + nbytes]

    def forget(self, segment: int) -> None:
        """Drop the mapping of a segment the rank released (its pages go with the spare)."""
        with self._lock:
            self._mapped.pop(segment, None)

    def close(self) -> None:
        with self._lock:
            self._mapped.clear()
