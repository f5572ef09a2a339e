"""Optimizer param groups (``optimizer.param_groups`` in the policy) against torch.optim.AdamW
with the same groups: biases and norms without weight decay, at their own learning rate and
betas, and the position table with its own eps, each group on its own LR schedule."""
from __future__ import annotations

import os
from fnmatch import fnmatchcase

import pytest
import torch

import tiered

from distributed import run_ranks
from gpt import next_token_loss
from helpers import REPO, rewrite_manifest
from helpers_models import (GROUPS, MICRO, OPTIM, SCHEDULES, assert_parity, assert_parity_on_host,
                            batches, make_model, run_engine, torch_groups, train_torch)


def engine_with_groups(policy: str, nvme: str, groups=GROUPS, device="cpu", **optimizer):
    return tiered.initialize(
        make_model(), os.path.join(REPO, "configs", f"{policy}.yaml"), compute_dtype="fp32",
        device=device, nvme={"path": nvme},
        optimizer=dict(OPTIM, param_groups=groups, **optimizer))


def train(engine, optimizer, rank: int = 0, world: int = 1, steps=None) -> dict:
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer,
                                                  SCHEDULES[:len(optimizer.param_groups)])
    return run_engine(engine, optimizer, scheduler, slice(steps), rank, world)


def train_reference(max_grad_norm=None, device="cpu") -> dict:
    model = make_model().to(device)
    optimizer = torch.optim.AdamW(torch_groups(model), fused=True, **OPTIM)
    for group in optimizer.param_groups:  # a list of betas would fail torch's fused kernel
        group["betas"] = tuple(group["betas"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, SCHEDULES)
    return train_torch(model, optimizer, max_grad_norm, scheduler, device)


@pytest.mark.parametrize("accumulation_steps", [None, MICRO])
@pytest.mark.parametrize("policy", ["cpu", "nvme", "gpu"])
def test_groups_train_bit_for_bit_as_torch(policy, accumulation_steps, tmp_path):
    # sub_group_size 1024: NVMe states stream in pieces that cut across the groups' runs.
    engine, optimizer = engine_with_groups(policy, str(tmp_path), sub_group_size=1024,
                                           accumulation_steps=accumulation_steps)
    assert len(optimizer.param_groups) == 3
    assert optimizer.param_groups[1]["match"] == GROUPS[0]["match"]
    assert optimizer.param_groups[1]["weight_decay"] == 0.0
    assert optimizer.param_groups[2]["weight_decay"] == OPTIM["weight_decay"]  # not given
    state = train(engine, optimizer)
    engine.close()
    reference = train_reference()
    assert list(state) == list(reference)
    for name in reference:
        assert torch.equal(state[name], reference[name]), name


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["cpu", "gpu"])
def test_groups_on_cuda(policy, tmp_path):
    # The optimizer on the host (cpu) or the device (gpu); the reference steps on the device,
    # with CUDA's fused kernel, so the two agree to rounding.
    engine, optimizer = engine_with_groups(policy, str(tmp_path), device="cuda")
    state = train(engine, optimizer)
    engine.close()
    assert_parity_on_host(state, train_reference(device="cuda"))


def _two_ranks(rank: int, world: int, folder: str) -> None:
    states = {}
    for policy in ("cpu", "nvme"):
        engine, optimizer = engine_with_groups(policy, folder, sub_group_size=1024,
                                               max_grad_norm=0.5)
        states[policy] = train(engine, optimizer, rank, world)
        engine.close()
    torch.save(states, os.path.join(folder, f"rank{rank}.pt"))


def test_groups_with_two_ranks_and_clipping(tmp_path):
    # Shard boundaries fall inside the groups' runs; each rank steps its own part of them.
    run_ranks(2, _two_ranks, str(tmp_path))
    reference = train_reference(max_grad_norm=0.5)
    for rank in range(2):
        for state in torch.load(tmp_path / f"rank{rank}.pt", weights_only=True).values():
            assert_parity(state, reference)


@pytest.mark.parametrize("policy", ["cpu", "nvme"])
def test_bf16_groups_step_each_run_with_its_own_values(policy, tmp_path):
    # bf16 on the CPU steps with the one-pass kernel, run by run.
    def run(groups, nvme):
        os.makedirs(nvme)
        engine, optimizer = tiered.initialize(
            make_model(), os.path.join(REPO, "configs", f"{policy}.yaml"), device="cpu",
            nvme={"path": nvme}, optimizer=dict(OPTIM, param_groups=groups, sub_group_size=1024))
        for micro_batches in batches()[:3]:
            for idx in micro_batches:
                engine.backward(next_token_loss(engine(idx), idx))
            optimizer.step()
            optimizer.zero_grad()
        state = engine.full_state_dict()
        engine.close()
        return state

    initial = make_model().state_dict()
    plain = run(None, str(tmp_path / "plain"))
    # A group with the optimizer's own values changes nothing, to the bit.
    same = run([{"match": ["*.bias", "*ln*"], **OPTIM}], str(tmp_path / "same"))
    zero_lr = run([{"match": ["*.bias", "*ln*"], "lr": 0.0}], str(tmp_path / "zero_lr"))
    for name in initial:
        assert torch.equal(same[name], plain[name]), name
        grouped = fnmatchcase(name, "*.bias") or fnmatchcase(name, "*ln*")
        if grouped:  # lr 0: AdamW leaves them as they were
            assert torch.equal(zero_lr[name], initial[name]), name
        else:
            assert not torch.equal(zero_lr[name], initial[name]), name


