"""The memory tiers on real memory: HBM (the CPU plays it) and pinned DRAM slabs, on ordinary
pages and on transparent huge pages."""
from __future__ import annotations

import os
import re
import warnings

import pytest
import torch

import tiered
from tiered.core.sizes import align_up, format_size
from tiered.device import CpuAccelerator
from tiered.tiers import DramTier, HbmTier, PinnedSlabSource, dram as dram_module

from gpt import GPT
from helpers_tiers import BLOCK, dram_blocks
from helpers import REPO



# -- helpers ------------------------------------------------------------------------------------

def vm_flags(address: int) -> set[str]:
    """The kernel's flags for the mapping holding ``address`` (/proc/self/smaps VmFlags):
    ``hg`` = advised to use huge pages, ``sh`` = shared."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split(maxsplit=1)[0]
            if re.fullmatch(r"[0-9a-f]+-[0-9a-f]+", head):
                start, end = (int(bound, 16) for bound in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


# -- HBM ----------------------------------------------------------------------------------------

def test_hbm_counts_frees_tracks_peak_and_refuses_over_budget():
    tier = HbmTier(torch.device("cpu"), budget=10_000)
    a = tier.empty(1000, torch.float32, "a")
    b = tier.empty(1000, torch.bfloat16, "b")
    assert a.numel() == 1000 and a.dtype is torch.float32 and a.device.type == "cpu"
    assert (tier.usage.current, tier.usage.peak) == (6000, 6000)
    tier.free(a)
    assert (tier.usage.current, tier.usage.peak) == (2000, 6000)

    with pytest.raises(tiered.BudgetError) as info:
        tier.empty(3000, torch.float32, "too big")
    assert info.value.shortfalls == {"hbm": (14_000, 10_000)}
    message = str(info.value)
    assert "hbm" in message and "too big" in message and format_size(10_000) in message
    assert (tier.usage.current, tier.usage.peak) == (2000, 6000)

    c = tier.empty(2000, torch.float32, "exactly the rest")  # the budget itself is allowed
    assert (tier.usage.current, tier.usage.peak) == (10_000, 10_000)
    tier.free(c)
    tier.free(b)
    assert (tier.usage.current, tier.usage.peak) == (0, 10_000)


def test_hbm_default_budget_is_the_device_capacity():
    import psutil

    assert HbmTier(torch.device("cpu"), None).usage.budget == psutil.virtual_memory().total


@pytest.mark.parametrize("ranks", [1, 4])
def test_dram_default_budget_is_this_ranks_share_of_the_available_memory(ranks):
    from tiered.core.limits import available_memory

    before = available_memory()
    budget = DramTier(None, ranks=ranks).usage.budget
    after = available_memory()
    low, high = sorted((before, after))
    # Available memory moves a little between the reads; the share is 7/8 of it, per rank.
    assert low * 7 // 8 // ranks - (1 << 26) <= budget <= high * 7 // 8 // ranks + (1 << 26)


def test_hbm_failed_allocation_holds_nothing():
    # Within the budget, but no allocator can give 2**58 bytes: the refusal must not stay counted.
    tier = HbmTier(torch.device("cpu"), budget=1 << 62)
    with pytest.raises(RuntimeError):
        tier.empty(1 << 58, torch.uint8, "impossible")
    assert tier.usage.current == 0


# -- DRAM ---------------------------------------------------------------------------------------

def check_blocks(tier: DramTier, requests: dict, blocks: dict) -> None:
    assert set(blocks) == set(requests)
    ranges = []
    for key, nbytes in requests.items():
        block = blocks[key]
        assert block.dtype is torch.uint8 and block.device.type == "cpu" and block.dim() == 1
        assert block.is_contiguous()
        assert block.data_ptr() % BLOCK == 0, (key, block.data_ptr())
        assert block.numel() == align_up(max(nbytes, 1), BLOCK), (key, nbytes, block.numel())
        ranges.append((block.data_ptr(), block.data_ptr() + block.numel(), key))
    ranges.sort()
    for (_, end, k1), (start, _, k2) in zip(ranges, ranges[1:]):
        assert end <= start, f"blocks {k1} and {k2} overlap"
    # Each block is distinct memory: fill each with its own value, then all must still hold it.
    for i, key in enumerate(requests):
        blocks[key].fill_(i + 1)
    for i, key in enumerate(requests):
        assert bool((blocks[key] == i + 1).all()), f"block {key} was overwritten"


def test_dram_blocks_aligned_disjoint_and_counted_exactly():
    requests = {"one": 1, "page": 4096, "odd": 5000, "zero": 0, ("unit", 3): 3 * 4096 + 7}
    tier, blocks = dram_blocks(requests)
    check_blocks(tier, requests, blocks)
    expected = sum(align_up(max(n, 1), BLOCK) for n in requests.values())
    assert tier.usage.current == tier.usage.peak == expected
    assert sum(s.numel() for s in tier._slabs) == expected  # what is allocated is what is counted
    tier.close()
    assert tier.usage.current == 0 and tier._slabs == []


def test_dram_packs_many_blocks_into_several_slabs(monkeypatch):
    slab = 64 << 10
    monkeypatch.setattr(dram_module, "SLAB_BYTES", slab)
    requests = {f"b{i}": (i * 3001) % 20000 + 1 for i in range(40)}
    requests["huge"] = 3 * slab + 123  # larger than a slab: a slab of its own
    requests["exact"] = slab
    tier, blocks = dram_blocks(requests)
    check_blocks(tier, requests, blocks)
    expected = sum(align_up(max(n, 1), BLOCK) for n in requests.values())
    assert tier.usage.current == expected
    huge = align_up(requests["huge"], BLOCK)
    assert len(tier._slabs) >= 1 + -(-(expected - huge) // slab) >= 3
    assert sum(s.numel() for s in tier._slabs) == expected
    for s in tier._slabs:
        assert s.data_ptr() % BLOCK == 0
        assert s.numel() <= max(slab, align_up(requests["huge"], BLOCK))
    # A second reservation adds to the first, disjoint from it.
    more = {"late": 10_000}
    blocks2 = tier.reserve(more)
    assert tier.usage.current == expected + align_up(10_000, BLOCK)
    everything = {**requests, **more}
    check_blocks(tier, everything, {**blocks, **blocks2})


THP = pytest.mark.skipif(not os.path.exists(dram_module.THP_MODE),
                         reason="a kernel without transparent huge pages")


@THP
def test_dram_huge_page_slabs_are_advised_private_and_counted_exactly(monkeypatch):
    # Private: a shared anonymous mapping is shmem, which ignores the advice by default
    # (shmem_enabled), and the slabs would silently stay on 4 KiB pages.
    monkeypatch.setattr(dram_module, "SLAB_BYTES", 4 << 20)
    requests = {"a": 3 << 20, "b": 5000, "c": 1, "big": (6 << 20) + 3}
    tier, blocks = dram_blocks(requests, huge_pages=True)
    check_blocks(tier, requests, blocks)
    assert sum(s.numel() for s in tier._slabs) == tier.usage.current == sum(
        align_up(n, BLOCK) for n in requests.values())
    for slab in tier._slabs:
        assert slab.data_ptr() % dram_module.HUGE_PAGE == 0
        flags = vm_flags(slab.data_ptr())
        assert "hg" in flags and "sh" not in flags, flags
    tier.close()
    assert tier.usage.current == 0


def test_dram_huge_pages_warns_where_they_are_off(monkeypatch, tmp_path):
    modes = tmp_path / "enabled"
    modes.write_text("always madvise [never]\n")
    monkeypatch.setattr(dram_module, "THP_MODE", str(modes))
    with pytest.warns(UserWarning, match=r"dram.huge_pages.*\[never\]"):
        PinnedSlabSource(CpuAccelerator(), huge_pages=True)
    modes.write_text("always [madvise] never\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        PinnedSlabSource(CpuAccelerator(), huge_pages=True)


@THP
def test_engine_dram_on_huge_pages():
    engine, _ = tiered.initialize(GPT(63, 64, 2, 2), os.path.join(REPO, "configs", "cpu.yaml"),
                                  device="cpu", dram={"huge_pages": True})
    try:
        assert engine.manager.dram._slabs
        for slab in engine.manager.dram._slabs:
            assert "hg" in vm_flags(slab.data_ptr())
    finally:
        engine.close()


def test_dram_over_budget_names_needed_and_available_and_holds_nothing():
    tier = DramTier(budget=3 * BLOCK, source=PinnedSlabSource(CpuAccelerator()))
    tier.reserve({"a": BLOCK, "b": 100})
    slabs = list(tier._slabs)
    with pytest.raises(tiered.BudgetError) as info:
        tier.reserve({"c": BLOCK, "d": 1})
    assert info.value.shortfalls == {"dram": (4 * BLOCK, 3 * BLOCK)}
    message = str(info.value)
    assert message.startswith("dram")
    assert format_size(2 * BLOCK) in message and format_size(3 * BLOCK) in message
    assert tier.usage.current == 2 * BLOCK and tier._slabs == slabs
    tier.reserve({"e": 1})  # exactly up to the budget still works
    assert tier.usage.current == 3 * BLOCK


def test_dram_reservation_is_all_or_nothing_when_a_slab_cannot_be_had(monkeypatch):
    monkeypatch.setattr(dram_module, "SLAB_BYTES", 2 * BLOCK)

    class FailingSecondSlab(PinnedSlabSource):
        """The second slab fails, as pinning does when memory runs out."""

        def __init__(self):
            super().__init__(CpuAccelerator())
            self.made, self.released = [], []

        def __call__(self, nbytes):
            if len(self.made) == 1:
                raise RuntimeError("cannot pin memory")
            self.made.append(super().__call__(nbytes))
            return self.made[-1]

        def release(self, slab):
            self.released.append(slab)

    source = FailingSecondSlab()
    tier = DramTier(budget=None, source=source)
    with pytest.raises(RuntimeError, match="cannot pin"):
        tier.reserve({"a": 2 * BLOCK, "b": 2 * BLOCK, "c": BLOCK})
    assert len(source.made) == 1 and source.released == source.made, "first slab kept pinned"
    assert tier.usage.current == 0 and tier._slabs == []


def test_a_plan_is_adopted_over_the_blocks_its_descriptors_name_and_refused_without_them():
    """The seam between a trainer and the node's service: the trainer's manager names where each
    DRAM state and staging buffer lies (descriptors); a manager that adopts the plan over
    blocks found by those descriptors computes on the very same memory, and one missing a
    block, or given a smaller one, is refused naming it."""
    from tiered.core.errors import TieredError
    from tiered.placement.manager import TierManager
    from tiered.placement.plan import Buffer, MemoryPlan, StateKind
    from tiered.policy.config import Policy
    from tiered.policy.kinds import Tier

    cpu = torch.device("cpu")
    plan = MemoryPlan(shards={
        (0, StateKind.MASTER): Buffer("unit 0 master", Tier.DRAM, 1000, torch.float32),
        (0, StateKind.EXP_AVG): Buffer("unit 0 exp_avg", Tier.DRAM, 1000, torch.float32),
        (1, StateKind.MASTER): Buffer("unit 1 master", Tier.DRAM, 3000, torch.float32)},
        staging={"grad0": Buffer("grad landing", Tier.DRAM, 8192, torch.uint8)}, working_set=0)
    trainer = TierManager(Policy(), cpu, 0)
    trainer.allocate(plan)
    memory = {}  # one "segment" per slab of the trainer's, as the service names them

    def locate(block: torch.Tensor) -> tuple[int, int]:
        for number, slab in enumerate(trainer.dram._slabs):
            start = slab.data_ptr()
            if start <= block.data_ptr() < start + slab.numel():
                memory[number] = slab
                return number, block.data_ptr() - start
        raise AssertionError("a block outside the slabs")

    described = trainer.descriptors(locate)
    assert set(described) == {*plan.shards, ("staging", "grad0")}
    blocks = {key: memory[segment][at:at + nbytes]
              for key, (segment, at, nbytes) in described.items()}
    host = TierManager(Policy(), cpu, 0)
    host.adopt(plan, blocks)
    trainer.load(1, StateKind.MASTER).fill_(3.0)
    assert torch.equal(host.load(1, StateKind.MASTER), torch.full((3000,), 3.0))
    assert host.staging_block("grad0").data_ptr() == trainer.staging_block("grad0").data_ptr()
    short = dict(blocks)
    del short[(0, StateKind.EXP_AVG)]
    with pytest.raises(TieredError, match=r"no block of the plan's size for \(0, <StateKind"):
        TierManager(Policy(), cpu, 0).adopt(plan, short)
    short[(0, StateKind.EXP_AVG)] = blocks[(0, StateKind.EXP_AVG)][:2048]
    with pytest.raises(TieredError, match="1 of 4"):
        TierManager(Policy(), cpu, 0).adopt(plan, short)
    trainer.close()
