"""The frozen GPT of the frozen-parameter tests (``requires_grad=False``): the tied embedding (a
root parameter under two names), all of block 0 and two parameters of block 1 frozen; its engine,
its training on the parity batches, and PyTorch's reference of it."""
from __future__ import annotations

import os

import torch

import tiered

from helpers import REPO
from helpers_models import OPTIM, make_model, run_engine, train_torch

FROZEN = ("emb.weight", "head.weight", "blocks.0.", "blocks.1.fc.bias", "blocks.1.ln1.weight")


def frozen_model():
    model = make_model()
    for name, param in model.named_parameters(remove_duplicate=False):
        if name.startswith(FROZEN):
            param.requires_grad_(False)
    return model


def is_frozen(name: str) -> bool:
    return name.startswith(FROZEN)


def engine_for(policy: str, nvme: str | None, compute_dtype="fp32", device="cpu", model=None,
               **optimizer):
    """An engine of ``model`` (the frozen GPT by default) under ``configs/<policy>.yaml``."""
    return tiered.initialize(
        frozen_model() if model is None else model,
        os.path.join(REPO, "configs", f"{policy}.yaml"),
        compute_dtype=compute_dtype, device=device, nvme={"path": nvme},
        optimizer=dict(OPTIM, sub_group_size=1024, **optimizer))


def train(engine, optimizer, steps: slice = slice(None), rank: int = 0, world: int = 1) -> dict:
    return run_engine(engine, optimizer, steps=steps, rank=rank, world=world)


def resumed(build, ckpt: str, steps: slice, tag: str | None = None) -> dict:
    """A fresh engine from ``build()``, loaded from ``ckpt`` and trained on ``steps``."""
    engine, optimizer = build()
    try:
        engine.load_checkpoint(ckpt, tag)
        return train(engine, optimizer, steps=steps)
    finally:
        engine.close()


def torch_changing_midway(change, model=frozen_model) -> dict:
    """PyTorch trains two steps, ``change(model)`` freezes or unfreezes, then the rest."""
    reference = model()
    optimizer = torch.optim.AdamW(reference.parameters(), fused=True, **OPTIM)
    train_torch(reference, optimizer, steps=slice(2))
    change(reference)
    return train_torch(reference, optimizer, steps=slice(2, None))


def assert_same_states(state: dict, expected: dict) -> None:
    for name in expected:
        assert torch.equal(state[name], expected[name]), name


def train_reference(max_grad_norm=None, device="cpu") -> dict:
    model = frozen_model().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), fused=True, **OPTIM)  # skips grad=None
    return train_torch(model, optimizer, max_grad_norm, device=device)
