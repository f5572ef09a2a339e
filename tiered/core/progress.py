"""Progress of the long phases: initialize's building of units (materializing, reading
pretrained weights), pinning DRAM and building kernels; ``tiered node``'s measurements; ``tiered
plan``'s counting: a setup of minutes should not be silent until it is done.

On rank 0 only (every rank does the same work; one speaks for them), on standard error: tqdm's
bar on a terminal, plain lines otherwise (a log file, CI, a launcher's pipe), where a bar's
carriage returns would pile up. A phase says nothing until it has run QUIET_S (tqdm's
``delay``): a set-up of a second is not worth a screen of lines, and a refused input stays one
line. ``TIERED_PROGRESS=0`` silences it, ``TIERED_PROGRESS=all`` shows every phase at once.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Iterable, Iterator, Sized, TypeVar

import torch.distributed as dist
from tqdm import tqdm

PROGRESS_ENV = "TIERED_PROGRESS"
"""``0``: no progress at all; ``all``: every phase, however short."""

QUIET_S = 2.0
"""Seconds a phase runs before it is shown."""

PLAIN_EVERY_S = 10.0
"""Seconds between the plain lines of a counted phase: often enough to show it moves, seldom
enough that 80 layers do not fill a log."""

Item = TypeVar("Item")


def shown() -> bool:
    """Whether this process shows progress: rank 0 (torch.distributed's, else torchrun's RANK)
    unless TIERED_PROGRESS=0."""
    if os.environ.get(PROGRESS_ENV) == "0":
        return False
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else int(
        os.environ.get("RANK", "0"))
    return rank == 0


def _quiet_for() -> float:
    return 0.0 if os.environ.get(PROGRESS_ENV) == "all" else QUIET_S


def _say(line: str) -> None:
    print(f"tiered: {line}", file=sys.stderr, flush=True)


def counted(items: Iterable[Item], what: str, unit: str, total: int | None = None
            ) -> Iterator[Item]:
    """``items``, each yielded as the phase ``what`` reaches it, its progress counted in
    ``unit``s (of ``total``, else ``len(items)``)."""
    if not shown():
        yield from items
        return
    if total is None and isinstance(items, Sized):
        total = len(items)
    quiet = _quiet_for()
    if sys.stderr.isatty():
        yield from tqdm(items, desc=f"tiered: {what}", total=total, unit=f" {unit}",
                        file=sys.stderr, dynamic_ncols=True, delay=quiet)
        return
    of = f"/{total}" if total is not None else ""
    start = last = time.perf_counter()
    said = quiet == 0
    if said:
        _say(f"{what}: 0{of} {unit}s")
    done = 0
    for item in items:
        yield item
        done += 1
        now = time.perf_counter()
        if now - (last if said else start) >= (PLAIN_EVERY_S if said else quiet):
            _say(f"{what}: {done}{of} {unit}s, {now - start:.0f} s")
            last, said = now, True
    if said:
        _say(f"{what}: {done}{of} {unit}s in {time.perf_counter() - start:.1f} s")


@contextlib.contextmanager
def phase(what: str) -> Iterator[None]:
    """One piece of work of no count (a compile, pinning): a line once it has run QUIET_S, and
    then one as it ends (with its time), on a terminal as elsewhere."""
    if not shown():
        yield
        return
    start = time.perf_counter()
    said = threading.Event()

    def begin() -> None:
        said.set()
        _say(f"{what} ...")

    quiet = _quiet_for()
    timer = None
    if quiet == 0:
        begin()
    else:
        timer = threading.Timer(quiet, begin)
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()
    if said.is_set():
        _say(f"{what}: done in {time.perf_counter() - start:.1f} s")
