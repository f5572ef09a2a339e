"""The whole engine in the mixed precision users run (configs/cpu.yaml: bf16 compute, weights,
gradients and AdamW in DRAM) against plain PyTorch doing the same arithmetic, at the bit.

The reference keeps, per parameter, fp32 master weights and AdamW moments, and a bf16 copy of the
weights in a copy of the model (parameters in bf16: every floating tensor the forward computes
is bf16, as the engine's gathered bf16 weights make it). Its rounding points are the engine's:
- the bf16 weights are the fp32 masters rounded to nearest (``Tensor.to``), at the start and
  after every step;
- forward and backward run in bf16 from those weights; a unit's gradient is the bf16 gradient
  autograd makes (a tied weight's two uses summed in bf16 by autograd, in both);
- a single backward's gradient is kept in bf16 (pending); a second backward of the same step is
  summed in fp32: the pending one widened, plus the new one widened, rounded once to fp32;
- AdamW steps the fp32 master from the gradient widened to fp32 (divided by a divisor of 1:
  no clipping, no loss scale in bf16), with each coefficient formed as torch's fused AdamW
  forms it: in fp64 from the hyperparameters, rounded once to fp32 (written out here, not
  imported); ``exp_avg`` as ``m + (1 - beta1) * (g - m)`` (lerp with a weight below 1/2),
  ``exp_avg_sq`` as ``v * beta2 + g * (g * (1 - beta2))``, weight decay as the master times
  ``1 - lr * wd``, less ``step_size * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)``; every
  operation an fp32 operation correctly rounded, as the compiled kernel's vector instructions
  are (no fused multiply-adds: inductor compiles with ``-ffp-contract=off``);
- the new bf16 weights are the new masters rounded to nearest.

Compared at every step, bit for bit: the loss (the same bf16 weights and batch), both moments
(they carry the gradient, so a different gradient shows there), the master weights and the bf16
weights. No tolerance: there is no difference to bound. A learning rate 10% high or weight
decay dropped moves the master by far more than a rounding.
"""
from __future__ import annotations

import copy
import math
import os

import pytest
import torch

import tiered
from tiered.placement.plan import StateKind

from gpt import next_token_loss
from helpers_models import make_model
from helpers import REPO

CPU_YAML = os.path.join(REPO, "configs", "cpu.yaml")
VOCAB, SEQ = 64, 16
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.1


def batches(count: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (4, SEQ), generator=gen) for _ in range(count)]


class Reference:
    """Plain PyTorch with the engine's rounding points (see the module's docstring)."""

    def __init__(self, model: torch.nn.Module):
        self.model = copy.deepcopy(model)
        self.params = dict(self.model.named_parameters())  # a tied weight once, first name
        self.master = {name: p.detach().clone() for name, p in self.params.items()}
        self.exp_avg = {name: torch.zeros_like(p) for name, p in self.master.items()}
        self.exp_avg_sq = {name: torch.zeros_like(p) for name, p in self.master.items()}
        self.pending: dict[str, torch.Tensor] = {}
        self.steps = 0
        self._write_weights()

    def _write_weights(self) -> None:
        for name, p in self.params.items():
            p.data = self.master[name].to(torch.bfloat16)

    def backward(self, idx: torch.Tensor, divide: int) -> torch.Tensor:
        loss = next_token_loss(self.model(idx), idx) / divide
        loss.backward()
        for name, p in self.params.items():
            grad, p.grad = p.grad, None
            assert grad.dtype is torch.bfloat16
            if name not in self.pending:
                self.pending[name] = grad  # kept as it is, bf16
            else:  # a second backward: the fp32 sum of both, widened
                self.pending[name] = self.pending[name].float() + grad.float()
        return loss

    def coefficients(self) -> dict[str, float]:
        """Each as torch's fused AdamW forms it: in fp64, rounded once to fp32."""
        t = self.steps
        beta1, beta2 = BETAS
        fp32 = lambda x: torch.tensor(x, dtype=torch.float64).float().item()  # noqa: E731
        return {"decay": fp32(1 - LR * WD), "beta2": fp32(beta2), "avg": fp32(1 - beta1),
                "sq": fp32(1 - beta2), "eps": fp32(EPS),
                "step_size": fp32(LR / (1 - beta1 ** t)),
                "bias2_sqrt": fp32(math.sqrt(1 - beta2 ** t))}

    def step(self) -> None:
        """One AdamW step: every operation an IEEE fp32 operation, correctly rounded (computed
        in fp64, where the exact result of an fp32 +, -, *, / or sqrt rounds to fp32 as
        correctly as in fp32 itself, then rounded), as the compiled kernel's vector
        instructions compute them. Eager fp32 ops would not all do: on the machine this was
        written on, eager ``torch.sqrt`` differed from the correctly rounded root in a fifth
        of the elements, and the update then in one element in a hundred."""
        self.steps += 1
        c = self.coefficients()
        f32 = lambda t: t.float()  # noqa: E731
        for name, master in self.master.items():
            g = self.pending.pop(name).float().double()
            m, v = self.exp_avg[name].double(), self.exp_avg_sq[name].double()
            m = f32(m + f32(c["avg"] * f32(g - m)).double())
            v = f32(f32(v * c["beta2"]).double() + f32(g * f32(g * c["sq"]).double()).double())
            root = f32(v.double().sqrt())
            denom = f32(f32(root.double() / c["bias2_sqrt"]).double() + c["eps"])
            update = f32(f32(c["step_size"] * m.double()).double() / denom.double())
            decayed = f32(master.double() * c["decay"])
            self.master[name] = f32(decayed.double() - update.double())
            self.exp_avg[name], self.exp_avg_sq[name] = m, v
        assert not self.pending, "a parameter without a gradient"
        self._write_weights()


