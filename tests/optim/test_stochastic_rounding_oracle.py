"""Stochastic rounding of bf16 master weights against an oracle outside the product (issue 30,
item 11).

The compact tests compare the native kernel with ``compact.reference_step`` and feed
``round_bf16_stochastic`` its own bits: a rounding rule wrong in both (truncation, or to nearest)
passes them all. Here the product's own path, ``tiered.initialize`` with ``optimizer.master:
bf16`` (the bf16 weights are the master, stepped in fp32 and rounded stochastically), trains a
layer of 2^20 weights by updates of 1/100 of a bf16 step, and the mean drift of its weights is
held to fp32 ``torch.optim.AdamW``'s from the same start, by a bound derived below. To nearest,
an update under half a step never moves a weight; truncation moves some a whole step each time
and the others never: they miss the oracle by about 39 and 1,900 bounds.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import tiered
from tiered.optim import compact, native
from tiered.placement.plan import StateKind

WIDTH = 1024
"""One Linear(WIDTH, WIDTH): N = 2^20 weights, in one unit."""
STEPS = 4
ULP = 2.0 ** -7
"""bf16's step for magnitudes in [1, 2): the weights start in +-[1.25, 1.75] and move at most a
step per update, so each keeps this step throughout."""
Q = 1 / 100
"""The update, in bf16 steps: AdamW's update under a constant gradient is lr * g / (|g| + eps),
lr to 1e-8 relative for |g| >= 0.5, so lr = Q * ULP."""

# The bound. Each step the kernel forms p = w - u in fp32 from the bf16 weight w and rounds p to
# one of its two bf16 neighbours: w itself (Q steps away) or the next value in the update's
# direction (1 - Q away), the latter with probability Q, decided by 16 random bits against the
# 16 bits fp32 keeps below bf16 (exact: no resolution bias). That rounding error has mean 0
# and variance Q (1 - Q) ULP^2 whatever happened before (fresh bits each step: the stream's key
# includes the step), so an element's error summed over STEPS steps is a martingale of variance
# STEPS Q (1 - Q) ULP^2, and elements draw from distinct hash inputs: the mean over N elements
# has standard deviation
#     sigma = ULP * sqrt(STEPS * Q * (1 - Q) / N) = 1.94e-4 ULP   (N = 2^20, STEPS = 4, Q = 1/100)
# (the familiar ULP / sqrt(12 N) assumes a rounding error uniform over the step; here
# the fraction is always Q, so Q (1 - Q) replaces 1/12). About 42,000 of the N * STEPS roundings
# move a weight, enough for the normal approximation: 5 sigma is a false alarm in ~2 million.
# Beside the noise, both sides round each new fp32 weight to fp32 (half an fp32 ulp at [1, 2)
# is 2^-17 ULP) and compute u by differently ordered fp32 formulas (~1e-6 of u): at most
# 2 * STEPS * 2^-17 ULP = 6.1e-5 ULP of systematic difference.
# BOUND = 5 sigma + that = 1.03e-3 ULP. The stream is seeded (rounding_seed 0), so a run's
# drift is the same every time: the bound says how far any unbiased rounding's may fall.
# Round to nearest moves nothing: it misses the oracle's STEPS * Q = 0.04 ULP by 39 bounds.
# Truncation toward zero moves a weight a whole step where the update shrinks |w| and never
# where it grows it: a mean drift of about STEPS / 2 ULP, 1,900 bounds off.
SIGMA = ULP * math.sqrt(STEPS * Q * (1 - Q) / WIDTH ** 2)
BOUND = 5 * SIGMA + 2 * STEPS * 2.0 ** -17 * ULP


def start_and_input() -> tuple[torch.Tensor, torch.Tensor]:
    """Weights of both signs in +-[1.25, 1.75] and an input of both signs in +-[0.5, 2], both
    bf16 values: every pairing of a weight's sign with the update's direction occurs, and the
    gradient of sum(W x) with respect to W[i, j] is x[j] exactly in bf16 and fp32 alike."""
    g = torch.Generator().manual_seed(30)

    def sign(*shape: int) -> torch.Tensor:
        return torch.randint(0, 2, shape, generator=g) * 2.0 - 1.0

    weights = (torch.rand(WIDTH, WIDTH, generator=g) * 0.5 + 1.25) * sign(WIDTH, WIDTH)
    x = (torch.rand(1, WIDTH, generator=g) * 1.5 + 0.5) * sign(1, WIDTH)
    return weights.bfloat16().float(), x.bfloat16().float()


def oracle_weights(start: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """fp32 torch.optim.AdamW, STEPS steps of the same loss from the same start."""
    layer = nn.Linear(WIDTH, WIDTH, bias=False)
    with torch.no_grad():
        layer.weight.copy_(start)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=Q * ULP, betas=(0.9, 0.999), eps=1e-8,
                                  weight_decay=0.0)
    for _ in range(STEPS):
        layer(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return layer.weight.detach().clone()


def product_weights(start: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The engine's bf16 weights after STEPS steps of the same loss, with bf16 masters (fp32
    moments: the weights' rounding is then the only way the two sides differ)."""
    layer = nn.Linear(WIDTH, WIDTH, bias=False)
    with torch.no_grad():
        layer.weight.copy_(start)
    policy = {"compute_dtype": "bf16", "device": "cpu",
              "optimizer": {"lr": Q * ULP, "betas": [0.9, 0.999], "eps": 1e-8,
                            "weight_decay": 0.0, "master": "bf16", "moments": "fp32"}}
    engine, optimizer = tiered.initialize(nn.Sequential(layer), policy)
    try:
        assert not engine.manager.has(0, StateKind.MASTER)  # no fp32 copy: bf16 is the master
        assert engine.manager.shards[(0, StateKind.PARAM)].dtype is torch.bfloat16
        for _ in range(STEPS):
            engine(x.bfloat16()).float().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        return engine.full_state_dict()["0.weight"].float()
    finally:
        engine.close()


