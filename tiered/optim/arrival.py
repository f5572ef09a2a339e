"""What the optimizer needs to know of a backward whose gradients it steps as they arrive.

It lives with the optimizer, which reads it, rather than with the gradient path, which makes
it: the engine builds on the optimizer, so the optimizer imports nothing from the engine.
"""
from __future__ import annotations

from dataclasses import dataclass

from .adamw import AdamWHyper


@dataclass(frozen=True)
class LastBackward:
    """The step's last backward, as ``optimizer.accumulation_steps`` declares it: each unit's
    gradient is complete once it arrives. Made by the thread running backward when it starts,
    and handed with each of its gradients to the CPU worker, so whatever the worker reads of it
    is this backward's even when the worker runs behind."""

    step_units: bool
    """Step each unit as its gradient arrives (else only take its norm, if wanted)."""
    forward_rank: dict[int, int]
    """Unit -> its place in the next forward, which steps first what that forward needs first."""
    hypers: tuple[AdamWHyper, ...] | None
    """The hyperparameters those steps use, per param group: ``param_groups`` as this backward
    started."""
