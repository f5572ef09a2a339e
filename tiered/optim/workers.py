"""The CPU worker: one thread that runs the CPU side of every step, in the order it was asked.

Gradient shards arriving from backward, the optimizer update and the write-back of new weights
are tasks in one FIFO queue. That order is the synchronisation: a gradient of step t+1 is added
into the grads tier only after the update of step t has read it, so the delayed update needs no
extra copy of the gradients. The thread's torch intra-op threads do the arithmetic; their number
comes from the cores this rank may use, so the pool never runs more threads than it was given.
"""
from __future__ import annotations

import queue
import threading
import warnings
from functools import partial
from typing import Any, Callable

import torch

from ..core.errors import TieredError
from ..core.limits import usable_cores


def optimizer_threads(requested: int | None, drives_gpu: bool, ranks_on_node: int) -> int:
    """The worker's intra-op threads: as asked (at most the usable cores), else this rank's
    share of the usable cores, which the node's ranks share (as tiered-launch shares them for
    OMP_NUM_THREADS), less two cores when the rank drives a GPU: one for the training thread
    that keeps the GPU fed, one for the CUDA driver's and the copy streams' host threads. The
    one-pass AdamW's loop has OpenMP's static schedule, so a unit's step waits for its slowest
    thread: when the optimizer fills every other core, whichever thread the driver preempts
    delays the whole unit. On the H100 box (16 cores) 14 threads ran the delayed update's
    step in 0.693 s against 0.802 s on 15 (bench/RESULTS.md, tenth session). On the CPU the
    training thread and the worker take turns with the same cores. Without the share, every
    rank's worker took every core: 8 ranks ran 8 threads per core."""
    cores = usable_cores()
    if requested is not None:
        return min(requested, cores)
    share = max(1, cores // ranks_on_node)
    return max(1, share - GPU_RESERVED_CORES) if drives_gpu else share


GPU_RESERVED_CORES = 2
"""Cores of a GPU rank's share left to the training thread and the driver (see above)."""


class CpuWorker:
    def __init__(self, threads: int):
        self.threads = threads
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._pending = 0
        self._error: BaseException | None = None
        self.failure_reported = False
        """Whether a task's failure was raised to a caller (see raise_if_failed)."""
        self._failure_callbacks: list[Callable[[], None]] = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="tiered-cpu-worker", daemon=True)
        self._thread.start()
        # The worker compiles the one-pass AdamW with the creating thread's compile settings
        # (see _compile_settings), adopted as its first task and waited for: a creator's
        # temporary patch is still in force then, and a failure surfaces here.
        settings = _compile_settings()
        if settings:
            self.submit(partial(_adopt_compile_settings, settings))
            self.drain()

    @property
    def failed(self) -> bool:
        return self._error is not None

    @property
    def error(self) -> BaseException | None:
        """The failure of the task that failed, if one did."""
        return self._error

    def on_failure(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on the worker) when a task fails: whoever waits for work the
        worker will now skip must wake up and see ``failed``."""
        self._failure_callbacks.append(callback)

    def submit(self, task: Callable[[], None]) -> None:
        if self._closed:
            raise TieredError("the CPU worker is closed (the engine was closed)")
        self.raise_if_failed()
        with self._idle:
            self._pending += 1
        self._tasks.put(task)

    def drain(self) -> None:
        """Wait until every submitted task has run; re-raise a task's failure here."""
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)
        self.raise_if_failed()

    def close(self) -> None:
        self._closed = True
        if self._thread.is_alive():
            self._tasks.put(None)
            self._thread.join()

    def raise_if_failed(self) -> None:
        """Raise the failure of a task (on the calling thread), if one failed."""
        if self._error is not None:
            self.failure_reported = True
            raise TieredError(f"the CPU worker failed: {self._error}") from self._error

    def _run(self) -> None:
        torch.set_num_threads(self.threads)  # this thread's intra-op threads only
        while (task := self._tasks.get()) is not None:
            try:
                if self._error is None:  # after a failure the state is suspect: run nothing
                    task()
            except BaseException as error:  # surfaced to the training thread by drain/submit
                self._error = error
                for callback in self._failure_callbacks:
                    callback()
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()


PLAIN = (bool, int, float, str, type(None))


def _compile_settings() -> list[tuple[object, dict]]:
    """dynamo's and inductor's settings with plain values (flags, sizes, folders), as the
    calling thread has them.

    torch 2.13 keeps an assignment to these configs per thread, so a worker thread would
    compile with torch's defaults, not the user's (a cache folder, compile threads, a recompile
    limit); torch 2.11 keeps them per process, and then nothing differs. Settings holding
    objects (custom compiler passes) matter to no kernel of ours and are left alone.
    """
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    try:
        return [(config, {key: value for key, value in config.get_config_copy().items()
                          if isinstance(value, PLAIN)})
                for config in (dynamo_config, inductor_config)]
    except Exception as error:  # a setting that cannot be copied
        warnings.warn(f"tiered: the CPU worker compiles with torch's default compile settings, "
                      f"since this thread's could not be copied ({error})")
        return []


def _adopt_compile_settings(settings: list[tuple[Any, dict]]) -> None:
    """Worker: take the plain settings that differ here (none, where they are per process)."""
    for config, values in settings:
        own = config.get_config_copy()
        config.load_config({key: value for key, value in values.items()
                            if key not in own or own[key] != value})
