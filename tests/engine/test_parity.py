"""Parity with plain PyTorch + torch.optim.AdamW: the engine must train the same model.

fp32 compute on the CPU; each rank takes its part of every batch, gradients average across ranks
(DDP semantics) and sum over the two micro-batches of each step (gradient accumulation).
"""
from __future__ import annotations

import json
import os

import pytest
import torch

import tiered

from distributed import run_ranks
from gpt import next_token_loss
from helpers import REPO
from helpers_models import (BATCH, MICRO, OPTIM, POLICIES, STEPS, assert_parity, batches,
                            make_model, train_torch)


def train_engine(policy: str, rank: int, world: int, nvme: str, max_grad_norm: float | None,
                 accumulation_steps: int | None = None):
    engine, optimizer = tiered.initialize(
        make_model(), os.path.join(REPO, "configs", f"{policy}.yaml"), compute_dtype="fp32",
        device="cpu", nvme={"path": nvme},
        optimizer=dict(OPTIM, max_grad_norm=max_grad_norm, accumulation_steps=accumulation_steps))
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    norms = []
    for micro_batches in batches():
        for idx in micro_batches:
            (next_token_loss(engine(idx[rows]), idx[rows]) / MICRO).backward()
        optimizer.step()
        optimizer.zero_grad()
        norms.append(optimizer.last_grad_norm)
    state = engine.full_state_dict()
    engine.close()
    return state, norms


def train_reference(max_grad_norm: float | None, fused: bool = False):
    model = make_model()
    return train_torch(model, torch.optim.AdamW(model.parameters(), fused=fused, **OPTIM),
                       max_grad_norm)


def _rank_main(rank: int, world: int, out_dir: str, nvme: str) -> None:
    results = {p: train_engine(p, rank, world, nvme, max_grad_norm=0.5) for p in POLICIES}
    # Declared accumulation: each rank's norm shares are taken as the gradients arrive.
    results["cpu, accumulation declared"] = train_engine("cpu", rank, world, nvme, 0.5, MICRO)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("accumulation_steps", [None, MICRO])
@pytest.mark.parametrize("policy", POLICIES)
def test_one_rank_without_clipping_is_bit_for_bit(policy, accumulation_steps, tmp_path):
    # Same kernels on the same values: the fused AdamW step of torch, on identical gradients.
    # With accumulation_steps, units are stepped as the last backward delivers their gradient.
    state, _ = train_engine(policy, 0, 1, str(tmp_path), max_grad_norm=None,
                            accumulation_steps=accumulation_steps)
    reference = train_reference(max_grad_norm=None, fused=True)
    assert list(state) == list(reference)
    for name in reference:
        assert torch.equal(state[name], reference[name]), name


@pytest.mark.parametrize("policy", POLICIES)
def test_one_rank_with_clipping(policy, tmp_path):
    state, norms = train_engine(policy, 0, 1, str(tmp_path), max_grad_norm=0.5)
    assert max(norms) > 0.5, "clipping never triggered; the test would not exercise it"
    assert_parity(state, train_reference(max_grad_norm=0.5))


@pytest.mark.parametrize("policy", ["cpu", "nvme"])
def test_clipping_takes_each_norm_as_the_last_backward_delivers_it(policy, tmp_path,
                                                                   monkeypatch):
    """With accumulation_steps declared, the worker takes each unit's norm while backward still
    runs: in the trace every step's norms come before its AdamW; the step is PyTorch's."""
    trace = tmp_path / "trace.json"
    monkeypatch.setenv("TIERED_TRACE", str(trace))
    state, norms = train_engine(policy, 0, 1, str(tmp_path), max_grad_norm=0.5,
                                accumulation_steps=MICRO)
    assert max(norms) > 0.5
    assert_parity(state, train_reference(max_grad_norm=0.5))
    events = sorted((e for e in json.loads(trace.read_text())["traceEvents"]
                     if e["name"].startswith(("grad norm", "adamw"))), key=lambda e: e["ts"])
    units = len(make_model().blocks) + 1
    kinds = [e["name"].split(" ")[0] for e in events]
    runs = [kind for i, kind in enumerate(kinds) if i == 0 or kinds[i - 1] != kind]
    assert kinds.count("grad") == units * STEPS
    assert runs == ["grad", "adamw"] * STEPS


def test_two_ranks_every_policy(tmp_path):
    run_ranks(2, _rank_main, str(tmp_path), str(tmp_path))
    reference = train_reference(max_grad_norm=0.5)
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        for policy in results:
            state, norms = results[policy]
            assert max(norms) > 0.5
            assert_parity(state, reference)
    assert not [p for p in os.listdir(tmp_path) if p.startswith("tiered-")], \
        "NVMe run folders left behind"


def _rank_cpu_policy(rank: int, world: int, out_dir: str, nvme: str) -> None:
    torch.save(train_engine("cpu", rank, world, nvme, max_grad_norm=0.5),
               os.path.join(out_dir, f"rank{rank}.pt"))


def test_two_ranks_give_the_same_bits_in_every_run(tmp_path):
    """Two runs of two ranks (new processes each) end with the same bits, weights and norms:
    what the box's results and a resumed run are compared by."""
    runs = []
    for run in ("first", "second"):
        os.mkdir(tmp_path / run)
        run_ranks(2, _rank_cpu_policy, str(tmp_path / run), str(tmp_path))
        runs.append([torch.load(tmp_path / run / f"rank{rank}.pt", weights_only=True)
                     for rank in range(2)])
    for (state, norms), (again, norms_again) in zip(*runs):
        assert norms == norms_again
        assert list(state) == list(again)
        for name in state:
            assert torch.equal(state[name], again[name]), name


@pytest.mark.parametrize("wrong", [dict(weight_decay=0.0), dict(betas=(0.9, 0.999)),
                                   dict(amsgrad=True)],
                         ids=["decay dropped", "default betas", "amsgrad's maximum"])
def test_the_parity_bound_fails_a_wrong_rule(wrong):
    """What [Note: ulps AdamW enlarges] lets pass is a few enlarged ulps, not a wrong rule: an
    AdamW with one rule changed, trained as the reference is, fails assert_parity against it."""
    model = make_model()
    wrongly = train_torch(model, torch.optim.AdamW(model.parameters(), **dict(OPTIM, **wrong)),
                          max_grad_norm=0.5)
    with pytest.raises(AssertionError, match="elements outside rtol"):
        assert_parity(wrongly, train_reference(max_grad_norm=0.5))
