"""Budgets at their edges: what each tier holds, computed here by hand from the model's parameter
counts, against what the engine reports; budgets exactly large enough and one byte short; the
DRAM spill; the prefetch byte limits; budgets written as strings.

Bytes per parameter of each state a rank keeps for one unit's shard (ceil(numel / world) elements,
each state a whole number of 4 KiB blocks in DRAM and on NVMe):
- weights (PARAM): the compute dtype, 2 (bf16, fp16) or 4 (fp32): what gathers read;
- the delayed update's next weights (PARAM_NEXT): the compute dtype again (a double buffer);
- gradient: 4 (an fp32 sum of backwards), or the compute dtype with ``accumulation_steps: 1``
  (no sum ever needs fp32);
- master weights, exp_avg, exp_avg_sq: 4 each (fp32 AdamW).
A unit of frozen parameters only keeps its weights, plus fp32 masters when the compute dtype
would round them (fp32 parameters computed in bf16 or fp16).
"""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import tiered
from tiered.core.sizes import parse_size
from tiered.device import CpuAccelerator
from tiered.policy.config import Policy
from tiered.policy.kinds import Tier
from tiered.tiers import PinnedSlabSource

from distributed import run_ranks
from gpt import GPT, add_lora, next_token_loss
from helpers_models import make_gpt
from helpers import REPO

VOCAB, SEQ = 64, 16
SPARES = 3  # spare extents per NVMe extent size ([Note: atomic shard writes] in tiers/nvme.py)


# -- helpers ------------------------------------------------------------------------------------

