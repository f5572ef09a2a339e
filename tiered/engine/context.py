"""What the parts of one engine share, made once, as FSDP2's ``FSDPCommContext``.

The runtime, the gatherer and the gradient path each took the same units, tier manager, process
group, policy, CPU worker, streams and timeline one by one (seven arguments, in orders that
differed); they take this instead, so a part's signature says what is particular to it.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..core.timeline import Timeline
from ..optim.host import HostLink, HostWorker
from ..placement.manager import TierManager
from ..policy.config import Policy
from .buffers import GradientBuffers
from .collectives import ProcessGroup
from .flat import FlatParam
from .pending import PendingWeights
from .step_state import StepState
from .streams import Streams
from .update_book import UpdateBook


@dataclass(frozen=True)
class EngineContext:
    flats: list[FlatParam]
    """The units, in construction order (a unit's index is its place here)."""
    manager: TierManager
    """Where every unit's states live (the tiers)."""
    group: ProcessGroup
    """The data-parallel ranks, and this rank's compute device."""
    policy: Policy
    worker: HostWorker
    """What runs this rank's CPU work in order: waited for, and failing for every waiter."""
    streams: Streams
    """The compute, gather and offload streams (none on the CPU)."""
    timeline: Timeline
    host: HostLink
    """Where the CPU side of a step is sent, as commands (optim/commands.py)."""
    buffers: GradientBuffers
    """What the training side knows of the grads-tier buffers (gradients.py)."""
    pending: PendingWeights
    """Units whose new weights an update is still writing."""
    step_state: StepState
    """Where the step stands (see [Note: step phases]): every part asks it."""


class TrainerEvents:
    """What the host tells the training side (optim.commands.HostEvents), handed to the part
    each concerns: the gradient buffers, the readers of weights, the optimizer's updates."""

    def __init__(self, buffers: GradientBuffers, pending: PendingWeights, book: UpdateBook):
        self.buffers = buffers
        self.pending = pending
        self.book = book

    def gradient_taken(self, unit: int, ticket: int, landing: str | None) -> None:
        self.buffers.gradient_taken(unit, ticket, landing)

    def buffers_held(self, units: list[int]) -> None:
        self.buffers.buffers_held(units)

    def buffers_read(self, units: list[int]) -> None:
        self.buffers.buffers_read(units)

    def weights_written(self, units: list[int]) -> None:
        self.pending.written(units)

    def update_norm(self, number: int, norm: float | None) -> None:
        self.book.update_norm(number, norm)

    def update_wrote(self, number: int, unit: int) -> None:
        self.book.update_wrote(number, unit)

    def update_done(self, number: int, overflowed: bool) -> None:
        self.book.update_done(number, overflowed)
