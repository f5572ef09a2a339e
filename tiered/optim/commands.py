"""What the training side asks of the CPU side of its rank, and what it is told back.

[Note: commands]
The training side (the gradient path, the optimizer) never hands the CPU worker a closure over
its own objects. It sends commands, numbered in the order sent, and the host (host.py) runs them
in that order, one at a time: ``GradientIn`` (a unit's gradient shard has landed), ``ZeroGrad``,
``Update`` (an optimizer step over some units) and ``StepArrived`` (the units a step on arrival
left). The host keeps the state only it changes (what each grads-tier buffer holds, the order
gradients arrived in, norms taken ahead, units whose last gradient is in) and tells the training
side what became of its commands through ``HostEvents``, the one way back. A command names
host-resident memory by what it is (a unit's grads-tier buffer, a landing buffer by name), so
the same command means the same thing to a host in this process and to one in the node's service,
which maps the same memory; only a gradient no such buffer holds travels as a tensor, and only to
a host in this process.

[Note: update modes]
- BLOCKING: ``step()`` returns once the update is done. For an optimizer stepping every unit
  on the GPU, and under fp16, whose next backward needs the loss scale this update decides.
- OVERLAPPED: ``step()`` returns at once; the update steps units in the order the next
  forward needs them, and that forward reads each only once it is written
  (PendingWeights), so it computes exactly what it would after a blocking step. For every
  other update: the CPU steps some or all of the units (``tier: auto`` may step the others
  on the GPU, each unit's weights announced once its kernels have run).
- DELAYED: ``step()`` returns at once; the update writes each unit's next weights
  (StateKind.PARAM_NEXT) while the next forward and backward run on the current ones, and
  the next ``step()`` (or ``synchronize()``) makes them current: ZeRO-Offload's one-step
  delayed update.
A run's ordinary mode is BLOCKING or OVERLAPPED, fixed at ``initialize`` by where the
optimizer steps and whether a loss scaler exists. With ``optimizer.delayed_update`` the run
moves to DELAYED at the call after ``warmup_steps`` calls and stays there; a checkpoint's
``steps_called`` restores the mode with the count. Units stepped as their gradients arrive
(``accumulation_steps``) are stepped during backward, outside these modes, and only where
no update is delayed (runtime.arrival_allowed); ``step()`` waits for them in BLOCKING mode
only.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol, Union

import torch

from ..device import EventLike
from .adamw import AdamWHyper
from .arrival import LastBackward


class UpdateMode(enum.Enum):
    """How an update runs against the steps around it (see [Note: update modes])."""

    BLOCKING = "blocking"
    OVERLAPPED = "overlapped"
    DELAYED = "delayed"


@dataclass(frozen=True)
class GradientIn:
    """Unit ``unit``'s gradient shard (``numel`` elements of ``dtype``) has left the device: into
    the unit's grads-tier buffer (``first``: its first since ``zero_grad``), into the landing
    buffer ``landing``, or it is ``tensor`` itself, where no buffer the host can name holds it
    (a gradient kept on the device; on a CPU device, the reduced shard). The host waits for
    ``ready`` (the copy's event) before it reads it."""

    unit: int
    dtype: torch.dtype
    numel: int
    first: bool
    landing: str | None
    last: LastBackward | None
    """Set when it is the step's last backward's (see LastBackward)."""
    ticket: int
    """Names its device bytes in flight to the training side (HostEvents.gradient_taken)."""
    ready: EventLike | None = None
    tensor: torch.Tensor | None = None


@dataclass(frozen=True)
class ZeroGrad:
    set_to_none: bool


@dataclass(frozen=True)
class Update:
    """One optimizer step over ``units``: in this order when the next forward waits for them
    (OVERLAPPED), else in the order their gradients arrived."""

    number: int
    """The training side's name for it, in what the host reports of it."""
    step: int
    """The ``optimizer.step()`` call it belongs to (``steps_taken`` after the call)."""
    units: tuple[int, ...]
    hypers: tuple[AdamWHyper, ...]
    """Per param group."""
    loss_scale: float
    mode: UpdateMode


@dataclass(frozen=True)
class StepArrived:
    """Step what a step on arrival left of ``last``'s units (at ``optimizer.step()``)."""

    last: LastBackward
    step: int
    """The ``optimizer.step()`` call (``steps_taken`` after the call)."""


Command = Union[GradientIn, ZeroGrad, Update, StepArrived]


class HostEvents(Protocol):
    """What the host tells the training side, on the host's thread (see [Note: commands])."""

    def gradient_taken(self, unit: int, ticket: int, landing: str | None) -> None:
        """The gradient is in the unit's grads-tier buffer, which an update will read; its
        landing buffer and its device bytes are free."""

    def buffers_held(self, units: list[int]) -> None:
        """These units' grads-tier buffers hold what an update will read (the zeros of
        ``zero_grad(set_to_none=False)``): the next backward must not fill them before."""

    def buffers_read(self, units: list[int]) -> None:
        """These units' grads-tier buffers may be filled again (an update read them, or
        ``zero_grad`` dropped what they held)."""

    def weights_written(self, units: list[int]) -> None:
        """These units' new weights are written: readers waiting for them may go on."""

    def update_norm(self, number: int, norm: float | None) -> None:
        """Update ``number`` has its global gradient norm (None: it takes none)."""

    def update_wrote(self, number: int, unit: int) -> None:
        """Update ``number`` has written ``unit``'s new weights (into the delayed update's next
        ones, in DELAYED mode)."""

    def update_done(self, number: int, overflowed: bool) -> None:
        """Update ``number`` is over (``overflowed``: fp16 gradients held an inf or nan and it
        stepped nothing)."""
