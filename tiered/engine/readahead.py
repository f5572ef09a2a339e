"""NVMe weights read into pinned DRAM ahead of their gather, on an I/O thread.

A small ring of pinned buffers (``prefetch.dram_bytes`` of them, at least one) holds shards read
from their files. A buffer goes back to the ring with the event of the host-to-device copy that
reads it; the I/O thread waits for that event before reading the next shard into it, so a copy
in flight is never overwritten.
"""
from __future__ import annotations

import queue
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..core.timeline import Timeline
from ..device import EventLike
from ..placement.manager import TierManager
from .pending import PendingWeights


@dataclass(frozen=True)
class Landed:
    slot: str
    tensor: torch.Tensor
    """The unit's weight shard, in the pinned buffer ``slot``."""


class ReadAhead:
    def __init__(self, manager: TierManager, slots: list[str], pending: PendingWeights,
                 timeline: Timeline):
        self.manager = manager
        self.pending = pending
        """A shard an update is still writing is read once written."""
        self.timeline = timeline
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        for slot in slots:
            self._free.put((slot, None))
        self._reads: dict[int, Future] = {}
        self._io = ThreadPoolExecutor(1, thread_name_prefix="tiered-nvme-read")

    def read_ahead(self, index: int) -> bool:
        """Start reading unit ``index`` if a buffer is free; False when none is."""
        if index in self._reads:
            return True
        try:
            slot, busy_until = self._free.get_nowait()
        except queue.Empty:
            return False
        self._reads[index] = self._io.submit(self._read, index, slot, busy_until)
        return True

    def take(self, index: int) -> Landed:
        """Unit ``index``'s shard in a pinned buffer (read now, waiting for a buffer, if it was
        not read ahead); hand the buffer back with :meth:`give_back`."""
        future = self._reads.pop(index, None)
        if future is None:
            slot, busy_until = self._free_slot()
            future = self._io.submit(self._read, index, slot, busy_until)
        return future.result()

    def _free_slot(self):
        """A free buffer; when reads ahead hold them all, the furthest ahead gives its up (it
        will be read again when its turn comes)."""
        try:
            return self._free.get_nowait()
        except queue.Empty:
            if not self._reads:
                return self._free.get()  # every buffer is in a copy that is about to finish
        furthest = self._reads.pop(next(reversed(self._reads)))
        try:
            return furthest.result().slot, None
        except Exception:  # that unit's error, not this caller's: it gave its buffer back
            return self._free.get()

    def give_back(self, landed: Landed, busy_until: EventLike | None) -> None:
        self._free.put((landed.slot, busy_until))

    def discard(self) -> None:
        """Drop reads that were started but will not be used. A read that failed gave its
        buffer back already, and its error (an I/O error, or the worker's while it waited for
        an update) is not this caller's: nothing read it."""
        for future in self._reads.values():
            if future.exception() is None:
                self.give_back(future.result(), None)
        self._reads.clear()

    def close(self) -> None:
        self.discard()
        self._io.shutdown(wait=True)

    def _read(self, index: int, slot: str, busy_until: EventLike | None) -> Landed:
        if busy_until is not None:
            busy_until.synchronize()
        try:
            self.pending.wait(index)
            with self.timeline.span(f"nvme read unit {index}", "nvme"):
                return Landed(slot, self.manager.read_param(index, slot))
        except BaseException:
            self._free.put((slot, None))  # nothing was copied out of it
            raise
