"""What the service holds, for whom: jobs, their ranks, and the node's DRAM pool they share.

[Note: job lifecycle]
A job is named (``tiered-launch --job NAME``, else torchrun's run id) and has ``world`` ranks.
Its launcher holds it from before its ranks start (``hold``), so that a service started for one
job does not take the moment before they attach for the end of it. Its state is one of
JobState, changed only here:
- RUNNING: its launcher or at least one rank is there, and none has gone without a clean end;
- FAILED: its launcher saw it fail or went without a word (killed), or, with no launcher, a
  rank's trainer went without a clean end (killed, an exception, a dropped socket). A rank that
  goes while its launcher holds the job changes nothing yet: the launcher sees every rank's exit
  status, and decides. What a failed job holds is kept: other ranks may still be attached (they
  will fail in their next collective), and once the last is gone the job is kept for
  ``keep_seconds``, then freed.
A job whose launcher ends it cleanly (every rank exited 0), or whose every rank detached
cleanly without a launcher, is freed at once and forgotten. An attach naming a FAILED job
starts it afresh: the state it kept is freed first (reattaching to it is not built yet, and the
reply says so).
Every segment is counted against the pool's budget from its creation to its release, so the
node's ranks together never hold more than the service was given.
"""
from __future__ import annotations

import enum
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ..errors import BudgetError, TieredError
from ..sizes import format_size
from .segments import create_segment


class JobState(enum.Enum):
    RUNNING = "running"
    FAILED = "failed"


class RefusedError(TieredError):
    """A request the service will not carry out; the message says why (sent to the client)."""


@dataclass
class Segment:
    id: int
    fd: int
    nbytes: int


@dataclass
class Rank:
    rank: int
    pid: int | None = None
    """The attached trainer's process, or None once it is gone."""
    segments: dict[int, Segment] = field(default_factory=dict)

    @property
    def dram_bytes(self) -> int:
        return sum(segment.nbytes for segment in self.segments.values())


@dataclass
class Job:
    name: str
    world: int | None = None
    """Its ranks, set by the first to attach (a launcher holds a job before that)."""
    state: JobState = JobState.RUNNING
    ranks: dict[int, Rank] = field(default_factory=dict)
    holders: int = 0
    """Launchers holding it (see [Note: job lifecycle])."""
    gone_since: float | None = None
    """When its last attached rank or holder went (FAILED jobs are kept from then on)."""

    @property
    def attached(self) -> list[Rank]:
        return [rank for rank in self.ranks.values() if rank.pid is not None]

    @property
    def present(self) -> bool:
        """A launcher or a trainer of it is there."""
        return self.holders > 0 or bool(self.attached)


