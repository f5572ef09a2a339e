"""The mixed-precision AdamW step, its clipping/unscaling divisor and fp16 loss scaling, against
torch's own references: torch.optim.AdamW(fused=True) on the fp32 master with the gradient
``grad.float() / divisor``, clip_grad_norm_'s rule, and GradScaler's update op.

Documented rounding of the one-pass kernel, per step from the same states: the weights written
are the new master rounded to the compute dtype, bit for bit; each moment is within one fp32 ulp
of its tensor's largest magnitude (inductor does not contract the lerp and the multiply-add into
fmas as the fused kernel does, so an element may round the other way), and the master within
four (those one-ulp differences carried through the update's quotient). The coefficient bug
below was off by 110 of these ulps in the second moment from step 1."""
from __future__ import annotations

import copy
import math
import os

import pytest
import torch

import tiered
from tiered.engine.loss_scale import LossScaler
from tiered.optim.adamw import AdamWHyper, OnePassAdamW, adamw_step
from tiered.policy.config import LossScalePolicy
from helpers import REPO


ULP = 2.0 ** -23


def fused_step(master, exp_avg, exp_avg_sq, grad, hyper, divisor, step):
    """One step of torch.optim.AdamW(fused=True) from copies of these states, at step ``step``."""
    param = torch.nn.Parameter(master.clone())
    optimizer = torch.optim.AdamW([param], lr=hyper.lr, betas=(hyper.beta1, hyper.beta2),
                                  eps=hyper.eps, weight_decay=hyper.weight_decay, fused=True)
    optimizer.state[param].update(step=torch.tensor(float(step - 1)), exp_avg=exp_avg.clone(),
                                  exp_avg_sq=exp_avg_sq.clone())
    param.grad = grad.float() / divisor
    optimizer.step()
    state = optimizer.state[param]
    return param.detach(), state["exp_avg"], state["exp_avg_sq"]


def assert_within_ulps_of_largest(ours, reference, ulps):
    """Nans and infinities where the reference has them; finite values within ``ulps`` fp32
    ulps of the largest finite reference value."""
    assert torch.equal(ours.isnan(), reference.isnan())
    assert torch.equal(ours.isinf(), reference.isinf())
    assert torch.equal(ours[ours.isinf()], reference[reference.isinf()])
    finite = reference.isfinite()
    if finite.any():
        worst = (ours[finite] - reference[finite]).abs().max().item()
        bound = ulps * ULP * reference[finite].abs().max().item()
        assert worst <= bound, (worst, bound)


def check_steps(kernel, master, grads, hypers, divisor, first_step, weights_dtype):
    """Steps the one-pass kernel, checking each step against fused AdamW from the same states."""
    n = master.numel()
    states = (master.clone(), torch.zeros(n), torch.zeros(n))
    weights = torch.full((n,), float("nan"), dtype=weights_dtype)
    for step, (grad, hyper) in enumerate(zip(grads, hypers), first_step):
        reference = fused_step(*states, grad, hyper, divisor, step)
        master_, exp_avg, exp_avg_sq = states
        kernel.step(master_, grad, exp_avg, exp_avg_sq, weights, torch.tensor(float(step)),
                    hyper, divisor)
        for mine, theirs, ulps in zip(states, reference, (4, 1, 1)):
            assert_within_ulps_of_largest(mine, theirs, ulps)
        torch.testing.assert_close(weights, states[0].to(weights_dtype), rtol=0, atol=0,
                                   equal_nan=True)
    assert not kernel._failed


KERNEL = OnePassAdamW()

SCHEDULE = [AdamWHyper(1e-3 * (1 + i), 0.9 - 0.05 * i, 0.999 - 0.003 * i, 10.0 ** -(8 - i), 0.05)
            for i in range(4)]


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("numel", [0, 1, 7, 4099])
@pytest.mark.parametrize("case", ["wd0", "wd", "schedule", "late"])
def test_one_pass_matches_fused_adamw(grad_dtype, numel, case):
    """Bug: the kernel formed 1 - beta2, 1 - beta1 and 1 - lr * wd in fp32 from fp32-rounded
    hyperparameters, where torch's fused kernel forms them in fp64 and rounds once: 1 - beta2 for
    0.999 came out 1.3e-5 (relative) small, biasing every second moment by that much and the
    update by 6.5e-6. Masters start small (as after a small init) so the bias is visible."""
    gen = torch.Generator().manual_seed(numel)
    hypers = {"wd0": [AdamWHyper(1e-3, 0.9, 0.999, 1e-8, 0.0)] * 3,
              "wd": [AdamWHyper(1e-2, 0.9, 0.95, 1e-8, 0.1)] * 3,
              "schedule": SCHEDULE, "late": [AdamWHyper(1e-3, 0.9, 0.999, 1e-8, 0.1)] * 2}[case]
    first = 10 ** 6 if case == "late" else 1  # bias corrections of ~1 at large step counts
    master = torch.randn(numel, generator=gen) * 1e-3
    grads = [torch.randn(numel, generator=gen).to(grad_dtype) for _ in hypers]
    check_steps(KERNEL, master, grads, hypers, 3.0, first, grad_dtype)


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["nonfinite", "subnormal", "huge", "zero", "clipped_to_zero"])
def test_one_pass_matches_fused_adamw_on_extreme_gradients(grad_dtype, case):
    """Gap: inductor builds with fast-math style flags; infinities, nans and subnormals must
    still propagate as in the fused kernel (unclipped bf16 gradients reach the kernel as they
    are, and an infinite norm clips by dividing by inf)."""
    tiny = torch.finfo(grad_dtype).smallest_normal / 4  # subnormal in either dtype
    grad = {"nonfinite": torch.tensor([1.0, math.inf, -math.inf, math.nan, -0.5] * 13),
            "subnormal": torch.full((65,), tiny), "huge": torch.full((65,), torch.finfo(grad_dtype).max),
            "zero": torch.zeros(65), "clipped_to_zero": torch.randn(65)}[case].to(grad_dtype)
    divisor = math.inf if case == "clipped_to_zero" else 1.0
    hyper = AdamWHyper(1e-3, 0.9, 0.999, 1e-8, 0.1)
    master = torch.zeros(65) if case == "subnormal" else torch.randn(65)
    check_steps(KERNEL, master, [grad] * 2, [hyper] * 2, divisor, 1, grad_dtype)