def engine_states(engine) -> dict[str, dict[str, torch.Tensor]]:
    """Per state kind, per parameter name: the engine's shard state (one rank: the whole unit),
    read from the DRAM tier once the update has run."""
    out = {}
    for kind in (StateKind.MASTER, StateKind.EXP_AVG, StateKind.EXP_AVG_SQ, StateKind.PARAM):
        out[kind] = {}
        for flat in engine.runtime.flats:
            out[kind].update(flat.by_name(engine.manager.load(flat.spec.index, kind)))
    return out


def assert_bits(ours: torch.Tensor, reference: torch.Tensor, what: str) -> None:
    assert ours.dtype == reference.dtype and ours.shape == reference.shape, what
    differ = (ours.view(torch.int32 if ours.dtype is torch.float32 else torch.int16)
              != reference.view(torch.int32 if ours.dtype is torch.float32 else torch.int16))
    assert not differ.any(), (
        f"{what}: {int(differ.sum())} of {ours.numel()} elements differ, largest by "
        f"{(ours.float() - reference.float()).abs().max().item():.3g}")


# Backwards per step, step after step, and the optimizer's policy: single backwards (the bf16
# gradient used as it is), pairs (summed in fp32), and with the step's backward count declared,
# units stepped as their gradients arrive (compact bf16 gradient buffers with one backward).
CASES = {
    "one backward per step": ([1, 1, 1, 1], {}),
    "two backwards per step": ([2, 2, 1, 2], {}),
    "accumulation_steps 1, stepped on arrival": ([1, 1, 1], {"accumulation_steps": 1}),
    "accumulation_steps 2, stepped on arrival": ([2, 2, 2], {"accumulation_steps": 2}),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_bf16_engine_matches_plain_torch_with_the_same_rounding_at_the_bit(case):
    schedule, optimizer_policy = CASES[case]
    model = make_model()
    reference = Reference(model)
    engine, optimizer = tiered.initialize(
        model, CPU_YAML, device="cpu", compute_dtype="bf16",
        optimizer={"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD,
                   **optimizer_policy})
    assert engine.policy.compute_dtype.torch_dtype is torch.bfloat16
    assert engine.runtime.arrival_allowed == bool(optimizer_policy)
    for step, backwards in enumerate(schedule):
        for idx in batches(backwards, seed=step):
            loss = next_token_loss(engine(idx), idx) / backwards
            loss.backward()
            ref_loss = reference.backward(idx, backwards)
            assert_bits(loss.detach(), ref_loss.detach(), f"step {step} loss")
        optimizer.step()
        optimizer.zero_grad()
        optimizer.synchronize()
        assert not engine.runtime.host.rank_host.stepper.one_pass._failed, (
            "the one-pass AdamW kernel did not compile; its fallback (fused AdamW, then a "
            "cast) rounds the moments differently")
        reference.step()
        states = engine_states(engine)
        for name in reference.master:
            for kind, ours in ((StateKind.EXP_AVG, reference.exp_avg),
                               (StateKind.EXP_AVG_SQ, reference.exp_avg_sq),
                               (StateKind.MASTER, reference.master)):
                assert_bits(states[kind][name], ours[name], f"step {step} {name} {kind.value}")
            assert_bits(states[StateKind.PARAM][name], reference.params[name].detach(),
                        f"step {step} {name} bf16 weights")
    state = engine.full_state_dict()
    engine.close()
    # Weight decay and the update moved every master: the comparison is not of unchanged weights.
    initial = make_model().state_dict()
    for name, value in reference.master.items():
        assert torch.equal(state[name], value), name
        assert not torch.equal(value, initial[name]), name
