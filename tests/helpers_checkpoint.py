"""The engines and training loops that checkpoint tests share with the scripts they run in a
subprocess (a save killed part way, a full disk): the parity GPT under a policy, the parity GPT
on the CPU, and a small MLP."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

import tiered

from gpt import next_token_loss
from helpers import REPO
from helpers_models import OPTIM, make_model


def engine_for(policy: str, nvme: str, delayed: bool = False):
    return tiered.initialize(
        make_model(), os.path.join(REPO, "configs", f"{policy}.yaml"), compute_dtype="fp32",
        device="cpu", nvme={"path": nvme},
        optimizer=dict(OPTIM, max_grad_norm=0.5,
                       delayed_update={"enabled": delayed, "warmup_steps": 1}))


def gpt_engine(**optimizer):
    return tiered.initialize(make_model(), "configs/cpu.yaml", compute_dtype="fp32",
                             device="cpu", optimizer=dict(OPTIM, **optimizer))


def train_gpt(engine, optimizer, batches) -> None:
    for idx in batches:
        next_token_loss(engine(idx), idx).backward()
        optimizer.step()
        optimizer.zero_grad()


def small_engine():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    return tiered.initialize(model, os.path.join(REPO, "configs", "cpu.yaml"), device="cpu",
                             compute_dtype="fp32", optimizer={"lr": 1e-2})


def train_small(engine, optimizer, steps: int, rank: int = 0, world: int = 1) -> None:
    batches = torch.randn(steps, 8, 8, generator=torch.Generator().manual_seed(1))
    for x in batches:
        engine(x[rank * 8 // world:(rank + 1) * 8 // world]).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def two_checkpoints(folder: Path) -> SimpleNamespace:
    """'zeta' saved in ``folder`` after one step of small_engine and 'alpha' after two (so the
    names' order is not the steps'), and the states they hold (``first``, ``second``)."""
    engine, optimizer = small_engine()
    train_small(engine, optimizer, 1)
    engine.save_checkpoint(str(folder), "zeta")
    first = engine.full_state_dict()
    train_small(engine, optimizer, 1)
    engine.save_checkpoint(str(folder), "alpha")
    second = engine.full_state_dict()
    engine.close()
    return SimpleNamespace(folder=folder, first=first, second=second)


def copy_of(saved: SimpleNamespace, tmp_path: Path, name: str = "ck") -> Path:
    """A copy of two_checkpoints' folder, to spoil."""
    target = tmp_path / name
    shutil.copytree(saved.folder, target)
    return target