def test_hyperparameter_changes_reuse_the_compiled_kernel():
    """Gap: lr, betas, eps, weight decay, the divisor and the step reach the kernel as a tensor,
    not as constants; a schedule must neither recompile per step nor step with stale values."""
    kernel = OnePassAdamW()
    kernel.warm_up(torch.bfloat16, torch.bfloat16)
    compiled = dict(torch._dynamo.utils.counters["stats"])
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(1000, generator=gen).bfloat16() for _ in SCHEDULE]
    check_steps(kernel, torch.randn(1000, generator=gen), grads, SCHEDULE, 5.0, 1,
                torch.bfloat16)
    assert dict(torch._dynamo.utils.counters["stats"]) == compiled


def test_strided_states_are_refused_not_corrupted():
    """Bug: on a strided view the fused CPU kernel stepped the first numel elements of memory
    as if contiguous, overwriting the elements between; the one-pass kernel's _alone raised
    inside its try, which turned the compiled kernel off for the run and fell back to that."""
    kernel = OnePassAdamW()
    slab = torch.randn(20)
    before = slab.clone()
    views = slab[::2], torch.randn(10).bfloat16(), torch.zeros(20)[::2], torch.zeros(20)[::2]
    with pytest.raises(ValueError, match="contiguous"):
        kernel.step(*views, torch.empty(10, dtype=torch.bfloat16), torch.ones(()),
                    SCHEDULE[0], 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        adamw_step(views[0], views[1].float(), *views[2:], torch.ones(()), SCHEDULE[0])
    assert torch.equal(slab, before) and not kernel._failed


@pytest.mark.parametrize("initial,growth,backoff,interval", [
    (2.0 ** 120, 2.0, 0.5, 1),      # growth stops at fp32's largest power of two
    (65536.0, 1.7, 0.3, 2)])        # factors that round in fp32
def test_loss_scale_follows_grad_scaler(initial, growth, backoff, interval):
    """Bug: the scale grew in Python floats past fp32's range (2**128 is inf in the fp32 loss
    scaling, so every growth made the next step overflow and be skipped) and drifted from
    GradScaler's fp32 scale under factors that round. Reference: the op GradScaler.update runs."""
    scaler = LossScaler(LossScalePolicy(initial, growth, backoff, interval))
    scale = torch.full((), initial, dtype=torch.float32)
    tracker = torch.zeros((), dtype=torch.int32)
    pattern = [False] * 12 + [True, False, True, True] + [False] * 9
    for found_inf in pattern:
        scaler.update(found_inf)
        torch._amp_update_scale_(scale, tracker, torch.tensor(float(found_inf)), growth,
                                 backoff, interval)
        assert scaler.scale == scale.item() and scaler.state()["good_steps"] == tracker.item()


class TwoBranches(torch.nn.Module):
    """A loss that is nan through one branch only: the other's gradients stay finite."""

    def __init__(self):
        super().__init__()
        self.finite = torch.nn.Linear(4, 1)
        self.root_of_negative = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.finite(x).sum() + (-self.root_of_negative(x).abs() - 1).sqrt().sum()


def test_a_nan_norm_clips_as_clip_grad_norm_does():
    """Without fp16 a nan gradient reaches the clipping rule: clip_grad_norm_ scales every
    gradient by clamp(max_norm / (nan + 1e-6), max=1) = nan, so every parameter becomes nan.
    The engine stepped the finite branch unclipped instead."""
    torch.manual_seed(0)
    model = TwoBranches()
    reference = copy.deepcopy(model)
    engine, optimizer = tiered.initialize(
        model, os.path.join(REPO, "configs", "cpu.yaml"), compute_dtype="fp32", device="cpu",
        optimizer={"lr": 1e-2, "max_grad_norm": 1.0})
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
    x = torch.randn(3, 4)
    engine(x).backward()
    optimizer.step()
    reference(x).backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=1.0)
    ref_optimizer.step()
    state = engine.full_state_dict()
    engine.close()
    assert optimizer.last_grad_norm != optimizer.last_grad_norm  # nan
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, equal_nan=True, msg=name)
