"""Saved tensors past the DRAM block, on the drive (``activations.tier: nvme``).

[Note: activations on NVMe]
With ``activations.tier: nvme`` the store ([Note: activations in DRAM]) fills the DRAM block
first, as with ``dram``; a saved tensor the block cannot hold goes to the plan's file for them
(tiers/scratch.py: ``activations.nvme_bytes`` reserved under ``nvme.path`` when the engine
starts, in a run folder of this process's own), and what fits neither stays on the device. The
file is a bump arena too, at block-aligned places (O_DIRECT), started over with the block once
no tensor in either is held: what a released tensor took is written over by later forwards, and
the file goes with the engine's close (or the process: a dead run's folder is removed by the
next run on the path, as the NVMe tier's).

Bytes cross between the device and the drive through pinned slots (the plan's staging buffer
"activations_io", plan.activation_slots): each one full queue of the I/O engine's requests.
- Out, as the forward saves: a tensor's bytes are copied into a slot a piece at a time on the
  offload stream (after the compute stream's work that made them), and one writer thread waits
  for each copy's event and writes the slot to the tensor's place in the file. The forward goes
  on meanwhile; it waits only for a slot, which is free again once its write is done. One thread
  writes in the order of the saves, so a write to a place the arena started over on comes after
  every earlier write there.
- Back, as backward reads: its writes are waited for (one that failed fails the read, naming
  it), the pieces are read into as many free slots as there are, and each is copied to the
  device on the compute stream as its read completes; a slot is reused once that copy's event
  has completed. On a device with streams, each read of a saved tensor starts reading the ones
  saved before it (nearest first, within ``activations.prefetch_bytes`` with the DRAM block's
  copies ahead) into free slots whose last use is over, keeping one slot for the read that
  cannot wait; a tensor whose writes are still in flight, or that no free slots hold whole,
  waits for a later read. Without streams (a CPU) each is read as backward reads it.
A read that fails raises an NvmeError naming the tensor and the file, every slot given back
(a slot whose read is still in flight is reused once it is done; close waits for it); nothing
of the step is half-done on the drive, which holds only this step's tensors.
"""
from __future__ import annotations

import collections
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..core.errors import NvmeError
from ..core.sizes import align_up, format_size
from ..device import EventLike
from ..tiers.aio import Transfer
from ..tiers.dram import BLOCK_ALIGN
from ..tiers.scratch import ScratchFile
from .streams import Streams


_Use = Future | Transfer | EventLike | None
"""A slot's last use: a write's future, a read's transfer, or the event of a copy out of it on
a stream (None: nothing)."""


@dataclass
class _Piece:
    """Bytes ``start`` to ``start + size`` of a tensor, being read into ``slot``."""

    slot: int
    start: int
    size: int
    transfer: Transfer


