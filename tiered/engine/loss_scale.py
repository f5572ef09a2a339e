"""Dynamic loss scaling for fp16 compute, with ``torch.amp.GradScaler``'s rules.

The loss is multiplied by ``scale`` before backward. A step whose gradients hold an inf or nan
(on any rank) is skipped and the scale multiplied by ``backoff_factor``; after
``growth_interval`` good steps in a row it is multiplied by ``growth_factor``.
"""
from __future__ import annotations

import math

import torch

from ..policy.config import LossScalePolicy


def _fp32(value: float) -> float:
    """``value`` rounded to fp32, as GradScaler's scale tensor holds it after each update (a
    factor such as 0.3 otherwise drifts from GradScaler's scale by an ulp or more per update)."""
    return torch.tensor(value, dtype=torch.float64).float().item()


class LossScaler:
    def __init__(self, policy: LossScalePolicy):
        self.policy = policy
        self.scale = _fp32(policy.initial_scale)
        self._good_steps = 0

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale = _fp32(self.scale * self.policy.backoff_factor)
            self._good_steps = 0
            return
        self._good_steps += 1
        if self._good_steps == self.policy.growth_interval:
            grown = _fp32(self.scale * self.policy.growth_factor)
            # GradScaler keeps the scale where growing would overflow fp32: the loss is scaled
            # in fp32, where a scale of 2**128 is inf, so every growth past 2**127 made the
            # next backward overflow and skipped a step.
            if math.isfinite(grown):
                self.scale = grown
            self._good_steps = 0

    def state(self) -> dict:
        return {"scale": self.scale, "good_steps": self._good_steps}

    def load_state(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._good_steps = int(state["good_steps"])
