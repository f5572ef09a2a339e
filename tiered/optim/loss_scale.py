"""Dynamic loss scaling for fp16 compute, with ``torch.amp.GradScaler``'s rules.

The loss is multiplied by ``scale`` before backward. A step whose gradients hold an inf or nan
(on any rank) is skipped and the scale multiplied by ``backoff_factor``; after
``growth_interval`` good steps in a row it is multiplied by ``growth_factor``.
"""
from __future__ import annotations

from ..policy import LossScalePolicy


class LossScaler:
    def __init__(self, policy: LossScalePolicy):
        self.policy = policy
        self.scale = policy.initial_scale
        self._good_steps = 0

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale *= self.policy.backoff_factor
            self._good_steps = 0
            return
        self._good_steps += 1
        if self._good_steps == self.policy.growth_interval:
            self.scale *= self.policy.growth_factor
            self._good_steps = 0

    def state(self) -> dict:
        return {"scale": self.scale, "good_steps": self._good_steps}

    def load_state(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._good_steps = int(state["good_steps"])
