"""The service's clients: a connection that asks and is answered, and the DRAM slab source a
training rank takes its pinned memory from.

A rank attaches once, as (job, rank, world), and keeps its connection for the engine's life:
the connection is how the service knows the trainer lives. ``close(clean=True)`` (from
``engine.close()``) ends the job's part on this rank cleanly and frees it; a trainer that dies,
or ends without ``engine.close()``, drops the connection and the service keeps its state for
the keep time (jobs.py, [Note: job lifecycle]).
"""
from __future__ import annotations

import os
import socket
import threading
import time

import torch

from ..core.errors import BudgetError, NvmeError
from ..device import Accelerator
from . import wire
from .identity import this_code
from .paths import ServiceError, ServicePaths, service_paths
from .segments import map_segment

REPLY_SECONDS = 600.0
"""How long a request may wait for its reply: reserving a segment of many GiB zeroes every page
(about 10 s per 100 GiB), and a service that does not answer in this long is stuck."""


REFUSED_SECONDS = 0.5
"""How long a socket that nothing listens on is tried again: a service between binding its
socket and listening on it is ready within microseconds; a killed one's socket never is."""


class ServiceClient:
    def __init__(self, paths: ServicePaths, timeout: float = REPLY_SECONDS):
        self.paths = paths
        self._sock = self._connected(paths, timeout)
        self._lock = threading.Lock()  # one request, one reply: never interleaved

    @staticmethod
    def _connected(paths: ServicePaths, timeout: float) -> socket.socket:
        """A socket connected to the service, tried again with a growing pause while the
        service cannot take it yet: a full backlog for up to ``timeout``, a socket nothing
        listens on for up to REFUSED_SECONDS. A missing socket fails at once."""
        start = time.monotonic()
        pause = 0.001
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout)
            try:
                sock.connect(paths.socket)
                return sock
            except OSError as e:
                sock.close()
                if isinstance(e, BlockingIOError):
                    # A full backlog: a burst of connections outran the service's accepts, and
                    # the kernel refuses a socket with a timeout at once (EAGAIN), unqueued.
                    patience = timeout
                elif isinstance(e, ConnectionRefusedError):
                    patience = min(timeout, REFUSED_SECONDS)
                else:
                    patience = 0.0
                left = patience - (time.monotonic() - start)
                if left > 0:
                    time.sleep(min(pause, left))
                    pause = min(2 * pause, 0.05)
                    continue
                if isinstance(e, BlockingIOError):
                    raise ServiceError(f"the tiered service at {paths.socket} took no connection "
                                       f"within {timeout:g} s: its backlog stayed full"
                                       ) from None
                if isinstance(e, (FileNotFoundError, ConnectionRefusedError)):
                    raise ServiceError(f"no tiered service runs in {paths.folder} (start one "
                                       f"with 'tiered daemon start', or train without one: "
                                       f"tiered-launch --no-daemon)") from None
                raise ServiceError(f"cannot reach the tiered service at {paths.socket}: "
                                   f"{e.strerror}") from None

    @classmethod
    def connect(cls, folder: str | None = None,
                timeout: float = REPLY_SECONDS) -> "ServiceClient":
        return cls(service_paths(folder), timeout)

    def request(self, op: str, **fields) -> tuple[dict, list[int]]:
        """Send a request and wait for its reply; raises ServiceError (BudgetError for a pool
        too small) with the service's words when it refuses."""
        with self._lock:
            try:
                wire.send(self._sock, {"op": op, **fields})
                reply, fds = wire.receive(self._sock)
            except wire.WireError as e:
                raise ServiceError(f"the tiered service at {self.paths.socket} did not answer "
                                   f"{op!r}: {e}") from None
            except OSError as e:
                raise ServiceError(f"the tiered service at {self.paths.socket} did not answer "
                                   f"{op!r}: {e}") from None
        if not reply.get("ok"):
            for fd in fds:
                os.close(fd)
            raise refusal(reply, f"the tiered service refused {op!r}")
        return reply, fds

    @property
    def closed(self) -> bool:
        return self._sock.fileno() < 0

    @property
    def socket(self) -> socket.socket:
        """The connection itself, for a stream that follows a request (a rank's host)."""
        return self._sock

    def close(self) -> None:
        self._sock.close()


def refusal(reply: dict, what: str) -> Exception:
    """The error a refused request's reply carries: a BudgetError with its shortfalls for a pool
    too small, an NvmeError with its file and offset for a failed transfer, else a ServiceError
    saying ``what`` with the service's words."""
    error = str(reply.get("error", "no reason given"))
    kind = reply.get("kind")
    if kind == "budget":
        return BudgetError(error, {tier: tuple(pair) for tier, pair
                                   in (reply.get("shortfalls") or {}).items()})
    if kind == "nvme":
        return NvmeError(error, errno=reply.get("errno"), path=reply.get("path"),
                         offset=reply.get("offset"), size=reply.get("size"))
    return ServiceError(f"{what}: {error}")


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

    def __init__(self, client: ServiceClient, job: str, rank: int, world: int,
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
        if self.client.closed or self.kept is not None:
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
    client = ServiceClient.connect(folder)
    try:
        return ServiceSlabSource(client, job, rank, world, device,
                                 fresh=os.environ.get(FRESH_ENV) == "1")
    except BaseException:
        client.close()
        raise