def test_a_group_that_matches_nothing_is_refused_before_anything_is_allocated(tmp_path):
    with pytest.raises(tiered.PolicyError) as info:
        engine_with_groups("nvme", str(tmp_path), groups=[*GROUPS, {"match": ["*.bais"]}])
    message = str(info.value)
    assert "optimizer.param_groups[2]" in message and "*.bais" in message
    assert "blocks.0.ln1.weight" in message  # the names it could have matched
    assert os.listdir(tmp_path) == []  # no NVMe run folder was made


def test_groups_added_outside_the_policy_are_refused(tmp_path):
    engine, optimizer = engine_with_groups("cpu", str(tmp_path))
    try:
        optimizer.add_param_group({"params": [], "lr": 1.0})
        with pytest.raises(tiered.TieredError, match="policy, not with add_param_group"):
            optimizer.step()
    finally:
        engine.close()


def test_resume_restores_every_groups_hyperparameters(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    engine, optimizer = engine_with_groups("cpu", str(tmp_path))
    train(engine, optimizer, steps=2)
    saved_lrs = [group["lr"] for group in optimizer.param_groups]
    engine.save_checkpoint(ckpt, "two")
    engine.close()

    engine, optimizer = engine_with_groups("cpu", str(tmp_path))
    engine.load_checkpoint(ckpt)
    assert [group["lr"] for group in optimizer.param_groups] == saved_lrs
    engine.close()

    for other in (GROUPS[:1], GROUPS[::-1]):  # fewer groups, or the same ones reordered
        engine, optimizer = engine_with_groups("cpu", str(tmp_path), groups=other)
        try:
            with pytest.raises(tiered.CheckpointError, match="param_groups it was saved with"):
                engine.load_checkpoint(ckpt)
            fresh = [OPTIM["lr"]] + [group.get("lr", OPTIM["lr"]) for group in other]
            assert [group["lr"] for group in optimizer.param_groups] == fresh  # none loaded
        finally:
            engine.close()


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_shard_ranges_cover_each_shard_with_each_elements_group(world):
    from tiered.engine.flat import FlatParam
    from tiered.optim.groups import group_of, shard_ranges
    from tiered.placement.units import find_units

    groups = tiered.Policy.from_dict({"optimizer": {"param_groups": GROUPS}}).optimizer.param_groups
    specs = find_units(make_model(), None, split_large=True)
    for rank in range(world):
        flats = [FlatParam(spec, rank, world, torch.float32, torch.device("cpu"))
                 for spec in specs]
        for flat, ranges in zip(flats, shard_ranges(flats, groups)):
            # Each element's group, from the parameter holding it (the padding: the last one's).
            expected = torch.cat([torch.full((p.numel,), group_of(p.names, groups))
                                  for p in flat.spec.params])
            expected = torch.cat([expected, expected[-1:].expand(flat.padded_numel - flat.numel)])
            start, stop = flat.shard_range
            got = torch.full((flat.shard_numel,), -1)
            position = 0
            for part in ranges:
                assert part.start == position < part.stop  # contiguous, none empty
                got[part.start:part.stop] = part.group
                position = part.stop
            assert position == flat.shard_numel
            assert torch.equal(got, expected[start:stop]), (flat.name, rank)
            assert all(a.group != b.group for a, b in zip(ranges, ranges[1:]))  # merged


def test_a_checkpoint_of_format_1_still_loads(tmp_path):
    # Format 1 (before param groups): no group_hypers, no param_groups in the saved policy,
    # and (as in format 2) no parameter list per unit.
    ckpt = str(tmp_path / "ckpt")
    engine, optimizer = engine_with_groups("cpu", str(tmp_path), groups=None)
    train(engine, optimizer, steps=2)
    engine.save_checkpoint(ckpt, "old")
    expected = engine.full_state_dict()
    engine.close()
    def as_format_1(manifest):
        assert manifest["format"] == 3
        manifest["format"] = 1
        del manifest["optimizer"]["group_hypers"], manifest["policy"]["optimizer"]["param_groups"]
        del manifest["frozen"]
        for unit in manifest["units"]:
            del unit["params"]

    rewrite_manifest(os.path.join(ckpt, "old"), as_format_1)
    engine, optimizer = engine_with_groups("cpu", str(tmp_path), groups=None)
    try:
        engine.load_checkpoint(ckpt)
        state = engine.full_state_dict()
        assert all(torch.equal(state[name], expected[name]) for name in expected)
    finally:
        engine.close()


def test_a_group_changed_after_the_last_backward_started_is_warned_of(tmp_path):
    # Units stepped as their gradients arrive use the values from the last backward's start.
    engine, optimizer = engine_with_groups("cpu", str(tmp_path), accumulation_steps=1)
    try:
        idx = batches()[0][0]
        engine.backward(next_token_loss(engine(idx), idx))
        optimizer.param_groups[2]["lr"] *= 2  # group 0 and 1 unchanged
        with pytest.warns(UserWarning, match="param_groups changed after the step's last"):
            optimizer.step()
    finally:
        engine.close()
