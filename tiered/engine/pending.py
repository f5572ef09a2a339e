"""Units whose new weights an optimizer update is still writing, and the wait for them."""
from __future__ import annotations

import threading
from collections import Counter
from typing import Iterable

from ..core.timeline import Timeline
from ..optim.host import HostWorker


class PendingWeights:
    """Units whose new weights an optimizer update is still writing.

    An ordinary (not delayed) update on the CPU returns from ``optimizer.step()`` at once and
    steps the units in the order the next forward needs them; a unit stepped as its gradient
    arrives (``accumulation_steps``) changes while backward goes on. Every read of a unit's
    weights shard (its gather, or its read from NVMe ahead of it) first waits here until that
    unit is written. So the next forward starts while the update runs and still computes with
    every unit's new weights, never its old or half-written ones. A failed worker wakes every
    waiter of a unit it did not write with its error.
    """

    def __init__(self, worker: HostWorker, timeline: Timeline):
        self._writes: Counter[int] = Counter()
        """Unit -> writes of its weights still to come. Two may be queued: a unit still being
        stepped on arrival when the next step queues another update of it (the forward between
        did not read it, so nothing waited for the first); a reader waits for both."""
        self._changed = threading.Condition()
        self._worker = worker
        self._timeline = timeline
        worker.on_failure(self._wake)

    def expect(self, units: Iterable[int]) -> None:
        """Training thread, before the work that writes them is queued: these units' weights
        are changing (once more each)."""
        with self._changed:
            self._writes.update(units)

    def written(self, units: Iterable[int]) -> None:
        """Worker: one expected write of each of these units is done (or will not happen)."""
        with self._changed:
            for unit in units:
                if self._writes[unit] > 1:
                    self._writes[unit] -= 1
                else:
                    self._writes.pop(unit, None)  # no write to come
            self._changed.notify_all()

    def wait(self, unit: int) -> None:
        """Until ``unit``'s weights are its newest (any thread that reads them)."""
        with self._changed:
            if unit not in self._writes:
                return
        with self._timeline.span(f"wait for update of unit {unit}", "cpu"):
            with self._changed:
                self._changed.wait_for(lambda: unit not in self._writes or self._worker.failed)
                if unit not in self._writes:
                    return
        self._worker.raise_if_failed()

    def _wake(self) -> None:
        with self._changed:
            self._changed.notify_all()
