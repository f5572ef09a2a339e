"""What autograd saves for backward, kept in DRAM instead of on the device (``activations.tier:
dram``): the activations as a tier.

[Note: activations in DRAM]
Every tensor a forward with grad saves for backward that is not a unit's weights passes through
the engine's outermost saved-tensor hooks (hooks.py; under non-reentrant activation
checkpointing, the checkpointed inputs are such tensors, the recomputed ones are the
checkpoint's). With ``activations.tier: dram``, one on the compute device of at least
``activations.min_bytes`` is copied into the plan's DRAM block for activations (the staging
buffer "activations", ``activations.dram_bytes`` of it, pinned and counted against the DRAM
budget like every block of the tier) and the device's copy is let go; its backward copies it
back. What does not fit the block stays on the device, as with ``tier: hbm``; what stays is
what the step's probe counts as its activations (``plan_report()``, the re-plan of ``tier:
auto``), so that offloaded bytes are not planned for on the device.

The block is a bump arena: each tensor takes the next free bytes, and the arena starts over
once no tensor in it is held any more (autograd drops what it saved once a backward used it,
or when its graph is freed). A retained graph keeps its tensors, and later forwards then fill
what is left after them.

Ordering on a device with streams (checked on the simulated accelerator in CI): the copy out
runs on the offload stream after the work queued on the compute stream (which produced the
tensor), and ``record_stream`` keeps the caching allocator from handing the device's copy to a
later allocation before it is read; the copy back runs on the compute stream once it waited for
the copy out's event. The arena starts over only after every copy back was queued on the
compute stream, and the next copy out waits for that stream: no copy back reads bytes a later
copy out writes.

With ``tier: auto`` they go to DRAM in the first step that runs a backward, which measures them
(the step's probe counts what went there); at its ``optimizer.step()`` they stay in DRAM for
good if they would not fit on the device beside the HBM tier's peak and 1/16 of its budget (the
re-plan's margin), else every later forward keeps them on the device, where nothing is copied.
The block stays pinned either way (the plan counted it). The re-plan of ``tier: auto``'s units
comes after, with the device's activations as they will be.

Ahead of need (``activations.prefetch_bytes``, on a device with streams): backward reads what
the forward saved in about the reverse of the order it was saved in. So once backward reaches
the output of the forward (before its last layers' gradients, and the loss's where the model
computes it, as Hugging Face's does given labels), the latest tensors that forward saved, and
each time backward reads a tensor in DRAM, the ones saved before it not read yet, are copied
back on the offload stream, nearest first, until the bytes copied back and not yet read reach
``prefetch_bytes``; a read finds its
tensor there, waits for its copy's event, and hands it to the compute stream (``record_stream``:
it was allocated on the offload stream). The copies back run on the offload stream behind the
copies out, which wrote what they read. One that is never read (its graph freed) is let go with
the saved tensor. Where streams are not (a CPU), there is nothing to overlap, and each tensor is
copied back as it is read.

With ``tier: nvme`` what the block cannot hold goes to a file on the drive instead of staying
on the device (see [Note: activations on NVMe] in activations_nvme.py).

The bits are the same as on the device: a copy is exact, and backward computes on what was
saved.
"""
from __future__ import annotations

import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from ..core.sizes import align_up, format_size
from ..planning.activations import SavedBytes
from ..policy.config import ActivationsPolicy
from ..policy.kinds import Tier
from .activations_nvme import NvmeSpill
from .streams import Streams

ALIGN = 64
"""Bytes each tensor's place in the arena is aligned to (a cache line; any dtype's size)."""


@dataclass(eq=False)
class _Placed:
    """A saved tensor's place off the device, handed to autograd in its stead; its place is
    let go when autograd lets go of it."""

    store: "SavedActivations"
    offset: int
    shape: torch.Size
    dtype: torch.dtype
    order: int
    """Its place among the tensors saved since the arena started over."""
    read: bool = False

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize

    def __del__(self):
        self.store._released(self)


@dataclass(eq=False)
class _InDram(_Placed):
    """In the DRAM block's arena, at ``offset``."""

    ready: object = None
    """The copy out's event, or None where there are no streams."""


@dataclass(eq=False)
class _OnNvme(_Placed):
    """In the file on the drive (tier: nvme), at ``offset``."""

    writes: list[Future] = field(default_factory=list)
    """Each piece's write (activations_nvme.NvmeSpill.write)."""


