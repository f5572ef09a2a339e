"""TieredAdamW: ``torch.optim.AdamW`` over the engine's partitioned, tiered shards."""
from __future__ import annotations

import math

import torch

from ..errors import TieredError
from ..plan import OPTIMIZER_STATES, StateKind
from ..policy import Policy, Tier
from .adamw import AdamWHyper, adamw_step
from .loss_scale import LossScaler


class TieredAdamW(torch.optim.Optimizer):
    """AdamW with ``torch.optim.AdamW``'s semantics, stepped where the optimizer states live.

    ``param_groups[0]["params"]`` are the units' flat parameters (one per unit, as FSDP's flat
    parameters). Its ``lr``, ``betas``, ``eps`` and ``weight_decay`` are read at every step, so
    assigning ``param_groups[0]["lr"]`` or using a torch LR scheduler works as in PyTorch.

    A step clips by the global gradient norm when the policy sets ``max_grad_norm``
    (``clip_grad_norm_``'s rule), and under fp16 compute unscales the gradients, or skips the step
    and lowers the loss scale when any rank's gradients hold an inf or nan. Both factors are
    applied inside the AdamW kernel as one divisor, not as a separate pass over the gradients.

    A unit that received no gradient since ``zero_grad()`` is not stepped, as parameters with
    ``grad=None`` are not in PyTorch. Within a unit that did, a parameter the forward never used
    has a zero gradient and is stepped (weight decay and momentum act on it), where PyTorch would
    leave it alone; put such parameters in a unit of their own (``units.classes``) if it matters.
    """

    def __init__(self, runtime, policy: Policy, scaler: LossScaler | None):
        opt = policy.optimizer
        defaults = dict(lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay)
        super().__init__([flat.full for flat in runtime.flats], defaults)
        self._runtime = runtime
        self._manager = runtime.manager
        self.max_grad_norm = opt.max_grad_norm
        self.scaler = scaler
        self.device = runtime.group.device if opt.tier is Tier.HBM else torch.device("cpu")
        self._steps = [torch.zeros((), dtype=torch.float32, device=self.device)
                       for _ in runtime.flats]
        self.last_grad_norm: float | None = None
        """The global gradient norm (unscaled) the last step computed, when it computed one."""
        self.skipped_steps = 0
        """Steps skipped because fp16 gradients overflowed."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._runtime.zero_grad(set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._manager.shards:
            raise TieredError("the engine of this optimizer is closed")
        if len(self.param_groups) != 1:
            raise TieredError(f"TieredAdamW steps one param group (all units); it has "
                              f"{len(self.param_groups)}")
        units = [i for i, has in enumerate(self._runtime.has_grad) if has]
        if not units:
            return loss
        divisor = self._grad_divisor(units)
        if divisor is None:
            return loss
        hyper = AdamWHyper.from_group(self.param_groups[0])
        grad_divisor = (None if divisor == 1.0 else
                        torch.tensor(divisor, dtype=torch.float32, device=self.device))
        for i in units:
            master, exp_avg, exp_avg_sq = self._manager.optimizer_states(i)
            grad = self._manager.load(i, StateKind.GRAD)
            adamw_step(master, grad, exp_avg, exp_avg_sq, self._steps[i], hyper, grad_divisor)
            for kind, value in zip(OPTIMIZER_STATES, (master, exp_avg, exp_avg_sq)):
                self._manager.store(i, kind, value)
            self._runtime.write_weights(i, master)
        if self.scaler is not None:
            self.scaler.update(found_inf=False)
        return loss

    def _grad_divisor(self, units: list[int]) -> float | None:
        """What the accumulated gradients are divided by (loss scale over clip factor), or None
        when fp16 gradients overflowed and the step must be skipped."""
        if self.scaler is None and self.max_grad_norm is None:
            return 1.0
        norm = self._global_norm(units)
        scale = 1.0
        if self.scaler is not None:
            if not math.isfinite(norm):
                self.scaler.update(found_inf=True)
                self.skipped_steps += 1
                self.last_grad_norm = norm
                return None
            scale = self.scaler.scale
            norm /= scale
        self.last_grad_norm = norm
        if self.max_grad_norm is not None:
            clip = self.max_grad_norm / (norm + 1e-6)
            if clip < 1.0:
                # An infinite norm clips to zero, as clip_grad_norm_ multiplies by 0 then.
                return scale / clip if clip > 0.0 else math.inf
        return scale

    def _global_norm(self, units: list[int]) -> float:
        group = self._runtime.group
        square_sum = torch.zeros((), dtype=torch.float64, device=group.device)
        for i in units:
            grad = self._manager.load(i, StateKind.GRAD)
            square_sum += torch.linalg.vector_norm(grad).to(group.device, torch.float64) ** 2
        group.all_reduce_sum(square_sum)
        return math.sqrt(square_sum.item())

    def state_dict(self):
        raise TieredError("optimizer.state_dict() is not supported: TieredAdamW's state (fp32 "
                          "master weights, Adam moments) lives in tiers across ranks, not here")

    def load_state_dict(self, state_dict):
        raise TieredError("optimizer.load_state_dict() is not supported: TieredAdamW's state "
                          "lives in tiers across ranks, not here")
