"""What the parts of one engine share, made once, as FSDP2's ``FSDPCommContext``.

The runtime, the gatherer and the gradient path each took the same units, tier manager, process
group, policy, CPU worker, streams and timeline one by one (seven arguments, in orders that
differed); they take this instead, so a part's signature says what is particular to it.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..manager import TierManager
from ..optim.workers import CpuWorker
from ..policy import Policy
from ..timeline import Timeline
from .collectives import ProcessGroup
from .flat import FlatParam
from .streams import Streams


@dataclass(frozen=True)
class EngineContext:
    flats: list[FlatParam]
    """The units, in construction order (a unit's index is its place here)."""
    manager: TierManager
    """Where every unit's states live (the tiers)."""
    group: ProcessGroup
    """The data-parallel ranks, and this rank's compute device."""
    policy: Policy
    worker: CpuWorker
    """The one thread that runs this rank's CPU work in order (optim/workers.py)."""
    streams: Streams
    """The compute, gather and offload streams (none on the CPU)."""
    timeline: Timeline
