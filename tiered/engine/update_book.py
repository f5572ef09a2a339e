"""The optimizer's updates the host has not finished: the training side's record of each
(SentUpdate), filled in by the host's events."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from ..optim.commands import UpdateMode
from ..optim.host import HostWorker


@dataclass
class SentUpdate:
    """One optimizer step's work for the host, and what the host found (UpdateBook)."""

    number: int
    units: list[int]
    loss_scale: float
    mode: UpdateMode
    """DELAYED writes the delayed update's next weights; OVERLAPPED updates have readers
    waiting for each unit (PendingWeights.expect was called for each)."""
    written: list[int] = field(default_factory=list)
    norm: float | None = None
    norm_known: threading.Event = field(default_factory=threading.Event)
    """Set once the update has its norm (or will not take one, or the host failed)."""
    overflowed: bool = False


class UpdateBook:
    """The optimizer's updates the host has not finished, by number: the training side's record
    of each, filled in by the host's events (commands.HostEvents: update_norm, update_wrote,
    update_done). A failed host wakes whoever waits for a norm."""

    def __init__(self, worker: HostWorker):
        self._updates: dict[int, SentUpdate] = {}
        self._next = 0
        worker.on_failure(self._wake_norm_waiters)

    def open(self, units: list[int], loss_scale: float, mode: UpdateMode) -> SentUpdate:
        update = SentUpdate(self._next, units, loss_scale, mode)
        self._next += 1
        self._updates[update.number] = update
        return update

    def restored(self, written: list[int], norm: float | None, overflowed: bool,
                 loss_scale: float) -> SentUpdate:
        """A delayed update a checkpoint recorded as done but not yet made current."""
        update = SentUpdate(-1, list(written), loss_scale, UpdateMode.DELAYED, list(written), norm,
                         overflowed=overflowed)
        update.norm_known.set()
        return update

    def close(self, update: SentUpdate) -> None:
        """Forget ``update`` (done, or never to be run)."""
        self._updates.pop(update.number, None)

    def update_norm(self, number: int, norm: float | None) -> None:
        update = self._updates[number]
        update.norm = norm
        update.norm_known.set()

    def update_wrote(self, number: int, unit: int) -> None:
        self._updates[number].written.append(unit)

    def update_done(self, number: int, overflowed: bool) -> None:
        self._updates.pop(number).overflowed = overflowed

    def _wake_norm_waiters(self) -> None:
        """On a failure: a ``last_grad_norm`` reader may wait for an update that will not run
        now."""
        for update in list(self._updates.values()):
            update.norm_known.set()