def block(nbytes: int) -> int:
    """A DRAM block or NVMe extent: whole 4 KiB blocks, at least one."""
    return -(-max(nbytes, 1) // 4096) * 4096


def shard(numel: int, world: int = 1) -> int:
    return -(-numel // world)


def unit_numels(model: GPT) -> list[tuple[int, bool]]:
    """(elements, trainable) of each unit, from the model's parameters alone: each block, cut in
    its frozen and trainable parameters when it has both, then the root (the rest; the tied
    embedding counted once)."""
    units = []
    in_blocks = set()
    for b in model.blocks:
        params = list(b.parameters())
        in_blocks.update(id(p) for p in params)
        frozen = sum(p.numel() for p in params if not p.requires_grad)
        trained = sum(p.numel() for p in params if p.requires_grad)
        units += [(n, trainable) for n, trainable in ((frozen, False), (trained, True)) if n]
    rest = [p for p in model.parameters() if id(p) not in in_blocks]
    frozen = sum(p.numel() for p in rest if not p.requires_grad)
    trained = sum(p.numel() for p in rest if p.requires_grad)
    units += [(n, trainable) for n, trainable in ((frozen, False), (trained, True)) if n]
    return units


def freeze_first_blocks(model: GPT, count: int) -> GPT:
    """Whole blocks frozen below trained ones: backward still crosses them (the embedding
    trains), so they are gathered in backward without a gradient of their own."""
    for b in model.blocks[:count]:
        b.requires_grad_(False)
    return model


def step(engine, optimizer, seed: int) -> None:
    idx = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(seed))
    engine.backward(next_token_loss(engine(idx), idx))
    optimizer.step()
    optimizer.zero_grad()


class RecordingSlabs(PinnedSlabSource):
    """Ordinary (4 KiB-aligned) DRAM slabs, each one asked for recorded."""

    def __init__(self):
        super().__init__(CpuAccelerator())
        self.made: list[int] = []

    def __call__(self, nbytes: int) -> torch.Tensor:
        self.made.append(nbytes)
        return super().__call__(nbytes)


# -- what each tier holds, by hand ----------------------------------------------------------------

@pytest.mark.parametrize("compute_dtype,itemsize", [("fp16", 2), ("bf16", 2), ("fp32", 4)])
def test_dram_of_lora_with_delayed_update_and_compact_grads_is_the_formula(compute_dtype,
                                                                          itemsize):
    # Every state kind at once: trained halves keep weights, next weights, a compact gradient
    # (accumulation_steps: 1) and fp32 AdamW; frozen halves keep their weights, and fp32
    # masters only where 16-bit compute would round the fp32 parameters.
    model = add_lora(make_gpt(), 4)
    units = unit_numels(model)
    assert [t for _, t in units] == [False, True] * 3 + [False]  # the root: all frozen
    engine, optimizer = tiered.initialize(
        model, os.path.join(REPO, "configs", "cpu.yaml"), device="cpu",
        compute_dtype=compute_dtype,
        optimizer={"accumulation_steps": 1, "lr": 1e-3,
                   "delayed_update": {"enabled": True, "warmup_steps": 1}})
    masters = itemsize < 4
    expected = sum(3 * block(n * itemsize) + 3 * block(n * 4) if trainable
                   else block(n * itemsize) + masters * block(n * 4) for n, trainable in units)
    for seed in range(3):
        step(engine, optimizer, seed)
        report = engine.memory_report()
        assert report["dram"]["current"] == report["dram"]["peak"] == expected
    engine.close()


def test_nvme_and_dram_of_the_nvme_policy_with_the_delayed_update_are_the_formula(tmp_path):
    # configs/nvme.yaml in bf16: weights (both buffers) and AdamW on NVMe, each extent size with
    # its spares; DRAM holds the fp32 gradients and the staging: two read-ahead buffers and one
    # write-back buffer of the largest weight shard, and three sets of master/exp_avg/exp_avg_sq
    # sub-group buffers (sub_group_size is larger than any shard here: a shard each).
    model = make_gpt()
    units = [n for n, _ in unit_numels(model)]
    engine, optimizer = tiered.initialize(
        model, os.path.join(REPO, "configs", "nvme.yaml"), device="cpu", compute_dtype="bf16",
        nvme={"path": str(tmp_path)},
        optimizer={"delayed_update": {"enabled": True, "warmup_steps": 1}})
    extents = [size for n in units for size in (block(2 * n),) * 2 + (block(4 * n),) * 3]
    nvme = sum(extents) + SPARES * sum(set(extents))
    largest = max(units)
    dram = (sum(block(4 * n) for n in units) + 3 * block(2 * largest)
            + 9 * block(4 * largest))
    for seed in range(3):
        step(engine, optimizer, seed)
        report = engine.memory_report()
        assert (report["nvme"]["current"], report["nvme"]["peak"]) == (nvme, nvme)
        assert (report["dram"]["current"], report["dram"]["peak"]) == (dram, dram)
    engine.close()
    assert os.listdir(tmp_path) == []


def test_tiled_linear_units_hold_the_formula():
    # A 64 x 512 head over 8 KiB of bf16 per unit is 8 tiles of 64 x 64; with the two 64 x 64
    # layers beside it, ten units of 4096 elements, and no root (it holds no parameter).
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False),
                             nn.Linear(64, 512, bias=False))

    engine, optimizer = tiered.initialize(model(), device="cpu", compute_dtype="bf16",
                                          tiling={"max_unit_bytes": 64 * 64 * 2})
    assert [f.numel for f in engine.runtime.flats] == [4096] * 10
    expected = 10 * (block(4096 * 2) + 4 * block(4096 * 4))
    for seed in range(2):
        engine(torch.randn(4, 64)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        report = engine.memory_report()["dram"]
        assert report["current"] == report["peak"] == expected
    engine.close()


def _two_ranks_main(rank: int, world: int, out_dir: str) -> None:
    """Each rank: the DRAM its shards take, and a run under budgets of exactly its plan."""
    policy = Policy.from_yaml(os.path.join(REPO, "configs", "cpu.yaml"), dict(
        device="cpu", compute_dtype="bf16",
        optimizer={"accumulation_steps": 1, "delayed_update": {"enabled": True,
                                                               "warmup_steps": 1}}))
    probe, _ = tiered.initialize(add_lora(make_gpt(), 4), policy)
    plan = probe.manager.plan
    first = probe.memory_report()["dram"]["current"]
    needed = {tier: plan.needed(tier) for tier in (Tier.HBM, Tier.DRAM)}
    probe.close()
    engine, optimizer = tiered.initialize(add_lora(make_gpt(), 4), policy.replace(
        hbm={"budget": needed[Tier.HBM]}, dram={"budget": needed[Tier.DRAM]}))
    for seed in range(3):
        step(engine, optimizer, 2 * seed + rank)
    report = engine.memory_report()
    engine.full_state_dict()
    engine.close()
    torch.save({"first": first, "report": report}, os.path.join(out_dir, f"rank{rank}.pt"))


def test_two_ranks_each_hold_their_shards_and_train_within_budgets_of_exactly_the_plan(tmp_path):
    run_ranks(2, _two_ranks_main, str(tmp_path))
    units = unit_numels(add_lora(make_gpt(), 4))
    # bf16, fp32 parameters: frozen halves keep bf16 weights and fp32 masters; trained ones
    # weights, next weights and a compact gradient in bf16, and fp32 AdamW; ceil(n/2) each.
    expected = sum(3 * block(shard(n, 2) * 2) + 3 * block(shard(n, 2) * 4) if trainable
                   else block(shard(n, 2) * 2) + block(shard(n, 2) * 4) for n, trainable in units)
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert result["first"] == expected
        report = result["report"]
        assert report["dram"]["peak"] == report["dram"]["budget"] == expected
        assert report["hbm"]["peak"] <= report["hbm"]["budget"]


# -- budgets exactly large enough, and one byte short -------------------------------------------

@pytest.mark.parametrize("name,model,overrides", [
    ("lora, fp16, delayed, compact", lambda: add_lora(make_gpt(), 4),
     dict(compute_dtype="fp16", optimizer={"accumulation_steps": 1, "delayed_update": {
         "enabled": True, "warmup_steps": 1}})),
    ("tiled, bf16", make_gpt, dict(compute_dtype="bf16", tiling={"max_unit_bytes": 3000})),
    ("two blocks frozen, prefetch of 1.5 blocks", lambda: freeze_first_blocks(make_gpt(4), 2),
     dict(compute_dtype="bf16", prefetch={"hbm_bytes": 3 * 12704})),  # a block: 12704 * 2 bytes
    ("weights on the device, delayed", make_gpt,
     dict(compute_dtype="bf16", params={"tier": "hbm"}, grads={"tier": "hbm"},
          optimizer={"tier": "hbm", "delayed_update": {"enabled": True, "warmup_steps": 1}})),
])
def test_budgets_of_exactly_the_plan_train_and_are_never_passed(name, model, overrides):
    # Transient HBM (gathered units, gradients on their way, prefetches) against the plan's
    # working set, for policies the existing budget test (nvme.yaml in fp32) does not combine.
    build = model
    policy = Policy.from_dict(dict(device="cpu", **overrides))
    probe, _ = tiered.initialize(build(), policy)
    plan = probe.manager.plan
    needed = {tier: plan.needed(tier) for tier in (Tier.HBM, Tier.DRAM)}
    probe.close()
    engine, optimizer = tiered.initialize(build(), policy.replace(
        hbm={"budget": needed[Tier.HBM]}, dram={"budget": needed[Tier.DRAM]}))
    for seed in range(3):
        step(engine, optimizer, seed)
    engine.full_state_dict()
    report = engine.memory_report()
    engine.close()
    assert report["dram"]["peak"] == needed[Tier.DRAM]
    assert 0 < report["hbm"]["peak"] <= needed[Tier.HBM]


@pytest.mark.parametrize("tier", ["dram", "nvme"])
def test_one_byte_short_is_refused_naming_the_tier_before_any_slab_or_file(tier, tmp_path):
    # A policy with nothing to cut for speed, so a byte short is refused, not bent (see
    # [Note: the working set bends]; test_memory bends the full one).
    policy = Policy.from_yaml(os.path.join(REPO, "configs", "nvme.yaml"), dict(
        device="cpu", compute_dtype="fp32", nvme={"path": str(tmp_path)},
        grads={"landing_slots": 1}, prefetch={"enabled": False}))
    probe, _ = tiered.initialize(make_gpt(), policy)
    needed = probe.manager.plan.needed(Tier(tier))
    probe.close()
    slabs = RecordingSlabs()
    with pytest.raises(tiered.BudgetError) as error:
        tiered.initialize(make_gpt(), policy.replace(**{tier: {"budget": needed - 1}}),
                          dram_source=slabs)
    assert error.value.shortfalls == {tier: (needed, needed - 1)}
    message = str(error.value)
    assert f"{tier}: needs" in message and f"({needed} bytes)" in message
    assert f"({needed - 1} bytes) available" in message
    assert slabs.made == [], "DRAM was pinned before the refusal"
    assert os.listdir(tmp_path) == [], "the refusal left an NVMe folder behind"
    engine, _ = tiered.initialize(make_gpt(), policy.replace(**{tier: {"budget": needed}}),
                                  dram_source=RecordingSlabs())
    assert engine.memory_report()[tier]["current"] == needed
    engine.close()


@pytest.mark.parametrize("key", ["hbm", "dram"])
@pytest.mark.parametrize("zero", [0, "0", "0GiB"])
def test_a_zero_budget_is_refused_at_initialize_naming_its_tier(key, zero):
    with pytest.raises(tiered.BudgetError) as error:
        tiered.initialize(make_gpt(), device="cpu", **{key: {"budget": zero}})
    (tier, (needed, available)), = error.value.shortfalls.items()
    assert (tier, available) == (key, 0) and needed > 0


@pytest.mark.parametrize("key", ["hbm_bytes", "dram_bytes"])
@pytest.mark.parametrize("value", ["12 parsecs", "-1MB", -1, 1.5, "1e-3"])
def test_bad_prefetch_byte_limits_name_their_key(key, value):
    with pytest.raises(tiered.PolicyError) as error:
        Policy.from_dict({"prefetch": {key: value}})
    message = str(error.value)
    assert f"prefetch.{key}" in message and ("byte size" in message or "negative" in message)


@pytest.mark.parametrize("text,expected", [("1.5GiB", 3 * 2**29), ("100MB", 10**8),
                                           (" 2 kib ", 2048), ("0", 0)])
def test_budget_strings_are_exact_bytes_in_every_budget_key(text, expected):
    policy = Policy.from_dict({"hbm": {"budget": text}, "dram": {"budget": text},
                               "nvme": {"budget": text, "path": "/tmp"},
                               "prefetch": {"hbm_bytes": text, "dram_bytes": text}})
    assert (policy.hbm.budget, policy.dram.budget, policy.nvme.budget, policy.prefetch.hbm_bytes,
            policy.prefetch.dram_bytes) == (expected,) * 5


# -- the DRAM spill ------------------------------------------------------------------------------

def test_one_byte_short_spills_exactly_the_largest_units_optimizer_states(tmp_path):
    # fp32, cpu.yaml: every state 4 bytes per parameter. One byte short of the whole: the
    # largest unit's master weights and moments (its first block: blocks come first, the root
    # is smaller) go to NVMe, with three sets of three 1024-element staging buffers, and nothing
    # else; that frees far more than the byte.
    model = make_gpt(4)
    units = [n for n, _ in unit_numels(model)]
    whole = sum(5 * block(4 * n) for n in units)
    policy = dict(device="cpu", compute_dtype="fp32", nvme={"path": str(tmp_path)},
                  optimizer={"sub_group_size": 1024})
    engine, _ = tiered.initialize(model, os.path.join(REPO, "configs", "cpu.yaml"),
                                  dram={"budget": whole - 1, "spill": "nvme"}, **policy)
    placement = engine.placement()
    report = engine.memory_report()
    engine.close()
    moved = {name: kinds for name, kinds in placement.items() if "nvme" in kinds.values()}
    assert moved == {"blocks.0": {"param": "dram", "grad": "dram", "master": "nvme",
                                  "exp_avg": "nvme", "exp_avg_sq": "nvme"}}
    largest = block(4 * units[0])
    assert report["dram"]["peak"] == whole - 3 * largest + 9 * block(1024 * 4)
    assert report["nvme"]["current"] == (3 + SPARES) * largest
    assert os.listdir(tmp_path) == []


# -- prefetch byte limits --------------------------------------------------------------------------

def test_units_larger_than_both_prefetch_limits_train_as_without_limits(tmp_path):
    # One byte of each: no unit fits, so nothing is gathered ahead and NVMe weights are read
    # through a single pinned buffer; no wait may hang on a limit no unit can meet.
    def run(prefetch):
        engine, optimizer = tiered.initialize(
            make_gpt(), os.path.join(REPO, "configs", "nvme.yaml"), device="cpu",
            compute_dtype="fp32", nvme={"path": str(tmp_path)}, prefetch=prefetch,
            optimizer={"sub_group_size": 1024})
        fetched = []
        engine.runtime.prefetcher.on_fetch = lambda unit, ahead: fetched.append(unit)
        for seed in range(3):
            step(engine, optimizer, seed)
        slots = engine.manager.staging_names("param_in")
        state = engine.full_state_dict()
        engine.close()
        return state, fetched, slots

    reference, fetched, slots = run({})
    assert fetched and len(slots) == 2
    state, fetched, slots = run({"hbm_bytes": 1, "dram_bytes": 1})
    assert fetched == [] and slots == ["param_in0"]
    assert all(torch.equal(state[name], reference[name]) for name in reference)


def test_read_ahead_buffers_stay_within_prefetch_dram_bytes(tmp_path):
    # prefetch.dram_bytes is the pinned bytes of NVMe weights read ahead. The largest bf16
    # weight shard (a block's) is 2n bytes, and its pinned buffer a whole number of 4 KiB
    # blocks: a limit of two shards' bytes has room for one such buffer, not two.
    n = max(n for n, _ in unit_numels(make_gpt()))

    def read_ahead_bytes(limit):
        engine, _ = tiered.initialize(
            make_gpt(), os.path.join(REPO, "configs", "nvme.yaml"), device="cpu",
            compute_dtype="bf16", nvme={"path": str(tmp_path)}, prefetch={"dram_bytes": limit})
        manager = engine.manager
        pinned = sum(manager.staging_block(name).numel()
                     for name in manager.staging_names("param_in"))
        engine.close()
        return pinned

    assert read_ahead_bytes(2 * block(2 * n)) == 2 * block(2 * n)
    limit = 2 * 2 * n
    assert block(2 * n) <= limit < 2 * block(2 * n)
    assert read_ahead_bytes(limit) <= limit


# -- bugs ----------------------------------------------------------------------------------------

D, BLOCKS = 64, 8


class SharedBasis(nn.Module):
    """``tanh(x @ own @ basis)``: ``own`` is this layer's, ``basis`` one matrix every layer
    shares (a weight tied across blocks)."""

    def __init__(self, basis: nn.Parameter):
        super().__init__()
        self.own = nn.Parameter(torch.empty(D, D))
        self.basis = basis
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.own, std=D ** -0.5)
        nn.init.normal_(self.basis, std=D ** -0.5)

    def forward(self, x):
        return torch.tanh(x @ self.own @ self.basis)