class Registry:
    """The jobs of one service, under one lock (each client connection has a thread)."""

    def __init__(self, dram_budget: int, keep_seconds: float,
                 clock: Callable[[], float] = time.monotonic):
        self.dram_budget = dram_budget
        self.keep_seconds = keep_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._jobs: dict[str, Job] = {}
        self._next_segment = 0
        self.dram_used = 0
        self.jobs_served = 0
        """Jobs that ever attached (a service started for one job exits once it has served it
        and holds nothing)."""

    def hold(self, name: str) -> str:
        """A launcher holds job ``name`` while it runs; returns a note ("" or what was freed)."""
        _check_name(name)
        with self._lock:
            job, note = self._job_for(name)
            job.holders += 1
            job.gone_since = None
            return note

    def unhold(self, name: str, clean: bool) -> None:
        """The launcher is done: ``clean`` when every rank exited 0 (the job is freed at once),
        else (it saw a failure, or its connection dropped) the job has failed."""
        with self._lock:
            job = self._jobs.get(name)
            if job is None or job.holders == 0:
                return
            job.holders -= 1
            if clean:
                self._free(job)
            else:
                self._went(job, failed=True)

    def attach(self, name: str, rank: int, world: int, pid: int) -> str:
        """Attach ``pid`` as rank ``rank`` of job ``name``; returns a note for the trainer to
        show ("" when there is nothing to say)."""
        _check_name(name)
        if world < 1 or not 0 <= rank < world:
            raise RefusedError(f"attach needs 0 <= rank < world, got rank {rank}, world {world}")
        with self._lock:
            job, note = self._job_for(name)
            if job.world is None:
                job.world = world
            if job.world != world:
                raise RefusedError(f"job {name} runs at world size {job.world}, this rank "
                                   f"asks for {world}; use another --job for another job")
            held = job.ranks.get(rank)
            if held is not None and held.pid is not None:
                raise RefusedError(f"job {name} rank {rank} is attached already (pid "
                                   f"{held.pid}); a second job needs another --job")
            job.ranks.setdefault(rank, Rank(rank)).pid = pid
            job.gone_since = None
            return note

    def _job_for(self, name: str) -> tuple[Job, str]:
        """The job ``name`` to join, made when it is new; one that failed and was kept is
        freed and made afresh (the note says so). Refuses a failed job still partly there."""
        note = ""
        job = self._jobs.get(name)
        if job is not None and job.state is JobState.FAILED and not job.present:
            self._free(job)
            note = (f"job {name}'s kept state was freed: a new run of it starts afresh "
                    f"(reattaching to the state of a failed run is not built yet)")
            job = None
        if job is None:
            job = self._jobs[name] = Job(name)
            self.jobs_served += 1
        if job.state is JobState.FAILED:
            raise RefusedError(f"job {name} failed and ranks "
                               f"{sorted(r.rank for r in job.attached)} of it are still "
                               f"attached; relaunch once they are gone")
        return job, note

    def reserve(self, name: str, rank: int, nbytes: int) -> Segment:
        """A new segment of ``nbytes`` for the rank, counted against the pool."""
        if not 0 < nbytes <= 1 << 50:
            raise RefusedError(f"a segment of {nbytes} bytes cannot be reserved")
        with self._lock:
            owner = self._rank(name, rank)
            if self.dram_used + nbytes > self.dram_budget:
                raise BudgetError(
                    f"the service's DRAM pool cannot hold {format_size(nbytes)} more for job "
                    f"{name} rank {rank}: {format_size(self.dram_used)} of "
                    f"{format_size(self.dram_budget)} are held (tiered daemon status shows by "
                    f"whom); start the service with a larger --dram, or lower dram.budget",
                    {"dram": (self.dram_used + nbytes, self.dram_budget)})
            self.dram_used += nbytes  # counted before the slow fallocate, unlocked below
            segment_id = self._next_segment
            self._next_segment += 1
        try:
            fd = create_segment(nbytes, f"tiered-{name}-rank{rank}-{segment_id}")
        except BaseException:
            with self._lock:
                self.dram_used -= nbytes
            raise
        with self._lock:
            segment = Segment(segment_id, fd, nbytes)
            owner = self._jobs.get(name)
            if owner is None or owner.ranks.get(rank) is None:  # freed meanwhile
                os.close(fd)
                self.dram_used -= nbytes
                raise RefusedError(f"job {name} rank {rank} was freed while reserving")
            owner.ranks[rank].segments[segment_id] = segment
            return segment

    def segments_for_host(self, name: str, rank: int, pid: int,
                          ids: list[int]) -> tuple[list[Segment], int]:
        """The segments ``ids`` of the rank, for its host (service/hosting.py), and the job's
        world size; refused unless ``pid`` is the rank's attached trainer and the segments are
        all its own."""
        with self._lock:
            owner = self._rank(name, rank)
            if owner.pid != pid:
                raise RefusedError(f"job {name} rank {rank} is attached by pid {owner.pid}, "
                                   f"not by pid {pid}: only a rank's own trainer starts its host")
            missing = [i for i in ids if i not in owner.segments]
            if missing or len(set(ids)) != len(ids):
                raise RefusedError(f"job {name} rank {rank} holds no segments {missing or ids}")
            return [owner.segments[i] for i in ids], self._jobs[name].world

    def release(self, name: str, rank: int, segment_id: int) -> None:
        with self._lock:
            segment = self._rank(name, rank).segments.pop(segment_id, None)
            if segment is None:
                raise RefusedError(f"job {name} rank {rank} holds no segment {segment_id}")
            self._close(segment)

    def detach(self, name: str, rank: int, clean: bool) -> None:
        """The rank's trainer is gone: ``clean`` when it said it ended well (engine.close()),
        else (its connection dropped) the job has failed."""
        with self._lock:
            job = self._jobs.get(name)
            if job is None or rank not in job.ranks or job.ranks[rank].pid is None:
                return
            job.ranks[rank].pid = None
            self._went(job, failed=not clean)

    def _went(self, job: Job, failed: bool) -> None:
        """A rank or holder of ``job`` is gone; ``failed`` unless it ended cleanly. While a
        launcher holds the job, a rank that went says nothing yet (a script may end without
        ``engine.close()``): the launcher sees every rank's exit status and decides."""
        if failed and job.holders == 0:
            job.state = JobState.FAILED
        if job.present:
            return
        if job.state is JobState.FAILED:
            job.gone_since = self._clock()
        else:  # every rank ended cleanly, with no launcher to wait for
            self._free(job)

    def expire(self) -> list[str]:
        """Free the failed jobs kept longer than the keep time; returns their names."""
        with self._lock:
            now = self._clock()
            due = [job for job in self._jobs.values() if job.gone_since is not None
                   and now - job.gone_since >= self.keep_seconds]
            for job in due:
                self._free(job)
            return [job.name for job in due]

    @property
    def idle(self) -> bool:
        """Nothing is held for anyone."""
        with self._lock:
            return not self._jobs

    def status(self) -> dict:
        with self._lock:
            now = self._clock()
            jobs = []
            for job in self._jobs.values():
                kept = (None if job.gone_since is None
                        else max(0.0, self.keep_seconds - (now - job.gone_since)))
                jobs.append({
                    "name": job.name, "state": job.state.value, "world": job.world,
                    "launchers": job.holders, "freed_in_seconds": kept,
                    "ranks": [{"rank": r.rank, "pid": r.pid, "attached": r.pid is not None,
                               "dram_bytes": r.dram_bytes, "segments": len(r.segments)}
                              for r in sorted(job.ranks.values(), key=lambda r: r.rank)]})
            return {"dram": {"budget": self.dram_budget, "used": self.dram_used},
                    "keep_seconds": self.keep_seconds, "jobs": jobs}

    def close(self) -> None:
        """Free everything (the service stops)."""
        with self._lock:
            for job in list(self._jobs.values()):
                self._free(job)

    def _rank(self, name: str, rank: int) -> Rank:
        job = self._jobs.get(name)
        if job is None or rank not in job.ranks:
            raise RefusedError(f"job {name} rank {rank} is not attached")
        return job.ranks[rank]

    def _free(self, job: Job) -> None:
        for rank in job.ranks.values():
            for segment in rank.segments.values():
                self._close(segment)
            rank.segments.clear()
        self._jobs.pop(job.name, None)

    def _close(self, segment: Segment) -> None:
        os.close(segment.fd)  # the memory goes once the trainer's mapping is gone too
        self.dram_used -= segment.nbytes


JOB_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
JOB_NAME_MAX = 100


def _check_name(name: str) -> None:
    if not (0 < len(name) <= JOB_NAME_MAX and set(name) <= JOB_NAME_CHARS):
        raise RefusedError(f"a job name is 1 to {JOB_NAME_MAX} letters, digits, '.', '_' or "
                           f"'-', got {name!r}")
