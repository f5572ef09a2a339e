"""The AdamW update on one shard, on whichever device holds it.

It is torch's own fused AdamW kernel (``torch.optim.AdamW(fused=True)`` calls the same op, on CPU
since torch 2.4 and on CUDA), so the update is bit-for-bit what PyTorch computes (decoupled weight
decay, bias correction from the step count) whenever the gradient is used as it is. A gradient
divisor (loss scale, clipping) divides inside the kernel where PyTorch multiplies beforehand, so
those steps agree to rounding, not bit for bit. On the reference box the fused CPU kernel ran
4.47 G params/s against 0.92 for foreach and 0.72 for the single-tensor path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AdamWHyper:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float

    @classmethod
    def from_group(cls, group: dict) -> "AdamWHyper":
        beta1, beta2 = group["betas"]
        return cls(float(group["lr"]), beta1, beta2, group["eps"], group["weight_decay"])


def adamw_step(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
               exp_avg_sq: torch.Tensor, step: torch.Tensor, hyper: AdamWHyper,
               grad_divisor: torch.Tensor | None = None) -> None:
    """One AdamW step in place on ``master``, ``exp_avg``, ``exp_avg_sq``; ``step`` (a float32
    scalar tensor on the same device) counts this step first, as torch does.

    ``grad_divisor`` (a scalar tensor) divides the gradient inside the kernel: the loss scale
    and the clipping factor applied without a separate pass over the gradient.
    """
    step += 1
    torch._fused_adamw_(
        [master], [grad], [exp_avg], [exp_avg_sq], [], [step],
        lr=hyper.lr, beta1=hyper.beta1, beta2=hyper.beta2, weight_decay=hyper.weight_decay,
        eps=hyper.eps, amsgrad=False, maximize=False, grad_scale=grad_divisor, found_inf=None)