@pytest.mark.parametrize("kernel", ["native", "reference"])
def test_bf16_masters_drift_as_fp32_adamw_under_updates_of_a_hundredth_of_a_step(
        kernel, monkeypatch):
    """``native``: the C kernel (adamw_compact.c) steps the unit, as on any CPU with a
    compiler; ``reference``: without one, compact.reference_step does (as for a GPU's units).
    Each is seen called, so that the drift measured is that path's rounding."""
    calls = []
    if kernel == "native":
        real = native.native_compact_step

        def spy(grad_dtype, weights_dtype, keeps_master, moments_dtype):
            found = real(grad_dtype, weights_dtype, keeps_master, moments_dtype)
            calls.append((weights_dtype, keeps_master, found is not None))
            return found

        monkeypatch.setattr(native, "native_compact_step", spy)
    else:
        real = compact.reference_step

        def spy(master, *args):
            calls.append((args[-4].dtype, master is not None, True))  # weights_out's dtype
            return real(master, *args)

        monkeypatch.setattr(native, "native_compact_step", lambda *args: None)
        monkeypatch.setattr(compact, "reference_step", spy)
    start, x = start_and_input()
    ours = product_weights(start, x)
    assert calls and set(calls) == {(torch.bfloat16, False, True)}, calls

    expected = oracle_weights(start, x)
    along = -torch.sign(x).expand(WIDTH, WIDTH)  # the update's direction: -sign(gradient)
    oracle_drift = ((expected - start) * along).double().mean().item() / ULP
    our_drift = ((ours - start) * along).double().mean().item() / ULP
    # The setup is as the bound assumes: the oracle moved each weight by Q of a step a step.
    assert abs(oracle_drift - STEPS * Q) < 0.01 * STEPS * Q, oracle_drift
    assert abs(our_drift - oracle_drift) < BOUND / ULP, (
        f"mean drift {our_drift:.6f} bf16 steps, fp32 AdamW's {oracle_drift:.6f}: off by "
        f"{abs(our_drift - oracle_drift) / (BOUND / ULP):.1f} bounds of {BOUND / ULP:.2e} "
        f"(sigma {SIGMA / ULP:.2e})")
    # No weight moved more than a step an update (what rounding to a neighbour of p allows).
    assert float((ours - start).abs().max()) <= STEPS * ULP
