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

The bits are the same as on the device: a copy is exact, and backward computes on what was
saved.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.sizes import align_up
from ..planning.activations import SavedBytes
from ..policy.config import ActivationsPolicy, Tier
from .streams import Streams

ALIGN = 64
"""Bytes each tensor's place in the arena is aligned to (a cache line; any dtype's size)."""


@dataclass
class _InDram:
    """A saved tensor's place in the arena, handed to autograd in its stead."""

    store: "SavedActivations"
    offset: int
    shape: torch.Size
    dtype: torch.dtype
    ready: object  # the copy out's event, or None where there are no streams

    def __del__(self):
        self.store._released()


class SavedActivations:
    """The engine's saved-tensor store (see [Note: activations in DRAM])."""

    def __init__(self, policy: ActivationsPolicy, device: torch.device, streams: Streams,
                 arena: torch.Tensor | None, kept: SavedBytes):
        """``arena``: the plan's DRAM block for activations (a uint8 tensor), None when the
        policy keeps them on the device; ``kept``: where what stays on the device is counted
        (the step's probe: what the re-plan and plan_report read as its activations)."""
        self.device = device
        self.streams = streams
        self.min_bytes = policy.min_bytes
        self.arena = arena if policy.tier is Tier.DRAM else None
        self.kept = kept
        self._used = 0
        self._held = 0
        """Tensors in the arena that autograd still holds."""
        self.offloaded_bytes = 0
        """Bytes copied to DRAM since the engine started."""

    def pack(self, tensor: torch.Tensor):
        """What autograd keeps for ``tensor``: its place in DRAM, or the tensor itself."""
        place = self._place_for(tensor)
        if place is None:
            self.kept.add(tensor)
            return tensor
        assert self.arena is not None
        nbytes = tensor.numel() * tensor.element_size()
        host = self.arena[place:place + nbytes].view(tensor.dtype).view(tensor.shape)
        with self.streams.on_offload():
            host.copy_(tensor, non_blocking=True)
            ready = self.streams.record()
        self.streams.keep_for_offload(tensor)
        self.offloaded_bytes += nbytes
        self._held += 1
        return _InDram(self, place, tensor.shape, tensor.dtype, ready)

    def unpack(self, packed):
        if not isinstance(packed, _InDram):
            return packed
        assert self.arena is not None
        nbytes = packed.shape.numel() * packed.dtype.itemsize
        host = self.arena[packed.offset:packed.offset + nbytes].view(packed.dtype)
        if packed.ready is not None:
            self.streams.accelerator.current_stream().wait_event(packed.ready)
        back = torch.empty(packed.shape, dtype=packed.dtype, device=self.device)
        back.copy_(host.view(packed.shape), non_blocking=True)
        return back

    def _place_for(self, tensor: torch.Tensor) -> int | None:
        """The arena offset ``tensor`` takes, or None when it stays where it is."""
        if (self.arena is None or type(tensor) is not torch.Tensor
                or tensor.device != self.device or tensor.layout is not torch.strided):
            return None
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes < self.min_bytes:
            return None
        if self._held == 0:
            self._used = 0
        place = align_up(self._used, ALIGN)
        if place + nbytes > self.arena.numel():
            return None
        self._used = place + nbytes
        return place

    def _released(self) -> None:
        self._held -= 1
