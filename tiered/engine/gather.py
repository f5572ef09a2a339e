"""Gathering units: a unit's full weights on the device, from its shard wherever it lives.

``start`` issues the gather (on the gather stream, see [Note: gather stream] in streams.py) and
may run well ahead of need; ``finish`` makes the unit usable on the compute stream, starting the
gather first if nobody did. On the CPU both happen at ``start``, in program order.
"""
from __future__ import annotations

import torch

from ..device import EventLike, wait_for
from ..placement.plan import StateKind
from ..policy.kinds import Tier
from .context import EngineContext
from .flat import FlatParam, Residency
from .pending import PendingWeights
from .quantized import gather_record
from .readahead import ReadAhead


class Gatherer:
    def __init__(self, context: EngineContext, readahead: ReadAhead | None,
                 pending: PendingWeights):
        self.flats = context.flats
        self.pending = pending
        """A shard an update is still writing is read once written."""
        self.timeline = context.timeline
        self.manager = context.manager
        self.group = context.group
        self.streams = context.streams
        self.readahead = readahead
        self._by_storage: dict[int, FlatParam] = {}
        """Storage address of each gathered unit's ``full``, to recognise views of it. An entry
        may outlive its unit's gather (see [Note: releases cut short]); ``owner_of`` checks."""
        self._ready: dict[int, EventLike] = {}
        """Units whose gather was issued on the gather stream and not yet waited for."""
        self.on_gather = None
        """Called with each unit index when its gather is issued (tests record the order)."""

    @property
    def usage(self):
        return self.manager.hbm.usage

    def is_gathered(self, index: int) -> bool:
        return self.flats[index].residency is Residency.GATHERED

    def start(self, flat: FlatParam) -> None:
        """Issue the gather of ``flat`` (nothing if it is gathered or on its way)."""
        if flat.residency is Residency.GATHERED:
            return
        index = flat.spec.index
        self.usage.acquire(flat.gathered_bytes, f"gathered unit {flat.name}")
        if self.on_gather is not None:
            self.on_gather(index)
        landed = event = None
        try:
            self.pending.wait(index)
            if self.manager.tier_of(index, StateKind.PARAM) is Tier.NVME:
                assert self.readahead is not None  # made where any weights are on NVMe
                landed = self.readahead.take(index)  # this rank's shard, read from NVMe
                source = landed.tensor
            else:
                source = self.manager.load(index, StateKind.PARAM)
            with self.streams.on_gather():
                begin = self.timeline.mark()
                full = flat.allocate()
                try:
                    if flat.record is not None:  # a quantized record's bytes, dequantized
                        gather_record(flat, full, source, self.group)
                    else:
                        mine = flat.own_shard(full)
                        mine.copy_(source, non_blocking=True)
                        self.group.all_gather(full, mine)
                except BaseException:
                    flat.abandon()  # the all-gather may still write into it
                    raise
                finally:
                    # Also when the all-gather raised: the copy out of a read-ahead buffer may
                    # be queued, and the buffer goes back with this event.
                    event = self.streams.record()
                self.timeline.between(f"gather {flat.name}", "h2d", "gather stream", begin,
                                      self.timeline.mark())
        except BaseException:
            if flat.residency is Residency.GATHERED:
                flat.free()
            self.usage.release(flat.gathered_bytes)
            raise
        finally:
            if landed is not None:  # the buffer is free once the copy that reads it is done
                assert self.readahead is not None
                self.readahead.give_back(landed, event)
        if event is not None:
            self._ready[index] = event
        if full.numel():  # every empty storage has address 0: a view of one is no unit's
            self._by_storage[_address(flat)] = flat

    def finish(self, flat: FlatParam) -> None:
        """Make ``flat`` usable by the compute stream, gathering it now if needed."""
        self.start(flat)
        event = self._ready.pop(flat.spec.index, None)
        # The compute stream waits, and owns the buffer from here on.
        wait_for(self.streams.accelerator, event, flat.full, on_device=True)

    def release(self, flat: FlatParam) -> None:
        """Free ``flat``'s gathered weights.

        [Note: releases cut short]
        A stop signal raises its KeyboardInterrupt or SystemExit between any two lines, also
        inside a release, and the engine is then shut down at exit, which releases every unit
        left gathered. A unit whose storage was already shrunk is still GATHERED then, and its
        address reads 0: the shutdown failed on the missing entry (a traceback on Ctrl-C, one
        CI run in many). So a release forgets the entry only if it is there, and ``owner_of``
        trusts an entry only while its unit still holds that storage: a stale one is harmless.
        """
        if flat.residency is Residency.GATHERED:
            self._ready.pop(flat.spec.index, None)
            self._by_storage.pop(_address(flat), None)
            flat.free()
            self.usage.release(flat.gathered_bytes)

    def release_all(self) -> None:
        for flat in self.flats:
            self.release(flat)

    def owner_of(self, tensor: torch.Tensor) -> FlatParam | None:
        """The gathered unit whose weights ``tensor`` is a view of, if any."""
        if tensor.layout is not torch.strided:
            return None
        address = tensor.untyped_storage().data_ptr()
        flat = self._by_storage.get(address)
        if flat is None or flat.residency is not Residency.GATHERED or _address(flat) != address:
            return None
        return flat


def _address(flat: FlatParam) -> int:
    """Where ``flat``'s gathered weights live; 0 when its storage is empty."""
    return flat.full.untyped_storage().data_ptr()
