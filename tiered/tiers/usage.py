"""Byte accounting shared by every tier: current and peak bytes held, against a budget."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from ..core.errors import BudgetError
from ..core.sizes import format_size


@dataclass
class TierUsage:
    name: str
    budget: int
    """The enforced limit in bytes (the policy's budget, or the medium's capacity when null)."""
    current: int = 0
    peak: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    """Backward (the training thread) and the CPU worker both count transient bytes."""

    def acquire(self, nbytes: int, what: str) -> None:
        """Count ``nbytes`` more as held; refuse (holding nothing more) if it would pass the budget."""
        with self._lock:
            if self.current + nbytes > self.budget:
                raise BudgetError(
                    f"{self.name} budget exceeded by {what}: needs {format_size(nbytes)} more, "
                    f"{format_size(self.current)} of {format_size(self.budget)} already held",
                    {self.name: (self.current + nbytes, self.budget)})
            self.current += nbytes
            self.peak = max(self.peak, self.current)

    def release(self, nbytes: int) -> None:
        with self._lock:
            assert 0 <= nbytes <= self.current, (self.name, nbytes, self.current)
            self.current -= nbytes

    def follow(self, current: int) -> None:
        """Take ``current`` as the bytes held: a tier whose bytes another process holds (the
        node's service) counts what that process says it holds."""
        with self._lock:
            self.current = current
            self.peak = max(self.peak, current)

    def report(self) -> dict[str, int]:
        return {"current": self.current, "peak": self.peak, "budget": self.budget}
