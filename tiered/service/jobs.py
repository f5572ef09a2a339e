"""What the service holds, for whom: jobs, their ranks, and the node's DRAM pool they share.

[Note: job lifecycle]
A job is named (``tiered-launch --job NAME``, else torchrun's run id) and has ``world`` ranks.
Its launcher holds it from before its ranks start (``hold``), so that a service started for one
job does not take the moment before they attach for the end of it. A name is one job: a second
launcher's ``hold`` of a job that runs (a launcher or a trainer of it alive) is refused, naming
what runs it; it is never merged into it. Its state is one of JobState, changed only here:
- RUNNING: its launcher or at least one rank is there, and none has gone without a clean end;
- ENDING: its launcher ended it cleanly (every rank exited 0) while the service had not yet
  seen every rank's connection close; freed once it has, however they close;
- FAILED: its launcher saw it fail or went without a word (killed), or, with no launcher, a
  rank's trainer went without a clean end (killed, an exception, a dropped socket). A rank that
  goes while its launcher holds the job changes nothing yet: the launcher sees every rank's exit
  status, and decides. What a failed job holds is kept: other ranks may still be attached (they
  will fail in their next collective), and once the last is gone the job is kept for
  ``keep_seconds``, then freed.
A job whose launcher ends it cleanly (every rank exited 0) is freed once nothing of it is
attached, and one whose every rank detached cleanly without a launcher at once; either is
forgotten. So is a failed job that holds nothing (a rank refused for its budget, a client that
attached and dropped): there is nothing of it to keep.

Each engine of a trainer's process is a job of its own at the service (a DPO reference model
beside its policy, a notebook that builds a second model before closing the first): the first
is the job the launcher names, the k-th open one ``NAME#k`` (a name no launcher can give),
which its launcher's hold covers too. A relaunch builds its engines in the same order, so each
reattaches to its own kept state. A rank whose host runs here counts
as there until its host has run what it was sent (see [Note: reattach] in commits.py).

A job whose ranks' hosts ran here and committed a step can be reattached: a relaunch of it
(the same name, its kept state not yet freed, not ``--fresh``) finds every rank's segments and
the records of the last committed step, and each rank maps its segments back instead of
reserving new ones (the trainer checks that its model and policy are the same first). A rank
that attaches while the last round's hosts still run waits for them: what they still run is
part of the state it takes over. Any other kept state (nothing committed, hosts in the
trainers) is freed by the relaunch, which starts afresh and says so.
Every segment is counted against the pool's budget from its creation to its release, so the
node's ranks together never hold more than the service was given.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

import psutil

from ..core.errors import BudgetError, TieredError
from ..core.sizes import format_size
from .commits import StepCommits
from .files import RankFiles
from .records import Job, JobState, Launcher, Rank, Segment
from .segments import SpareSegments, create_segment

SETTLE_SECONDS = 600.0
"""How long a relaunched rank waits for the last round's hosts to run what they were sent."""


MAX_WORLD = 1 << 16
"""The most ranks a job may have (a bound on what a client may ask the service to track)."""
STALE_SECONDS = 10.0
"""How long a launch waits for the service to see a dead launcher's or trainer's connection
close (it is told within milliseconds: the kernel closes a dead process's sockets)."""


class RefusedError(TieredError):
    """A request the service will not carry out; the message says why (sent to the client)."""


