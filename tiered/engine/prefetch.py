"""Which units to gather ahead of need: the order recorded in one iteration, replayed in the next.

[Note: trace]
A *need* is a unit's forward, or its first use in a backward. The needs of one iteration (a
forward and its backward, or a forward without grad) are recorded in order. The next iteration
replays that trace: after each need that matches it, the units of the needs of the next
``prefetch.depth`` modules are gathered ahead (the two halves of a split module, units.py, are
two needs of one module), as long as the bytes gathered ahead of need stay within
``prefetch.hbm_bytes``; a unit released while it is among those next needs is kept gathered
instead, its bytes counted the same way. The first need that differs from the trace (other
control flow, a unit skipped) stops prefetching for the rest of that iteration: units are then
gathered when needed, which costs speed, never correctness, and the new order becomes the next
trace.

This module decides; the runtime moves bytes. Nothing here touches tensors, so the schedule is
the same on every rank (their collectives must be issued in the same order) and testable alone.
"""
from __future__ import annotations

from typing import Callable, Iterator

from ..policy.config import PrefetchPolicy


class Prefetcher:
    def __init__(self, sizes: list[int], policy: PrefetchPolicy, limit: int,
                 groups: list[int] | None = None):
        self.sizes = sizes
        """Bytes each unit occupies when gathered."""
        self.groups = groups or list(range(len(sizes)))
        """Per unit, the group of its module (units.module_groups): the halves of a split
        module are needed one after the other, and the look-ahead counts them as one."""
        self.policy = policy
        self.limit = limit if policy.enabled else 0
        self.trace: list[int] = []
        self._recording: list[int] = []
        self._position = 0
        self._following = False
        self.ahead: dict[int, int] = {}
        """Units gathered (or being gathered) ahead of need -> their bytes."""
        self.on_fetch: Callable[[int, int], None] | None = None
        """Called with (unit, bytes ahead of need after it) for every prefetch issued; for tests
        and the timeline."""

    @property
    def recorded(self) -> list[int]:
        """The needs of the iteration running, so far, in order."""
        return list(self._recording)

    @property
    def ahead_bytes(self) -> int:
        return sum(self.ahead.values())

    def need(self, unit: int) -> None:
        """``unit`` is about to be used: record it, and follow the trace if it matches."""
        self._recording.append(unit)
        self.ahead.pop(unit, None)
        if self._following and self._position < len(self.trace) \
                and self.trace[self._position] == unit:
            self._position += 1
        else:
            self._following = False

    def to_fetch(self, is_gathered: Callable[[int], bool]) -> list[int]:
        """Units to start gathering now, next in the trace first, within the byte limit."""
        if not self._following:
            return []
        fetch = []
        budget = self.limit - self.ahead_bytes
        for unit in self._window():
            if unit in self.ahead or is_gathered(unit):
                continue
            if self.sizes[unit] > budget:
                break
            budget -= self.sizes[unit]
            self.ahead[unit] = self.sizes[unit]
            fetch.append(unit)
            if self.on_fetch is not None:
                self.on_fetch(unit, self.ahead_bytes)
        return fetch

    def upcoming(self, is_gathered: Callable[[int], bool]) -> Iterator[int]:
        """Units next in the trace that are neither gathered nor on their way, nearest first
        (what to read from NVMe ahead of its gather)."""
        if not self._following:
            return iter(())
        return (unit for unit in self.trace[self._position:]
                if unit not in self.ahead and not is_gathered(unit))

    def keep(self, unit: int) -> bool:
        """Whether a unit about to be released should stay gathered for a use soon."""
        if not self._following or unit in self.ahead:
            return unit in self.ahead
        if unit in self._window() and self.ahead_bytes + self.sizes[unit] <= self.limit:
            self.ahead[unit] = self.sizes[unit]
            return True
        return False

    def _window(self) -> list[int]:
        """The next needs of the trace, of ``prefetch.depth`` modules."""
        window: list[int] = []
        modules: set = set()
        for unit in self.trace[self._position:]:
            if self.groups[unit] not in modules:
                if len(modules) == self.policy.depth:
                    break
                modules.add(self.groups[unit])
            window.append(unit)
        return window

    def drop_ahead(self) -> None:
        """The runtime released every unit (their weights are changing): none is ahead now,
        and the trace may fetch them again."""
        self.ahead = {}

    def end_iteration(self) -> list[int]:
        """Close the iteration; returns the units gathered ahead but never needed (to release)."""
        if self._recording:
            self.trace, self._recording = self._recording, []
        self._position = 0
        self._following = self.limit > 0 and bool(self.trace)
        unused, self.ahead = list(self.ahead), {}
        return unused
