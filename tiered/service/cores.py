"""The node's cores, shared by the CPU updates of every rank the service hosts.

Each hosted rank's worker has its share of the cores as threads (``cores // world``, at least
one). Where a node has more ranks than cores, one thread each is already more than the cores,
so the pool also bounds what *runs*: a worker holds its threads' worth of the pool while it
runs a command and gives it back while it waits for the job's other ranks (their shares of the
gradient norm), so that the commands running at once never use more threads than the node has
cores, and a rank waiting on another never keeps it from the cores it needs to answer.
"""
from __future__ import annotations

import contextlib
import threading


class CorePool:
    def __init__(self, cores: int):
        self.cores = cores
        self._held = 0
        self.peak = 0
        """The most threads that ever ran at once (``tiered daemon status``)."""
        self._changed = threading.Condition()

    @contextlib.contextmanager
    def held(self, threads: int):
        """Run the block with ``threads`` of the cores (waits for them)."""
        self._take(threads)
        try:
            yield
        finally:
            self._give(threads)

    @contextlib.contextmanager
    def given_back(self, threads: int):
        """Within a held block, let others have its ``threads`` while the block waits."""
        self._give(threads)
        try:
            yield
        finally:
            self._take(threads)

    @property
    def running(self) -> int:
        with self._changed:
            return self._held

    def _take(self, threads: int) -> None:
        threads = min(threads, self.cores)  # a rank asking for more runs alone
        with self._changed:
            self._changed.wait_for(lambda: self._held + threads <= self.cores)
            self._held += threads
            self.peak = max(self.peak, self._held)

    def _give(self, threads: int) -> None:
        with self._changed:
            self._held -= min(threads, self.cores)
            self._changed.notify_all()
