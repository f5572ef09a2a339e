"""A job's step records and the commit barrier over its hosted ranks: what makes a crashed
trainer's state in the service exact to reattach to.

[Note: reattach]
A rank's trainer dies anywhere: in forward, in backward, in ``optimizer.step()``, while the
update runs, in a save. What the service keeps must then be every rank's state after one and the
same ``step()`` call, whole: never some units (or some ranks) stepped and others not. The
mechanism is a commit barrier, not an undo log (nothing is copied per step):
- At each ``step()`` call ``s`` a trainer sends its step record (the optimizer's counters and
  hyperparameters, which delayed-update weights are current, its RNG states and the model's
  buffers: what a checkpoint holds besides the shards) right behind the step's ``Update``.
- The update of step ``s`` runs on no rank until every rank's record ``s`` has arrived: then
  every rank's ``Update s`` has arrived too, and the service runs them all to their end whatever
  becomes of the trainers (a host's queued commands run on after its trainer is gone). Step
  ``s`` is then *committed*.
- A rank's host that ends (its trainer died, or closed) breaks the round: no step not committed
  by then is ever run, on any rank, and records that come later are dropped. A trainer that
  dies ends its host at once; one that closes (``engine.close()``, or its exit right after a
  ``step()``) ends it once what it sent has run, its last update included when every rank's
  record of it comes in (a rank that ends first is no crash). A closing rank sends no record
  after its end: a step it has no record of can no longer commit, and whoever waits for that
  step stops waiting then. Without that, two ranks stopped together (Ctrl-C) deadlocked when
  one had sent step ``s``'s record and the other its update but not its record: each end waited
  for its queued update's commit, and the round broke only after an end.
So the shards in the segments are, once the round's hosts are all done, exactly those after the
last committed step on every rank. Units a step on arrival would step during backward are
stepped at the step instead where the service runs the host (runtime.arrival_allowed): the
exactness costs that overlap, nothing else. A relaunch of the job waits for the old round's
hosts to finish, then maps the kept segments and restores the committed records (its trainer's
engine/reattach.py); its hosts open a new round.
"""
from __future__ import annotations

import threading

from ..core.errors import RankWent


class NotCommitted(RankWent):
    """A step's update is not run: a rank of the job went before it was committed."""


class StepCommits:
    """One job's records and commits (see [Note: reattach]); safe across connection threads."""

    def __init__(self, world: int):
        self.world = world
        self._changed = threading.Condition()
        self._records: dict[int, dict[int, dict]] = {}
        """Step -> rank -> its record, for steps not committed yet."""
        self.step = 0
        """The last committed step (0: none yet)."""
        self.records: dict[int, dict] = {}
        """Rank -> its record of the committed step."""
        self._open = True
        self._round = 0
        self._ending: set[int] = set()
        """Ranks whose trainer closed: they send no more records this round."""

    @property
    def round(self) -> int:
        return self._round

    @property
    def open(self) -> bool:
        """Steps may still be committed in this round (no host of it has ended)."""
        with self._changed:
            return self._open

    def arrived(self, round_: int, rank: int, step: int, record: dict) -> None:
        """Rank ``rank``'s record of ``step()`` call ``step`` (sent in round ``round_``)."""
        with self._changed:
            if round_ != self._round or not self._open or step <= self.step:
                return  # of a broken round, or of a step relaunched past
            records = self._records.setdefault(step, {})
            records[rank] = record
            if len(records) == self.world:
                self.step, self.records = step, records
                for earlier in [s for s in self._records if s <= step]:
                    del self._records[earlier]
                self._changed.notify_all()

    def ending(self, rank: int) -> None:
        """Rank ``rank``'s trainer closed: it sends no record after those already here."""
        with self._changed:
            self._ending.add(rank)
            self._changed.notify_all()

    def _cannot_commit(self, step: int) -> bool:
        """A rank that sends no more records has none of ``step``."""
        return any(rank not in self._records.get(step, {}) for rank in self._ending)

    def wait(self, round_: int, step: int) -> None:
        """Return once ``step`` is committed; raise when it never will be (the round broke, or
        a rank that closed has no record of it)."""
        with self._changed:
            self._changed.wait_for(lambda: self.step >= step or not self._open
                                   or round_ != self._round or self._cannot_commit(step))
            if self.step < step or round_ != self._round:
                raise NotCommitted(f"step {step} is not run: a rank of the job went before every "
                                  f"rank had taken it (the job resumes from step {self.step})")

    def broken(self) -> None:
        """A rank's host ended: steps not committed now are never run in this round."""
        with self._changed:
            self._open = False
            self._records.clear()
            self._changed.notify_all()

    def new_round(self) -> int:
        """The job's hosts start again (a relaunch, with the old round's hosts all done)."""
        with self._changed:
            if not self._open:
                self._round += 1
                self._open = True
                self._records.clear()
                self._ending.clear()
            return self._round
