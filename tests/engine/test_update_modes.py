"""The optimizer's update modes ([Note: update modes] in tiered/engine/optimizer.py): which mode
each ``step()`` runs in, how a run moves between them, and that a checkpoint restores it."""
from __future__ import annotations


import pytest
import torch

import tiered
from tiered.optim import UpdateMode

from gpt import GPT, next_token_loss

from helpers import CONFIGS

CPU_YAML = str(CONFIGS / "cpu.yaml")


def engine_for(**overrides):
    torch.manual_seed(0)
    return tiered.initialize(GPT(64, 32, 2, 2, max_seq=16), CPU_YAML, device="cpu", **overrides)


def modes_of_steps(engine, optimizer, steps: int) -> list[UpdateMode]:
    """The mode announced before each of ``steps`` training steps."""
    modes = []
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        modes.append(optimizer.update_mode)
        engine.backward(next_token_loss(engine(idx), idx))
        optimizer.step()
        optimizer.zero_grad()
    return modes


def test_the_delayed_update_begins_after_its_warm_up_calls_and_a_load_restores_it(tmp_path):
    engine, optimizer = engine_for(
        optimizer={"delayed_update": {"enabled": True, "warmup_steps": 2}})
    O, D = UpdateMode.OVERLAPPED, UpdateMode.DELAYED
    assert modes_of_steps(engine, optimizer, 4) == [O, O, D, D]
    engine.save_checkpoint(str(tmp_path / "ck"))
    engine.close()
    fresh, fresh_optimizer = engine_for(
        optimizer={"delayed_update": {"enabled": True, "warmup_steps": 2}})
    assert fresh_optimizer.update_mode is O, "a fresh run starts in its warm-up"
    fresh.load_checkpoint(str(tmp_path / "ck"))
    assert fresh_optimizer.update_mode is D, "the step count, and with it the mode, is restored"
    fresh.close()


@pytest.mark.parametrize("overrides, ordinary", [
    ({}, UpdateMode.OVERLAPPED),                          # the CPU steps; the next forward waits
    ({"compute_dtype": "fp16"}, UpdateMode.BLOCKING),     # the next backward needs the scale
])
def test_the_ordinary_mode_follows_from_the_policy(overrides, ordinary):
    engine, optimizer = engine_for(**overrides)
    assert modes_of_steps(engine, optimizer, 2) == [ordinary, ordinary]
    engine.close()