class SavedActivations:
    """The engine's saved-tensor store (see [Note: activations in DRAM])."""

    def __init__(self, policy: ActivationsPolicy, device: torch.device, streams: Streams,
                 arena: torch.Tensor | None, kept: SavedBytes, moved: SavedBytes,
                 spill: NvmeSpill | None, spilled: SavedBytes):
        """``arena``: the plan's DRAM block for activations (a uint8 tensor), None when the
        policy keeps them on the device; ``kept``: where what stays on the device is counted
        (the step's probe: what the re-plan and plan_report read as its activations);
        ``moved``: where what moves to DRAM is counted (plan_report's "in DRAM"); ``spill``:
        the file for what the arena cannot hold (tier: nvme), ``spilled`` where what goes there
        is counted."""
        self.device = device
        self.streams = streams
        self.min_bytes = policy.min_bytes
        self.arena = arena if policy.uses_dram else None
        self._placing = self.arena is not None
        """Whether new saved tensors go to the arena (tier: auto may stop it; what is there
        already is still read from it)."""
        self.deciding = policy.tier is Tier.AUTO
        """tier: auto, before the first measured step said where they stay."""
        self.outcome: str | None = None
        """Where tier: auto keeps them, and why, in a line (None before it decided)."""
        self.kept = kept
        self.moved = moved
        self.spill = spill
        self.spilled = spilled
        self.ahead_bytes = policy.prefetch_bytes if streams.offload is not None else 0
        self._used = 0
        self._saved: list[weakref.ref[_InDram | _OnNvme]] = []
        """The tensors in the arena and the file, in the order they were saved."""
        self._held = 0
        """Tensors in the arena or the file that autograd still holds."""
        self._generation = 0
        """How many times the arena and the file started over (a place in ``_saved`` is
        one generation's)."""
        self._fetched: dict[int, tuple[torch.Tensor, object]] = {}
        """By order: the tensors copied back ahead of need, each with its copy's event."""
        self._reading: set[int] = set()
        """By order: the tensors in the file being read back ahead of need."""
        self._fetched_bytes = 0
        self._next_fetch = -1
        """The latest-saved tensor not yet considered for a copy ahead."""
        self.offloaded_bytes = 0
        """Bytes copied to DRAM since the engine started."""
        self.fetched_ahead_bytes = 0
        """Bytes copied back ahead of need since the engine started."""
        self.reads_not_ahead = 0
        """Reads of a tensor in DRAM that found no copy made ahead of them, on a device with
        streams (their copy back was not overlapped) since the engine started."""

    def settle(self, in_dram: int, room: int, fits: bool) -> bool:
        """tier: auto after its first measured step: keep later forwards' tensors on the device
        when the ``in_dram`` bytes one forward put in DRAM fit the device's ``room`` on every
        rank (``fits``); whether they now stay on the device."""
        self.deciding = False
        self._placing = not fits
        where = "on the device from the next step" if fits else "in DRAM"
        self.outcome = (f"activations (tier: auto): {format_size(in_dram)} a forward, "
                        f"{format_size(max(room, 0))} free on the device beside the plan: "
                        f"{where}")
        return fits

    def pack(self, tensor: torch.Tensor):
        """What autograd keeps for ``tensor``: its place in DRAM or on the drive, or the tensor
        itself."""
        if not self._moves(tensor):
            self.kept.add(tensor)
            return tensor
        nbytes = tensor.numel() * tensor.element_size()
        if self._held == 0:  # nothing in the arena or the file is held: both start over
            self._used = 0
            self._saved.clear()
            self._generation += 1
            if self.spill is not None:
                self.spill.start_over()
        place = self._arena_place(nbytes)
        packed: _InDram | _OnNvme
        if place is not None:
            packed = self._to_dram(tensor, place, nbytes)
        elif self.spill is not None and (offset := self.spill.place(nbytes)) is not None:
            packed = _OnNvme(self, offset, tensor.shape, tensor.dtype, len(self._saved),
                             writes=self.spill.write(tensor, offset))
            self.spilled.add_copy(nbytes)
        else:
            self.kept.add(tensor)
            return tensor
        self._held += 1
        self._saved.append(weakref.ref(packed))
        self._next_fetch = len(self._saved) - 1
        return packed

    def _to_dram(self, tensor: torch.Tensor, place: int, nbytes: int) -> _InDram:
        assert self.arena is not None
        host = self.arena[place:place + nbytes].view(tensor.dtype).view(tensor.shape)
        with self.streams.on_offload():
            host.copy_(tensor, non_blocking=True)
            ready = self.streams.record()
        self.streams.keep_for_offload(tensor)
        self.moved.add_copy(nbytes)
        self.offloaded_bytes += nbytes
        return _InDram(self, place, tensor.shape, tensor.dtype, len(self._saved), ready=ready)

    @property
    def copies_ahead(self) -> bool:
        """Whether what forwards save now goes off the device and backward's reads are copied
        back ahead of need (tier dram or nvme, or auto before it settled on the device, on a
        device with streams)."""
        return bool(self.ahead_bytes) and self._placing

    def top(self) -> tuple[int, int]:
        """Where the latest saved tensor is: the generation of the arena and how many it
        holds (what a forward's backward copies back ahead from: backward_begins)."""
        return self._generation, len(self._saved)

    def backward_begins(self, top: tuple[int, int]) -> None:
        """A backward reached the output of the forward that ended with the store at ``top``:
        copy back ahead what it reads first, that forward's latest saved tensors, while the
        backward runs back through the model's last layers (and the loss where the model
        computes it) before any read asks. Nothing once the arena started over since."""
        generation, count = top
        if self.ahead_bytes and generation == self._generation:
            # Reads move the next copy down only; a new backward reads down from its top,
            # above where an earlier backward's (another forward's) left it.
            self._next_fetch = count - 1
            self._fetch_ahead()

    def unpack(self, packed):
        if isinstance(packed, _OnNvme):
            assert self.spill is not None  # only it makes them
            if packed.order in self._reading:
                self._reading.discard(packed.order)
                self._fetched_bytes -= packed.nbytes
            back = self.spill.read_back(packed.order, packed.offset, packed.shape, packed.dtype,
                                        packed.writes)
        elif not isinstance(packed, _InDram):
            return packed
        else:
            back = self._dram_back(packed)
        packed.read = True
        self._next_fetch = min(self._next_fetch, packed.order - 1)
        self._fetch_ahead()
        return back

    def _dram_back(self, packed: _InDram) -> torch.Tensor:
        fetched = self._fetched.pop(packed.order, None)
        if fetched is None:
            if packed.ready is not None:
                self.reads_not_ahead += 1
                self._wait(packed.ready)
            return self._copy_back(packed)
        back, ready = fetched
        self._fetched_bytes -= packed.nbytes
        self._wait(ready)
        self.streams.accelerator.record_stream(back, self.streams.accelerator.current_stream())
        return back

    def _wait(self, ready) -> None:
        """The compute stream waits for a copy on the offload stream (``ready``: its event)."""
        self.streams.accelerator.current_stream().wait_event(ready)

    def _fetch_ahead(self) -> None:
        """Copy back, on the offload stream, the tensors saved at ``_next_fetch`` and before
        that are not read yet, nearest first, up to ``ahead_bytes`` copied and not yet read;
        those on the drive are read into the spill's slots (a tensor it cannot start yet waits
        for a later read, and the ones saved before it with it)."""
        while self._next_fetch >= 0 and self._fetched_bytes < self.ahead_bytes:
            packed = self._saved[self._next_fetch]()
            if (packed is None or packed.read or packed.order in self._fetched
                    or packed.order in self._reading):
                self._next_fetch -= 1
                continue
            if isinstance(packed, _OnNvme):
                assert self.spill is not None
                if not self.spill.read_ahead(packed.order, packed.offset, packed.nbytes,
                                             packed.writes):
                    return
                self._reading.add(packed.order)
            else:
                with self.streams.on_offload():  # behind the copy out that wrote it
                    self._fetched[packed.order] = (self._copy_back(packed),
                                                   self.streams.record())
            self._next_fetch -= 1
            self._fetched_bytes += packed.nbytes
            self.fetched_ahead_bytes += packed.nbytes

    def _copy_back(self, packed: _InDram) -> torch.Tensor:
        """A device tensor the copy of ``packed``'s bytes in the arena is queued into, on the
        current stream."""
        assert self.arena is not None
        host = self.arena[packed.offset:packed.offset + packed.nbytes]
        back = torch.empty(packed.shape, dtype=packed.dtype, device=self.device)
        return back.copy_(host.view(packed.dtype).view(packed.shape), non_blocking=True)

    def _moves(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` leaves the device (the arena's, or the file's where it has no
        room)."""
        return (self._placing and type(tensor) is torch.Tensor and tensor.device == self.device
                and tensor.layout is torch.strided
                and tensor.numel() * tensor.element_size() >= self.min_bytes)

    def _arena_place(self, nbytes: int) -> int | None:
        """The arena offset ``nbytes`` take, or None when they do not fit."""
        assert self.arena is not None  # placing implies the block
        place = align_up(self._used, ALIGN)
        if place + nbytes > self.arena.numel():
            return None
        self._used = place + nbytes
        return place

    def _released(self, packed: _Placed) -> None:
        self._held -= 1
        if isinstance(packed, _OnNvme):
            if packed.order in self._reading:  # read back ahead, never read
                self._reading.discard(packed.order)
                self._fetched_bytes -= packed.nbytes
            assert self.spill is not None
            self.spill.drop(packed.order)
        elif self._fetched.pop(packed.order, None) is not None:  # copied back, never read
            self._fetched_bytes -= packed.nbytes

    def close(self) -> None:
        """The engine closes: the drive's writes and reads in flight end first."""
        if self.spill is not None:
            self.spill.close()