class SharedBasisNet(nn.Module):
    def __init__(self):
        super().__init__()
        basis = nn.Parameter(torch.empty(D, D))
        self.blocks = nn.ModuleList(SharedBasis(basis) for _ in range(BLOCKS))

    def forward(self, x):
        for layer in self.blocks:
            x = layer(x)
        return x


def test_building_a_unit_under_tiered_init_stays_within_the_planned_hbm():
    # Units: each block's ``own`` (D*D), and the root with the shared basis (D*D). Under
    # tiered.init, building blocks.0 materializes every meta parameter of the modules holding
    # its parameters, and through the tied basis those of every block: the whole model, in
    # fp32 on the device, beside blocks.0's fp32 flat copy.
    policy = Policy.from_dict(dict(device="cpu", compute_dtype="bf16"))
    with tiered.init(policy):
        model = SharedBasisNet()
    engine, _ = tiered.initialize(model)
    assert [f.numel for f in engine.runtime.flats] == [D * D] * (BLOCKS + 1)
    planned = engine.manager.plan.needed(Tier.HBM)
    peak = engine.memory_report()["hbm"]["peak"]
    engine.close()
    assert peak == (BLOCKS + 1) * D * D * 4 + D * D * 4
    assert peak <= planned, (f"initialize held {peak} bytes of HBM building a unit; the plan "
                             f"that budgets are checked against says {planned}")
    with tiered.init(policy):
        model = SharedBasisNet()
    engine, _ = tiered.initialize(model, policy.replace(hbm={"budget": planned}))
    engine.close()


def test_a_byte_count_with_a_fraction_of_a_byte_is_refused_as_the_number_is():
    # parse_size(1.5) is refused (no fraction of a byte); the same count written as a string
    # was truncated silently, so a budget of "0.5B" became a budget of 0 bytes.
    with pytest.raises(ValueError, match="byte size"):
        parse_size(1.5)
    with pytest.raises(ValueError):
        parse_size("1.5")
    with pytest.raises(tiered.PolicyError, match=r"dram\.budget"):
        Policy.from_dict({"dram": {"budget": "0.5B"}})
