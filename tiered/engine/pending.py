"""Units whose new weights an optimizer update is still writing, and the wait for them."""
from __future__ import annotations

import threading
from typing import Iterable

from ..optim.workers import CpuWorker
from ..timeline import Timeline


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

    def __init__(self, worker: CpuWorker, timeline: Timeline):
        self._units: set[int] = set()
        self._changed = threading.Condition()
        self._worker = worker
        self._timeline = timeline
        worker.on_failure(self._wake)

    def expect(self, units: Iterable[int]) -> None:
        """Training thread, before the work that writes them is queued: these units' weights
        are changing."""
        with self._changed:
            self._units.update(units)

    def written(self, units: Iterable[int]) -> None:
        """Worker: these units' new weights are in their tier (or they will not change)."""
        with self._changed:
            self._units.difference_update(units)
            self._changed.notify_all()

    def wait(self, unit: int) -> None:
        """Until ``unit``'s weights are its newest (any thread that reads them)."""
        with self._changed:
            if unit not in self._units:
                return
        with self._timeline.span(f"wait for update of unit {unit}", "cpu"):
            with self._changed:
                self._changed.wait_for(lambda: unit not in self._units or self._worker.failed)
                if unit not in self._units:
                    return
        self._worker.raise_if_failed()

    def _wake(self) -> None:
        with self._changed:
            self._changed.notify_all()
