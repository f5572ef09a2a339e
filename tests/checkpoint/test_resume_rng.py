"""A resume restores the random-number state: dropout after a load draws the masks the run that
saved would have drawn next, so a run resumed in a fresh process is the run that never stopped.

The resumed half runs in a real subprocess (this file run as a script), whose RNG starts where a
fresh process's does, not where the saving run's was.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import tiered
from tiered.core.timeline import TRACE_ENV
from tiered.policy.config import POLICY_ENV
from helpers import REPO

CPU_YAML = os.path.join(REPO, "configs", "cpu.yaml")
STEPS, SAVE_AT = 6, 3


def make_model() -> nn.Module:
    """Two dropouts at p=0.5: every step's masks come from the global CPU RNG, so a resume that
    draws other masks steps other weights."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.5), nn.Linear(64, 64),
                         nn.GELU(), nn.Dropout(0.5), nn.Linear(64, 1))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """From a generator of their own: the data does not move the global RNG that dropout uses."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g))
            for _ in range(STEPS)]


def start(device: str = "cpu"):
    return tiered.initialize(make_model(), CPU_YAML, device=device, compute_dtype="fp32",
                             optimizer={"lr": 1e-2})


def train(engine, optimizer, steps: range) -> list[float]:
    losses = []
    data = batches()
    for step in steps:
        x, y = data[step]
        loss = nn.functional.mse_loss(engine(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def resume_and_finish(checkpoint: str, out: str) -> None:
    """The resumed half: a fresh engine loads ``checkpoint`` and trains to STEPS."""
    engine, optimizer = start()
    engine.load_checkpoint(checkpoint)
    losses = train(engine, optimizer, range(SAVE_AT, STEPS))
    torch.save((engine.full_state_dict(), losses), out)
    engine.close()


def test_a_run_with_dropout_resumed_in_a_fresh_process_equals_the_run_that_never_stopped(
        tmp_path):
    engine, optimizer = start()
    straight_losses = train(engine, optimizer, range(STEPS))
    straight = engine.full_state_dict()
    engine.close()

    engine, optimizer = start()
    assert train(engine, optimizer, range(SAVE_AT)) == straight_losses[:SAVE_AT]
    engine.save_checkpoint(str(tmp_path / "ck"))
    engine.close()
    out = tmp_path / "resumed.pt"
    env = {k: v for k, v in os.environ.items() if k not in (POLICY_ENV, TRACE_ENV)}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests"), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, os.path.abspath(__file__), str(tmp_path / "ck"),
                             str(out)], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    resumed, resumed_losses = torch.load(out, weights_only=True)

    # Bit for bit: the resumed steps do the same float operations, in the same order, on the
    # same values, with the same masks, as the straight run's (same machine, same thread
    # counts, deterministic CPU kernels), so any difference is state the resume lost.
    assert resumed_losses == straight_losses[SAVE_AT:]
    for name, value in straight.items():
        assert torch.equal(resumed[name], value), name


def rng_states(device: str) -> dict[str, torch.Tensor]:
    states = {"cpu": torch.get_rng_state()}
    if device == "cuda":
        states["cuda"] = torch.cuda.get_rng_state()
    return states


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_load_restores_the_random_number_states_of_the_save(tmp_path, device):
    engine, optimizer = start(device)
    train(engine, optimizer, range(1))
    saved = rng_states(device)
    engine.save_checkpoint(str(tmp_path))
    engine.close()

    torch.manual_seed(1234)  # elsewhere, as a fresh process's RNG would be
    engine, _ = start(device)
    torch.rand(7, device=device)
    before_load = rng_states(device)
    assert all(not torch.equal(before_load[name], saved[name]) for name in saved)
    engine.load_checkpoint(str(tmp_path))
    after_load = rng_states(device)
    engine.close()
    assert after_load.keys() == saved.keys()
    for name in saved:
        assert torch.equal(after_load[name], saved[name]), name


if __name__ == "__main__":
    resume_and_finish(*sys.argv[1:])
