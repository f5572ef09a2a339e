"""The NVMe I/O engine: each transfer split into blocks, many blocks in flight, reads and writes
on separate thread pools.

``os.preadv``/``os.pwritev`` release the GIL, so a pool of threads keeps as many requests in
flight as it has threads (the queue depth), enough to reach what an NVMe drive can do with
requests of ``block_size``; a transfer is a handle to wait on or poll. A request that fails, or
moves fewer bytes than asked (on an O_DIRECT file that means the device gave up), raises
``NvmeError`` naming the file, offset and size when the transfer is waited for.

``inject_faults`` is a seam for tests: a function called before every request that may raise an
``OSError`` (ENOSPC, EIO) or return a short byte count, exercising the real error paths above.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno as errno_codes
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch

from ..core.errors import NvmeError

_fault: Callable[[str, str, int, int], int | None] | None = None


@contextlib.contextmanager
def inject_faults(fault: Callable[[str, str, int, int], int | None]):
    """Within the block, ``fault(verb, path, offset, size)`` runs before each request: it may
    raise an OSError, or return a byte count to report instead of the real one."""
    global _fault
    previous, _fault = _fault, fault
    try:
        yield
    finally:
        _fault = previous


def host_buffer(tensor: torch.Tensor, nbytes: int) -> memoryview:
    """A writable byte view of the first ``nbytes`` of a CPU tensor (no numpy needed)."""
    assert tensor.device.type == "cpu" and tensor.is_contiguous()
    assert nbytes <= tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


@dataclass(frozen=True)
class IoSettings:
    block_size: int
    """Bytes per request (a multiple of 4096)."""
    queue_depth: int
    """Requests in flight per direction (threads of each pool)."""


class Countdown:
    """Calls ``on_zero()`` once ``count`` events have been counted, on the thread that counted
    the last one (events finish on I/O threads in any order)."""

    def __init__(self, count: int, on_zero: Callable[[], None]):
        self._left = count
        self._lock = threading.Lock()
        self._on_zero = on_zero
        if count == 0:
            on_zero()

    def count(self) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._on_zero()


class Transfer:
    """The blocks of one read or write; :meth:`wait` raises the first failure."""

    def __init__(self, blocks: list[Future]):
        self._blocks = blocks

    @classmethod
    def joined(cls, transfers: list["Transfer"]) -> "Transfer":
        """One transfer of all of ``transfers``' blocks: waiting for it settles every one before
        raising the first failure (the states of one piece share a staging set)."""
        return cls([block for transfer in transfers for block in transfer._blocks])

    def done(self) -> bool:
        return all(block.done() for block in self._blocks)

    def on_done(self, callback: Callable[[BaseException | None], None]) -> None:
        """Call ``callback(first failure or None)`` once every block has finished (on the
        thread that finished the last one, or now if all have)."""
        countdown = Countdown(len(self._blocks), lambda: callback(self._first_failure()))
        for block in self._blocks:
            block.add_done_callback(lambda _block: countdown.count())

    def settle(self) -> None:
        """Wait until no block is in flight, without raising (for clean-up after a failure)."""
        for block in self._blocks:
            block.exception()

    def wait(self) -> None:
        self.settle()  # every block, so no buffer is still in use when a failure is raised
        failure = self._first_failure()
        if failure is not None:
            raise failure

    def _first_failure(self) -> BaseException | None:
        return next((b.exception() for b in self._blocks if b.exception()), None)


class IoQueue:
    """The threads that carry out requests, ``depth`` for reads and as many for writes: an
    engine's own, or one that several engines share, so that the drive sees one queue of that
    depth however many tiers use it (the node's service: one for every rank's files)."""

    def __init__(self, depth: int):
        self.depth = depth
        self.readers = ThreadPoolExecutor(depth, "tiered-nvme-read")
        self.writers = ThreadPoolExecutor(depth, "tiered-nvme-write")

    def close(self) -> None:
        self.readers.shutdown(wait=True)
        self.writers.shutdown(wait=True)


class IoEngine:
    def __init__(self, settings: IoSettings, queue: IoQueue | None = None):
        """``queue``: a queue shared with other engines (its depth, not the settings', bounds
        the requests in flight); by default one of the engine's own, closed with it."""
        self.settings = settings
        self._queue = queue or IoQueue(settings.queue_depth)
        self._owns_queue = queue is None
        self._moved = {"read": 0, "write": 0}
        self._in_flight = 0
        self._moved_lock = threading.Condition()  # transfers start on several threads

    def bytes_moved(self) -> dict[str, int]:
        """Bytes of every transfer started so far, by verb ("read", "write"): what a step's
        I/O floor is computed from."""
        with self._moved_lock:
            return dict(self._moved)

    def in_flight(self) -> int:
        """Requests queued or moving (the service's status shows each rank's queue)."""
        with self._moved_lock:
            return self._in_flight

    def read(self, fd: int, path: str, offset: int, buffer: memoryview) -> Transfer:
        """Start reading ``len(buffer)`` bytes at ``offset`` of the file into ``buffer``."""
        return self._split(self._queue.readers, os.preadv, "read", fd, path, offset, buffer)

    def write(self, fd: int, path: str, offset: int, buffer: memoryview) -> Transfer:
        """Start writing ``buffer`` at ``offset`` of the file."""
        return self._split(self._queue.writers, os.pwritev, "write", fd, path, offset, buffer)

    def close(self) -> None:
        """Wait for this engine's requests, and close its queue if it is its own."""
        if self._owns_queue:
            self._queue.close()
            return
        with self._moved_lock:
            self._moved_lock.wait_for(lambda: self._in_flight == 0)

    def _split(self, pool, syscall, verb, fd, path, offset, buffer) -> Transfer:
        step = self.settings.block_size
        with self._moved_lock:
            self._moved[verb] += len(buffer)
        blocks = []
        for start in range(0, len(buffer), step):
            block = pool.submit(_request, syscall, verb, fd, path, offset + start,
                                buffer[start:start + step])
            with self._moved_lock:  # counted once submitted: a refused submit is not in flight
                self._in_flight += 1
            block.add_done_callback(self._finished)
            blocks.append(block)
        return Transfer(blocks)

    def _finished(self, _block) -> None:
        with self._moved_lock:
            self._in_flight -= 1
            self._moved_lock.notify_all()


def _request(syscall, verb: str, fd: int, path: str, offset: int, view: memoryview) -> None:
    size = len(view)
    try:
        moved = _fault(verb, path, offset, size) if _fault is not None else None
        if moved is None:
            moved = syscall(fd, [view], offset)
    except OSError as e:
        raise NvmeError(f"NVMe {verb} failed on {path} at offset {offset}, size {size}: "
                        f"{e.strerror}", errno=e.errno, path=path, offset=offset,
                        size=size) from None
    if moved != size:
        raise NvmeError(f"NVMe {verb} on {path} at offset {offset}, size {size} moved only "
                        f"{moved} bytes", errno=errno_codes.EIO, path=path, offset=offset,
                        size=size)
