"""Gradients leave the device without waiting for the CPU worker (see [Note: gradients in
flight] in tiered/engine/gradients.py)."""
from __future__ import annotations

import copy
import functools
import os
import threading

import pytest
import torch

import tiered
from tiered.core.errors import BudgetError
from tiered.placement.plan import GRAD_LANDING_SLOTS

from gpt import next_token_loss
from helpers import REPO, run_with_deadline
from helpers_models import OPTIM, assert_parity, make_gpt, token_batches

six_blocks = functools.partial(make_gpt, 6, qkv_bias=False)
"""More units than gradients may be in flight at once."""


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_backward_does_not_wait_for_a_busy_worker(device):
    # The worker's queue may hold a whole update ahead of the gradients (the delayed update's,
    # or units stepped on arrival). Backward waits for a unit's buffer, and for the GPU to copy
    # gradients out, but never for the worker to take them in.
    model = six_blocks()
    reference = copy.deepcopy(model).to(device)
    engine, optimizer = tiered.initialize(model, os.path.join(REPO, "configs", "cpu.yaml"),
                                          compute_dtype="fp32", device=device, optimizer=OPTIM)
    assert len(engine.runtime.flats) > GRAD_LANDING_SLOTS
    idx = token_batches(1)[0].to(device)
    worker_busy = threading.Event()
    engine.runtime.worker.submit(worker_busy.wait)
    try:
        run_with_deadline(lambda: next_token_loss(engine(idx), idx).backward(), seconds=20)
    finally:
        worker_busy.set()
    optimizer.step()
    reference_optimizer = torch.optim.AdamW(reference.parameters(), **OPTIM)
    next_token_loss(reference(idx), idx).backward()
    reference_optimizer.step()
    assert_parity(engine.full_state_dict(), {name: value.cpu() for name, value
                                             in reference.state_dict().items()})
    assert engine.memory_report()["hbm"]["current"] == 0
    engine.close()


def test_a_gradient_refused_by_the_budget_leaves_the_count_as_it_was():
    # Fault injection: the plan leaves room for every gradient, so only a fault can refuse one;
    # the bytes it never got must not be given back (the next release would fail its check).
    engine, _ = tiered.initialize(six_blocks(), os.path.join(REPO, "configs", "cpu.yaml"),
                                  compute_dtype="fp32", device="cpu", optimizer=OPTIM)
    usage = engine.runtime.grads.usage
    acquire = usage.acquire

    def refuse_gradients(nbytes: int, what: str) -> None:
        if what.startswith("gradient of unit"):
            raise BudgetError(f"injected: {what}", {})
        acquire(nbytes, what)

    idx = token_batches(1)[0]
    object.__setattr__(usage, "acquire", refuse_gradients)
    with pytest.raises(BudgetError, match="injected"):
        next_token_loss(engine(idx), idx).backward()
    object.__setattr__(usage, "acquire", acquire)
    engine.runtime.end_iteration()  # what a training loop's next forward finds
    assert usage.current == 0
    with torch.no_grad():
        engine(idx)
    assert usage.current == 0
    engine.close()