class NvmeSpill:
    """The file's arena and the slots its bytes pass through (see [Note: activations on
    NVMe]); the store asks it by each tensor's place among the saves (``key``)."""

    def __init__(self, file: ScratchFile, staging: torch.Tensor, slot_bytes: int,
                 streams: Streams, device: torch.device):
        self.file = file
        self.streams = streams
        self.device = device
        self.slot_bytes = slot_bytes
        self._slots = [staging[i * slot_bytes:(i + 1) * slot_bytes]
                       for i in range(staging.numel() // slot_bytes)]
        self._free = collections.deque(range(len(self._slots)))
        self._last: list[_Use] = [None] * len(self._slots)
        """Per slot, its last use, over before the slot is reused."""
        self._ahead: dict[int, list[_Piece]] = {}
        """By key: the reads started ahead of need, not yet taken."""
        self._writer = ThreadPoolExecutor(1, "tiered-activations-out")
        self._used = 0
        self.written_bytes = 0
        """Bytes of saved tensors written to the drive since the engine started."""
        self.read_ahead_bytes = 0
        """Bytes of them whose reads back started ahead of need since the engine started."""

    def place(self, nbytes: int) -> int | None:
        """The file's offset ``nbytes`` take, or None when the file cannot hold them."""
        if self._used + nbytes > self.file.nbytes:
            return None
        place, self._used = self._used, self._used + align_up(nbytes, BLOCK_ALIGN)
        return place

    def start_over(self) -> None:
        """No tensor in the file is held any more: the arena starts over."""
        self._used = 0

    def write(self, tensor: torch.Tensor, offset: int) -> list[Future]:
        """Start writing ``tensor`` at ``offset``: the future of each piece's write."""
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        writes = []
        for start in range(0, data.numel(), self.slot_bytes):
            size = min(self.slot_bytes, data.numel() - start)
            slot = self._take()
            with self.streams.on_offload():
                self._slots[slot][:size].copy_(data[start:start + size], non_blocking=True)
                ready = self.streams.record()
            write = self._writer.submit(self._write, ready, slot, offset + start, size)
            self._release(slot, write)
            writes.append(write)
        self.streams.keep_for_offload(data)
        self.written_bytes += data.numel()
        return writes

    def read_ahead(self, key: int, offset: int, nbytes: int, writes: list[Future]) -> bool:
        """Start reading the tensor at ``offset`` into free slots, if its writes are done and
        free slots whose last use is over hold it whole beside one kept free; whether it
        started."""
        pieces = -(-nbytes // self.slot_bytes)
        if (not all(write.done() and write.exception() is None for write in writes)
                or len(self._free) <= pieces
                or not all(_over(self._last[slot]) for slot in list(self._free)[:pieces])):
            return False
        self._ahead[key] = [self._start_read(self._take(), offset, start,
                                             min(self.slot_bytes, nbytes - start))
                            for start in range(0, nbytes, self.slot_bytes)]
        self.read_ahead_bytes += nbytes
        return True

    def read_back(self, key: int, offset: int, shape: torch.Size, dtype: torch.dtype,
                  writes: list[Future]) -> torch.Tensor:
        """The tensor at ``offset``, read back onto the device (queued on the current stream)."""
        nbytes = shape.numel() * dtype.itemsize
        for write in writes:
            failure = write.exception()
            if failure is not None:
                self.drop(key)
                raise self._failed("was not written to", shape, dtype, failure)
        back = torch.empty(shape, dtype=dtype, device=self.device)
        data = back.view(-1).view(torch.uint8)
        pieces = collections.deque(self._ahead.pop(key, []))
        start = pieces[-1].start + pieces[-1].size if pieces else 0
        try:
            while pieces or start < nbytes:
                # Reads in flight in as many free slots as there are, one at least.
                while start < nbytes and (not pieces or self._free and _over(
                        self._last[self._free[0]])):
                    size = min(self.slot_bytes, nbytes - start)
                    pieces.append(self._start_read(self._take(), offset, start, size))
                    start += size
                piece = pieces.popleft()
                try:
                    piece.transfer.wait()
                except NvmeError as failure:
                    self._release(piece.slot, None)
                    raise self._failed("could not be read back from", shape, dtype,
                                       failure) from None
                data[piece.start:piece.start + piece.size].copy_(
                    self._slots[piece.slot][:piece.size], non_blocking=True)
                self._release(piece.slot, self.streams.record())
        except BaseException:
            for piece in pieces:  # in flight: their slots are reused once they are done
                self._release(piece.slot, piece.transfer)
            raise
        return back

    def drop(self, key: int) -> None:
        """The tensor of ``key`` was let go: the slots of its reads ahead come back."""
        for piece in self._ahead.pop(key, []):
            self._release(piece.slot, piece.transfer)

    def close(self) -> None:
        """Wait for every write and read in flight (the slots are the DRAM tier's)."""
        self._writer.shutdown(wait=True)
        for pieces in self._ahead.values():
            for piece in pieces:
                piece.transfer.settle()
        self._ahead.clear()

    def _take(self) -> int:
        """A free slot, once its last use is over."""
        assert self._free, "every activations_io slot is held by reads ahead"
        slot = self._free.popleft()
        _settle(self._last[slot])
        return slot

    def _release(self, slot: int, use: _Use) -> None:
        self._last[slot] = use
        self._free.append(slot)

    def _start_read(self, slot: int, offset: int, start: int, size: int) -> _Piece:
        return _Piece(slot, start, size, self.file.read(offset + start, self._slots[slot],
                                                        align_up(size, BLOCK_ALIGN)))

    def _write(self, ready, slot: int, offset: int, size: int) -> None:
        """On the writer thread: once the copy into ``slot`` is done, write it to the file."""
        if ready is not None:
            ready.synchronize()
        self.file.write(offset, self._slots[slot], align_up(size, BLOCK_ALIGN)).wait()

    def _failed(self, what: str, shape: torch.Size, dtype: torch.dtype,
                failure: BaseException) -> NvmeError:
        nbytes = shape.numel() * dtype.itemsize
        return NvmeError(
            f"activations.tier: nvme: a tensor the forward saved for backward "
            f"({'x'.join(map(str, shape)) or 'a scalar'} {str(dtype).removeprefix('torch.')}, "
            f"{format_size(nbytes)}) {what} {self.file.path}: {failure}",
            errno=getattr(failure, "errno", None), path=self.file.path,
            offset=getattr(failure, "offset", None), size=getattr(failure, "size", None))


def _over(use: _Use) -> bool:
    """Whether a slot's last use is over (without waiting)."""
    if use is None:
        return True
    if isinstance(use, (Future, Transfer)):
        return use.done()
    return use.query()  # an event


def _settle(use: _Use) -> None:
    """Wait until a slot's last use is over (its failure is its reader's to raise)."""
    if isinstance(use, Future):
        use.exception()
    elif isinstance(use, Transfer):
        use.settle()
    elif use is not None:
        use.synchronize()  # an event