class Registry:
    """The jobs of one service, under one lock (each client connection has a thread)."""

    def __init__(self, dram_budget: int, keep_seconds: float,
                 clock: Callable[[], float] = time.monotonic):
        self.dram_budget = dram_budget
        self.keep_seconds = keep_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._settling = threading.Condition(self._lock)
        """Notified when a host ends (relaunched ranks wait for the last round's)."""
        self._jobs: dict[str, Job] = {}
        self._next_segment = 0
        self.dram_used = 0
        """Bytes of the segments jobs hold."""
        self.spares = SpareSegments()
        """Segments of jobs that ended, for the next ones (the warm start)."""
        self.jobs_served = 0
        """Jobs that ever attached (a service started for one job exits once it has served it
        and holds nothing)."""

    def hold(self, name: str, pid: int, fresh: bool = False, world: int | None = None) -> str:
        """The launcher ``pid`` holds job ``name`` while it runs ``world`` ranks (None: not
        known); returns a note ("" or what was freed or is kept to reattach to). ``fresh``: a
        kept state is freed, never reattached. Refused while the job runs (see [Note: job
        lifecycle])."""
        _check_name(name)
        _check_world(world)
        with self._lock:
            last = self._jobs.get(name)
            if last is not None and last.state is not JobState.FAILED:
                self._refuse_if_running(last)
                # Only dead processes are left: their connections close in a moment, which
                # fails the job (kept to reattach to) or frees it.
                if not self._settling.wait_for(
                        lambda: self._jobs.get(name) is not last
                        or last.state is JobState.FAILED, STALE_SECONDS):
                    raise RefusedError(f"job {name}: its last launcher and trainers are gone, "
                                       f"but their connections have not closed after "
                                       f"{STALE_SECONDS:.0f} s; try again later")
            job, note = self._job_for(name, fresh, world)
            job.launcher = Launcher(pid, time.time())
            job.gone_since = None
            return note

    def unhold(self, name: str, pid: int, clean: bool) -> None:
        """The launcher ``pid`` is done: ``clean`` when every rank exited 0 (the job is freed
        once nothing of it is attached), else (it saw a failure, or its connection dropped)
        the job has failed. So are the jobs of its processes' other engines."""
        with self._lock:
            job = self._jobs.get(name)
            if job is None or job.launcher is None or job.launcher.pid != pid:
                return
            job.launcher = None
            for each in [job, *self._engines_beside(job)]:
                if clean:
                    # A rank's connection may not have closed yet, or it went without a
                    # detach (a script need not close its engine): its exit status was 0.
                    each.state = JobState.ENDING
                else:
                    each.state = JobState.FAILED
                if not each.present:
                    self._gone(each)

    def _refuse_if_running(self, job: Job) -> None:
        """Refuse a second launch of ``job`` while a launcher or trainer of it is alive."""
        family = [job, *self._engines_beside(job)]
        who = []
        if job.launcher is not None and _alive(job.launcher.pid):
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(job.launcher.since))
            who.append(f"launcher pid {job.launcher.pid} holds it since {since}")
        trainers = sorted({(rank.rank, rank.pid) for each in family
                           for rank in each.ranks.values()
                           if rank.pid is not None and _alive(rank.pid)})
        if trainers:
            who.append("ranks attached: " + ", ".join(f"{rank} (pid {pid})"
                                                       for rank, pid in trainers))
        if not who:
            return
        raise RefusedError(f"job {job.name} is running: {' and '.join(who)}; a second launch "
                           f"of it is refused: give this one another --job, or wait for it to "
                           f"end (tiered daemon status shows it)")

    def _engines_beside(self, job: Job) -> list[Job]:
        """The jobs of the other engines of ``job``'s processes (``NAME#k``)."""
        return [other for other in self._jobs.values() if other.parent is job]

    def attach(self, name: str, rank: int, world: int, pid: int, fresh: bool = False,
               engine: int = 0) -> tuple[str, str, dict | None]:
        """Attach ``pid`` as rank ``rank`` of job ``name``; returns a note for the trainer to
        show ("" when there is nothing to say) and, where the job's state can be reattached
        to, what the rank takes over (see [Note: reattach]): the step, its segments in the
        order they were reserved, its record of that step, what its host left and what it
        was asked to run. ``fresh``: a kept state is freed, never reattached. ``engine``: the
        engine's place among those open in the trainer's process (0: the first); returns, first,
        the name of the job it attached to (see [Note: job lifecycle])."""
        _check_name(name)
        _check_world(world)
        if not 0 <= rank < world:
            raise RefusedError(f"attach needs 0 <= rank < world, got rank {rank}, world {world}")
        if not 0 <= engine < MAX_ENGINES:
            raise RefusedError(f"attach needs 0 <= engine < {MAX_ENGINES}, got {engine}")
        key = name if engine == 0 else f"{name}#{engine}"
        with self._lock:
            known = self._jobs.get(key)
            held = known.ranks.get(rank) if known is not None else None
            if held is not None and held.pid is not None and _alive(held.pid):
                # Waiting cannot help: a live trainer holds the rank.
                raise RefusedError(f"job {key} rank {rank} is attached already (pid "
                                   f"{held.pid}); a second job needs another --job")
            job, note = self._job_for(key, fresh, world)
            if engine:
                job.parent = self._jobs.get(name)
            # A rank that went just now may still have its transfers settling (files.py).
            if not self._settling.wait_for(lambda: job.settled and not (
                    rank in job.ranks and job.ranks[rank].files_open), SETTLE_SECONDS):
                raise RefusedError(f"job {key}: the hosts of its last run still run after "
                                   f"{SETTLE_SECONDS:.0f} s; try again later")
            if self._jobs.get(key) is not job:
                raise RefusedError(f"job {key} was freed while this rank waited")
            if job.world is None:
                job.world = world
            if job.world != world:
                raise RefusedError(f"job {key} runs at world size {job.world}, this rank "
                                   f"asks for {world}; use another --job for another job")
            held = job.ranks.get(rank)
            if held is not None and held.pid is not None:
                raise RefusedError(f"job {key} rank {rank} is attached already (pid "
                                   f"{held.pid}); a second job needs another --job")
            owner = job.ranks.setdefault(rank, Rank(rank))
            owner.pid = pid
            job.gone_since = None
            # The relaunch's first rank fixes what every rank takes over; so does a rank that
            # took its part over before, in a relaunch that died before its hosts ran.
            if job.reattach_step() and (not job.handover or rank not in job.handover):
                commits = job.made_commits
                job.handover = {r: {"step": commits.step,
                                    "segments": sorted(job.ranks[r].segments),
                                    "record": commits.records[r],
                                    "final": job.ranks[r].final, "host": job.ranks[r].host}
                                for r in range(job.world_size)}
            kept = job.handover.pop(rank, None) if job.handover is not None else None
            if kept is None and job.commits is not None and not job.commits.open:
                # A restarted job whose state was not kept whole starts afresh: its old
                # records must not stand for steps the new round takes again.
                job.commits = None
            if kept is None and (owner.segments or owner.files):  # a restarted rank's old state
                self._free_rank(owner)
            return key, note, kept

    def _job_for(self, name: str, fresh: bool, world: int | None) -> tuple[Job, str]:
        """The job ``name`` to join at ``world`` ranks (None: not known yet), made when it is
        new. One that failed and was kept is reattached to where it can be and ``fresh`` is
        not asked, else freed and made afresh (the note says which); one kept at another
        world size is refused. Refuses a failed job still partly there."""
        note = ""
        job = self._jobs.get(name)
        if job is not None and job.state is JobState.ENDING:
            # Its ranks exited 0: their connections close in a moment, which frees it.
            self._settling.wait_for(lambda: self._jobs.get(name) is not job, STALE_SECONDS)
            if self._jobs.get(name) is job:
                raise RefusedError(f"job {name} ended, but ranks "
                                   f"{sorted(r.rank for r in job.attached)} of it are still "
                                   f"attached after {STALE_SECONDS:.0f} s; try again later")
            job = None
        if job is not None and job.state is JobState.FAILED and not job.attached \
                and not job.held:
            failed = job
            # Its hosts may still run what its dead trainers sent: part of what is kept.
            self._settling.wait_for(lambda: not failed.present, SETTLE_SECONDS)
        if job is not None and job.state is JobState.FAILED and not job.present:
            step = job.reattach_step()
            if step and not fresh and world is not None and world != job.world:
                raise RefusedError(
                    f"job {name} ran at world size {job.world} and its state is kept to go on "
                    f"from step {step}; this run has world size {world}: relaunch it at "
                    f"{job.world}, or with --fresh to discard the kept state")
            if step and not fresh:
                job.state = JobState.RUNNING
                job.gone_since = None
                return job, (f"job {name} goes on from its kept state at step {step} "
                             f"(--fresh discards it)")
            self._free(job)
            note = (f"job {name}'s kept state was freed: a new run of it starts afresh"
                    + (" (--fresh)" if fresh else
                       "" if job.commits is None else
                       " (no step of it was committed)" if job.commits.step == 0 else ""))
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
        """A segment of ``nbytes`` for the rank, counted against the pool: a spare of that size
        where there is one, else a new one (spares go first when the pool is short)."""
        if not 0 < nbytes <= 1 << 50:
            raise RefusedError(f"a segment of {nbytes} bytes cannot be reserved")
        with self._lock:
            self._rank(name, rank)  # refused unless the rank is attached
            if self.dram_used + nbytes > self.dram_budget:
                raise BudgetError(
                    f"the service's DRAM pool cannot hold {format_size(nbytes)} more for job "
                    f"{name} rank {rank}: {format_size(self.dram_used)} of "
                    f"{format_size(self.dram_budget)} are held (tiered daemon status shows by "
                    f"whom); start the service with a larger --dram, or lower dram.budget",
                    {"dram": (self.dram_used + nbytes, self.dram_budget)})
            fd = self.spares.take(nbytes)
            spare = fd is not None
            if fd is None:
                self.spares.evict(self.dram_used + self.spares.nbytes + nbytes - self.dram_budget)
            self.dram_used += nbytes  # counted before the slow fallocate, unlocked below
            segment_id = self._next_segment
            self._next_segment += 1
        if fd is None:
            try:
                fd = create_segment(nbytes, f"tiered-{name}-rank{rank}-{segment_id}")
            except BaseException:
                with self._lock:
                    self.dram_used -= nbytes
                raise
        with self._lock:
            segment = Segment(segment_id, fd, nbytes, touched=spare)
            job = self._jobs.get(name)
            if job is None or job.ranks.get(rank) is None:  # freed meanwhile
                self.dram_used -= nbytes
                self.spares.give(fd, nbytes)
                raise RefusedError(f"job {name} rank {rank} was freed while reserving")
            job.ranks[rank].segments[segment_id] = segment
            return segment

    def segment(self, name: str, rank: int, segment_id: int) -> Segment:
        """A segment the rank holds (a reattached trainer maps its kept ones again)."""
        with self._lock:
            segment = self._rank(name, rank).segments.get(segment_id)
            if segment is None:
                raise RefusedError(f"job {name} rank {rank} holds no segment {segment_id}")
            return segment

    def host_started(self, name: str, rank: int, pid: int, ids: list[int], request: dict,
                     nvme: bool) -> tuple[list[Segment], RankFiles | None, int, StepCommits, int]:
        """The rank's host starts here (service/hosting.py) over its segments ``ids`` and its
        NVMe files (``nvme``: whether its plan has shards on NVMe), asked for ``request`` (what
        a relaunch must match: HostRequest.fingerprint); returns the segments,
        the files, the job's world size, its commits and the round the host belongs to.
        Refused unless ``pid`` is the rank's attached trainer and the segments are all its
        own."""
        with self._lock:
            owner = self._own_rank(name, rank, pid, "starts its host")
            if owner.host_running:
                raise RefusedError(f"job {name} rank {rank} has a host running here already")
            missing = [i for i in ids if i not in owner.segments]
            if missing or len(set(ids)) != len(ids):
                raise RefusedError(f"job {name} rank {rank} holds no segments {missing or ids}")
            job = self._jobs[name]
            if job.commits is None:
                job.commits = StepCommits(job.world_size)
            if nvme and owner.files is None:
                raise RefusedError(f"job {name} rank {rank}'s plan has shards on NVMe, but the "
                                   f"rank has no files here")
            owner.host, owner.host_nvme, owner.host_running = request, nvme, True
            return ([owner.segments[i] for i in ids], owner.files, job.world_size, job.commits,
                    job.commits.new_round())

    def files_opened(self, name: str, rank: int, pid: int,
                     make: Callable[[], RankFiles]) -> tuple[RankFiles, bool]:
        """The rank's trainer ``pid`` opens its file stream: returns the rank's files and
        whether they are a kept state's (a reattached rank's), else new ones ``make`` made."""
        with self._lock:
            owner = self._own_rank(name, rank, pid, "opens its files")
            if owner.files_open:
                raise RefusedError(f"job {name} rank {rank} has its files open already")
            files = owner.files
            kept = files is not None
            if files is None:
                files = owner.files = make()
            owner.files_open = True
            return files, kept

    def files_closed(self, name: str, rank: int) -> None:
        """The rank's file stream ended and what it left in flight has settled."""
        with self._lock:
            job = self._jobs.get(name)
            owner = job.ranks.get(rank) if job is not None else None
            if job is None or owner is None or not owner.files_open:
                return
            owner.files_open = False
            self._settling.notify_all()
            if not job.present:
                self._gone(job)

    def host_ended(self, name: str, rank: int, final: dict | None, ran: bool = True) -> None:
        """The rank's host ran what it was sent and stopped; ``final``: what it left (None
        when it failed: the job cannot be reattached to). ``ran``: False for a host that could
        not be built, which changed nothing. Either way no step is committed after it."""
        with self._lock:
            job = self._jobs.get(name)
            owner = job.ranks.get(rank) if job is not None else None
            if job is None or owner is None or not owner.host_running:
                return
            job.made_commits.broken()
            owner.host_running = False
            if ran:
                owner.final = final
            self._settling.notify_all()
            if not job.present:
                self._gone(job)

    def release(self, name: str, rank: int, segment_id: int) -> None:
        with self._lock:
            owner = self._rank(name, rank)
            segment = owner.segments.pop(segment_id, None)
            if segment is None:
                raise RefusedError(f"job {name} rank {rank} holds no segment {segment_id}")
            if owner.files is not None:  # its transfers may not reach the segment any more
                owner.files.segments.forget(segment_id)
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
        if failed and not job.held and job.state is JobState.RUNNING:
            job.state = JobState.FAILED
        self._settling.notify_all()
        if not job.present:
            self._gone(job)

    def _gone(self, job: Job) -> None:
        """Nothing of ``job`` is there any more: kept when it failed and holds something,
        else freed."""
        if job.state is JobState.FAILED and job.holds_memory:
            job.gone_since = self._clock()
        else:  # ended cleanly, or nothing of it to keep
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
                    "committed_step": job.commits.step if job.commits is not None else None,
                    # What a relaunch takes over, once no trainer of it is attached.
                    "resumable_step": (job.reattach_step() or None) if not job.attached
                    else None,
                    "launcher": (None if job.launcher is None else
                                 {"pid": job.launcher.pid, "since": job.launcher.since}),
                    "engine_of": job.parent.name if job.parent is not None else None,
                    "freed_in_seconds": kept,
                    "ranks": [{"rank": r.rank, "pid": r.pid, "attached": r.pid is not None,
                               "host": "service" if r.host is not None else "trainer",
                               "dram_bytes": r.dram_bytes, "segments": len(r.segments),
                               **(r.files.status() if r.files is not None else {})}
                              for r in sorted(job.ranks.values(), key=lambda r: r.rank)]})
            return {"dram": {"budget": self.dram_budget, "used": self.dram_used,
                             "spare": self.spares.nbytes},
                    "keep_seconds": self.keep_seconds, "jobs": jobs}

    def close(self) -> None:
        """Free everything (the service stops)."""
        with self._lock:
            for job in list(self._jobs.values()):
                self._free(job)
            self.spares.close()

    def _own_rank(self, name: str, rank: int, pid: int, what: str) -> Rank:
        owner = self._rank(name, rank)
        if owner.pid != pid:
            raise RefusedError(f"job {name} rank {rank} is attached by pid {owner.pid}, not by "
                               f"pid {pid}: only a rank's own trainer {what}")
        return owner

    def _rank(self, name: str, rank: int) -> Rank:
        job = self._jobs.get(name)
        if job is None or rank not in job.ranks:
            raise RefusedError(f"job {name} rank {rank} is not attached")
        return job.ranks[rank]

    def _free(self, job: Job) -> None:
        for rank in job.ranks.values():
            self._free_rank(rank)
        if self._jobs.get(job.name) is job:
            del self._jobs[job.name]
        self._settling.notify_all()

    def _free_rank(self, rank: Rank) -> None:
        for segment in rank.segments.values():
            self._close(segment)
        rank.segments.clear()
        if rank.files is not None:
            rank.files.close()
        rank.host = rank.final = rank.files = None
        rank.host_nvme = False

    def _close(self, segment: Segment) -> None:
        """The segment is no job's now: a spare for the next (its memory goes once it is
        evicted and the trainer's mapping is gone too)."""
        self.dram_used -= segment.nbytes
        self.spares.give(segment.fd, segment.nbytes)


JOB_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
JOB_NAME_MAX = 100


MAX_ENGINES = 64
"""The most engines one trainer's process may have open at the service at once."""


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie has ended: its sockets are closed)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _check_world(world: int | None) -> None:
    if world is not None and not 1 <= world <= MAX_WORLD:
        raise RefusedError(f"a job has 1 to {MAX_WORLD} ranks, got world {world}")


def _check_name(name: str) -> None:
    if not (0 < len(name) <= JOB_NAME_MAX and set(name) <= JOB_NAME_CHARS):
        raise RefusedError(f"a job name is 1 to {JOB_NAME_MAX} letters, digits, '.', '_' or "
                           f"'-', got {name!r}")
