"""The DRAM slab source a training rank takes its pinned memory from, over its channel to the
node's service (channel.py).

A rank attaches once, as (job, rank, world), and keeps its connection for the engine's life:
the connection is how the service knows the trainer lives. ``close(clean=True)`` (from
``engine.close()``) ends the job's part on this rank cleanly and frees it; a trainer that dies,
or ends without ``engine.close()``, drops the connection and the service keeps its state for
the keep time (jobs.py, [Note: job lifecycle]).
"""
from __future__ import annotations

import os
import threading

import torch

from ..device import Accelerator
from .channel import Channel
from .identity import this_code
from .paths import ServiceError
from .segments import map_segment

class EngineSlots:
    """Which engines of this process are open at the service, per job: each is its own job
    there (jobs.py, [Note: job lifecycle]), named by its place, the lowest free one. A process
    that builds its engines in the same order after a crash finds each one's kept state."""

    def __init__(self):
        self._lock = threading.Lock()
        self._open: dict[str, set[int]] = {}

    def take(self, job: str) -> int:
        with self._lock:
            taken = self._open.setdefault(job, set())
            slot = next(slot for slot in range(len(taken) + 1) if slot not in taken)
            taken.add(slot)
            return slot

    def give_back(self, job: str, slot: int) -> None:
        with self._lock:
            self._open[job].discard(slot)


ENGINE_SLOTS = EngineSlots()


class ServiceSlabSource:
    """DRAM slabs (tiers/dram.py's SlabSource) carved from segments the service reserves for
    this rank: the service's memory, mapped here and registered here with the device whose
    copies use it (on a GPU, with CUDA)."""

    def __init__(self, client: Channel, job: str, rank: int, world: int,
                 device: Accelerator, fresh: bool = False, engine: int | None = None):
        """``device``: as PinnedSlabSource's. ``fresh``: a state the service kept of the job
        is freed, never taken over.
        ``engine``: this engine's place among the process's open ones; None takes the lowest
        free one (a test that plays several processes names it)."""
        self.client = client
        self.rank = rank
        self.device = device
        self._slot = (job, ENGINE_SLOTS.take(job)) if engine is None else None
        try:
            reply, _ = client.request("attach", job=job, rank=rank, world=world, fresh=fresh,
                                      engine=engine if self._slot is None else self._slot[1],
                                      code=this_code().to_wire())
        except BaseException:
            self._give_back_slot()
            raise
        self.job: str = reply.get("job", job)
        """The job the service holds this rank's part under: the launcher's name, or for a
        process's second and later open engines ``NAME#k``."""
        self.note: str = reply.get("note", "")
        """What the service said on attaching (a kept state it freed), for the trainer's log."""
        self.kept: dict | None = reply.get("kept")
        """What the rank takes over where the service kept the job's state (jobs.py): its
        slabs are then the kept segments, mapped again, not new ones."""
        self._kept_segments = list(self.kept["segments"]) if self.kept else []
        self._segments: dict[int, tuple[int, int]] = {}
        """A slab's address -> the segment it maps and its bytes, in the order they were
        reserved."""

    def __call__(self, nbytes: int) -> torch.Tensor:
        if self.kept is not None:
            if not self._kept_segments:
                raise ServiceError(f"job {self.job}'s kept state has fewer DRAM segments than "
                                   f"this rank's plan packs")
            reply, fds = self.client.request("map", segment=self._kept_segments.pop(0))
            if reply["nbytes"] != nbytes:
                for fd in fds:
                    os.close(fd)
                raise ServiceError(f"job {self.job}'s kept segment {reply['segment']} has "
                                   f"{reply['nbytes']} bytes, this rank's plan packs {nbytes}")
        else:
            reply, fds = self.client.request("reserve", nbytes=nbytes)
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise ServiceError(f"the tiered service sent {len(fds)} descriptors for one segment")
        try:
            # A tier touches all of it: pages mapped before (a spare's, a kept segment's) are
            # mapped faster in one pass; new ones are faster faulted in (segments.py).
            slab = map_segment(fds[0], nbytes, populate=bool(reply.get("populate")))
        finally:
            os.close(fds[0])  # the mapping keeps the memory
        try:
            self.device.register_host_memory(slab)
        except MemoryError:
            self.client.request("release", segment=reply["segment"])
            raise
        self._segments[slab.data_ptr()] = reply["segment"], nbytes
        return slab

    @property
    def segment_ids(self) -> list[int]:
        """The segments this rank holds, in the order its DRAM tier reserved them."""
        return [segment for segment, _ in self._segments.values()]

    def locate(self, block: torch.Tensor) -> tuple[int, int]:
        """(segment, byte offset) of the slab memory ``block`` starts at: a block the service
        moves bytes to or from (service/remote_nvme.py)."""
        address = block.data_ptr()
        for start, (segment, nbytes) in self._segments.items():
            if start <= address < start + nbytes:
                return segment, address - start
        raise ServiceError("a block outside this rank's segments cannot cross to the service")

    def release(self, slab: torch.Tensor) -> None:
        self.device.unregister_host_memory(slab)
        segment, _ = self._segments.pop(slab.data_ptr())
        if self.client.ended or self.kept is not None:
            # An unclean end (the service keeps it as the job's state), or a kept segment: it
            # is the job's, freed with it (a failed reservation must not free it).
            return
        try:
            self.client.request("release", segment=segment)
        except ServiceError:
            pass  # a service that went away has freed it already

    def close(self, clean: bool) -> None:
        """The tiers are done with the service: ``clean`` frees what this rank still holds
        there at once; otherwise the connection just drops (the launcher, or without one the
        service, then counts the job as failed). Safe to call more than once."""
        if self.client.closed:
            return
        try:
            if clean:
                self.client.request("detach", clean=True)
        except ServiceError:
            pass  # gone already: it freed or keeps the state by itself
        finally:
            self.client.close()
            self._give_back_slot()

    def _give_back_slot(self) -> None:
        if self._slot is not None:
            ENGINE_SLOTS.give_back(*self._slot)
            self._slot = None


SERVICE_ENV = "TIERED_SERVICE"
"""The service folder a rank takes its DRAM from (tiered-launch sets it unless --no-daemon)."""
JOB_ENV = "TIERED_JOB"
"""The job's name (tiered-launch --job, or the launcher's own); else torchrun's run id."""
FRESH_ENV = "TIERED_FRESH"
"""Set to 1: a state the service kept of the job is freed, not taken over (--fresh)."""


def slab_source_from_env(rank: int, world: int,
                         device: Accelerator) -> ServiceSlabSource | None:
    """The service's slab source for this rank when the environment names a service (a rank of
    ``tiered-launch``, or a script run by hand with TIERED_SERVICE and TIERED_JOB set), else
    None: the trainer pins its own memory, as a plain ``python train.py`` does."""
    folder = os.environ.get(SERVICE_ENV)
    if not folder:
        return None
    job = os.environ.get(JOB_ENV) or os.environ.get("TORCHELASTIC_RUN_ID")
    if not job:
        raise ServiceError(f"{SERVICE_ENV} names a service but no job names this run: set "
                           f"{JOB_ENV}, or run under tiered-launch")
    client = Channel.connect(folder)
    try:
        return ServiceSlabSource(client, job, rank, world, device,
                                 fresh=os.environ.get(FRESH_ENV) == "1")
    except BaseException:
        client.close()
        raise
