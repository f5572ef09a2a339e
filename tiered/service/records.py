"""What the service keeps of a job (see [Note: job lifecycle] in jobs.py): its state, its ranks,
their segments and files, and the launcher holding it. Plain records: the Registry (jobs.py)
changes them, under its lock.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .commits import StepCommits
from .files import RankFiles


class JobState(enum.Enum):
    RUNNING = "running"
    ENDING = "ending"
    FAILED = "failed"


@dataclass
class Segment:
    id: int
    fd: int
    nbytes: int
    touched: bool = False
    """A trainer mapped its pages before (a spare): mapping it again populates them in one
    pass (segments.map_segment)."""


@dataclass
class Rank:
    rank: int
    pid: int | None = None
    """The attached trainer's process, or None once it is gone."""
    segments: dict[int, Segment] = field(default_factory=dict)
    host: dict | None = None
    """What its host here was asked to run (service/hostwire.HostRequest): what a relaunch
    must match to reattach."""
    host_nvme: bool = False
    """Whether that host's plan has shards on NVMe (then its files are part of its state)."""
    host_running: bool = False
    final: dict | None = None
    """What its host left when it ended (RankHost.final_state): unit steps, the last update."""
    files: RankFiles | None = None
    """Its NVMe files, where its plan has shards on NVMe (see [Note: NVMe in the service])."""
    files_open: bool = False
    """A trainer's file stream is open on them (its transfers may still move)."""

    @property
    def dram_bytes(self) -> int:
        return sum(segment.nbytes for segment in self.segments.values())


@dataclass(frozen=True)
class Launcher:
    pid: int
    since: float
    """When it took the hold (seconds since the epoch)."""


@dataclass
class Job:
    name: str
    world: int | None = None
    """Its ranks, set by the first to attach (a launcher holds a job before that)."""
    state: JobState = JobState.RUNNING
    ranks: dict[int, Rank] = field(default_factory=dict)
    launcher: Launcher | None = None
    """The launcher holding it (see [Note: job lifecycle])."""
    parent: "Job | None" = None
    """For a process's second and later engines (``NAME#k``), the job of its first: its
    launcher holds them too."""
    gone_since: float | None = None
    """When its last attached rank or holder went (FAILED jobs are kept from then on)."""
    commits: StepCommits | None = None
    """Its records and commits, once a host of it runs here (see [Note: reattach])."""
    handover: dict[int, dict] | None = None
    """Per rank not yet reattached, what it takes over, fixed when the relaunch's first rank
    attaches (the round its hosts open must not change what the later ranks find); empty once
    all have."""

    @property
    def world_size(self) -> int:
        """Its ranks, where the caller knows one attached (which set them)."""
        assert self.world is not None, f"job {self.name} has no world size: no rank attached"
        return self.world

    @property
    def made_commits(self) -> StepCommits:
        """Its commits, where the caller knows a host of it ran here (which made them)."""
        assert self.commits is not None, f"job {self.name} has no commits: no host ran here"
        return self.commits

    @property
    def attached(self) -> list[Rank]:
        return [rank for rank in self.ranks.values() if rank.pid is not None]

    @property
    def held(self) -> bool:
        """A launcher holds it (its own, or its parent's)."""
        return (self.launcher or (self.parent.launcher if self.parent else None)) is not None

    @property
    def present(self) -> bool:
        """A launcher, a trainer or a host of it is there."""
        return (self.held or bool(self.attached)
                or any(rank.host_running or rank.files_open for rank in self.ranks.values()))

    @property
    def holds_memory(self) -> bool:
        """Some rank of it has segments or files here (what a failed job is kept for)."""
        return any(rank.segments or rank.files is not None for rank in self.ranks.values())

    @property
    def settled(self) -> bool:
        """No host of a round that broke still runs (see [Note: reattach])."""
        return (self.commits is None or self.commits.open
                or not any(rank.host_running for rank in self.ranks.values()))

    def reattach_step(self) -> int:
        """The step every rank's kept state is at, or 0 when it cannot be reattached: nothing
        committed, a rank whose host did not run here, or a round still open."""
        commits = self.commits
        if commits is None or commits.step == 0 or commits.open or self.world is None:
            return 0
        for r in range(self.world):
            rank = self.ranks.get(r)
            if (rank is None or rank.final is None or rank.host is None or not rank.segments
                    or r not in commits.records or (rank.files is None and rank.host_nvme)):
                return 0
        return commits.step

