"""HBM budgets against bounds written by hand from the model's shapes, and device memory measured
outside the engine's own counters.

The other budget tests take their bounds from ``plan.needed()``, ``hbm_working_set(...)`` or
``GRAD_LANDING_SLOTS``, so a plan that forgot a term (the gradients in flight multiplied by 0)
passed all of them: the engine, its plan and the test agreed with each other. Here every number
is arithmetic on the model below, written out, and what the device holds is counted by the test
itself (see :class:`DeviceBytes`).

The model: four blocks of one class, ``x + down(tanh(up(x)))`` with ``up`` W x h and ``down``
h x W (no biases), of hidden widths 32, 128, 64, 96 at W = 64, and a 64 -> 16 head outside the
blocks (too small for a unit of its own: it is the root's). So the units and their elements:

    blocks.0  2 * 64 * 32  =  4096
    blocks.1  2 * 64 * 128 = 16384   (the largest, L1)
    blocks.2  2 * 64 * 64  =  8192
    blocks.3  2 * 64 * 96  = 12288   (the second largest, L2)
    <root>    64 * 16      =  1024   (gathered through the whole forward)

all even, so no padding at one or two ranks. The HBM working set (transient device bytes) is:
- gathered: the root and the two largest chains (units with no nesting: the two largest
  units), since backward gathers the next unit before the current one is released;
- gradients in flight: 4 of them (the landing slots; the literal 4 is the design, stated in
  [Note: gradients in flight]), each the largest trained unit's full gradient in the compute
  dtype, plus with several ranks its fp32 copy (when the compute dtype is not fp32) and its
  reduced fp32 shard;
- prefetch: ``prefetch.hbm_bytes``, by default twice the largest module in the compute dtype;
all against the start-up peak (a unit's fp32 flat copy while it is built), which is smaller here.
"""
from __future__ import annotations

import os
import weakref

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import tiered
from tiered.engine.build import flat_units, memory_plan
from tiered.policy.config import Policy
from tiered.policy.kinds import Tier
from helpers import REPO

CPU_YAML = os.path.join(REPO, "configs", "cpu.yaml")
GPU_YAML = os.path.join(REPO, "configs", "gpu.yaml")
BF16 = {"compute_dtype": "bf16"}
"""The hand arithmetic counts 2-byte weights: the configs' compute_dtype auto is fp32 on a CPU
without native bf16."""

W = 64
HIDDEN = (32, 128, 64, 96)
HEAD = 16
BLOCKS = [2 * W * h for h in HIDDEN]  # 4096, 16384, 8192, 12288
ROOT = W * HEAD                       # 1024
L1, L2 = 2 * W * 128, 2 * W * 96      # the largest units: 16384, 12288
SLOTS = 4  # gradients in flight at once ([Note: gradients in flight]): written here, not imported


class Block(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.up = nn.Linear(W, hidden, bias=False)
        self.down = nn.Linear(hidden, W, bias=False)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class Ladder(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block(h) for h in HIDDEN)
        self.head = nn.Linear(W, HEAD, bias=False)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def ladder() -> Ladder:
    torch.manual_seed(0)
    return Ladder()


def dram_block(nbytes: int) -> int:
    return -(-max(nbytes, 1) // 4096) * 4096


def train(engine, optimizer, steps: int, measure: "DeviceBytes | None" = None,
          device: str = "cpu") -> None:
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        x = torch.randn(2, W, generator=gen).to(device)
        if measure is None:
            engine(x).square().mean().backward()
        else:
            with measure:
                engine(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


# -- the plan, by hand ---------------------------------------------------------------------------

# (name, policy file, overrides, device of the plan, ranks, working set, HBM needed, DRAM needed)
# Each working set is written as (gathered + gradients in flight + prefetch) for this model.
PLANS = [
    ("cpu.yaml bf16, one rank",
     CPU_YAML, {}, "cpu", 1,
     (ROOT + L1 + L2) * 2 + SLOTS * L1 * 2 + 2 * L1 * 2,               # 59392 + 131072 + 65536
     None, None),
    ("cpu.yaml bf16, no prefetch",
     CPU_YAML, {"prefetch": {"enabled": False}}, "cpu", 1,
     (ROOT + L1 + L2) * 2 + SLOTS * L1 * 2,                            # 59392 + 131072
     None, None),
    ("cpu.yaml bf16, prefetch.hbm_bytes 5000",
     CPU_YAML, {"prefetch": {"hbm_bytes": 5000}}, "cpu", 1,
     (ROOT + L1 + L2) * 2 + SLOTS * L1 * 2 + 5000,
     None, None),
    ("cpu.yaml fp32, one rank",
     CPU_YAML, {"compute_dtype": "fp32"}, "cpu", 1,
     (ROOT + L1 + L2) * 4 + SLOTS * L1 * 4 + 2 * L1 * 4,
     None, None),
    # Two ranks: each gradient in flight also holds its fp32 copy (bf16 -> fp32 for the
    # reduction) and its reduced fp32 shard (half the unit).
    ("cpu.yaml bf16, two ranks, on a GPU",
     CPU_YAML, {}, "cuda", 2,
     (ROOT + L1 + L2) * 2 + SLOTS * (L1 * 2 + L1 * 4 + L1 // 2 * 4) + 2 * L1 * 2,
     None,
     # DRAM: per unit's shard (n / 2 elements) bf16 weights, fp32 gradient, master and two
     # moments, each whole 4 KiB blocks; and 4 landing buffers for the largest reduced shard,
     # fp32 (ranks are summed in fp32).
     sum(dram_block(n // 2 * 2) + 4 * dram_block(n // 2 * 4) for n in BLOCKS + [ROOT])
     + SLOTS * dram_block(L1 // 2 * 4)),
    # fp32 at two ranks: no fp32 copy of the gradient (it is fp32 already), the shard still.
    ("cpu.yaml fp32, two ranks, on a GPU",
     CPU_YAML, {"compute_dtype": "fp32"}, "cuda", 2,
     (ROOT + L1 + L2) * 4 + SLOTS * (L1 * 4 + L1 // 2 * 4) + 2 * L1 * 4,
     None, None),
    # One rank on a GPU: the landing buffers take the bf16 gradient as it is.
    ("cpu.yaml bf16, one rank, on a GPU",
     CPU_YAML, {}, "cuda", 1,
     (ROOT + L1 + L2) * 2 + SLOTS * L1 * 2 + 2 * L1 * 2,
     None,
     sum(dram_block(n * 2) + 4 * dram_block(n * 4) for n in BLOCKS + [ROOT])
     + SLOTS * dram_block(L1 * 2)),
    # Everything resident on the device: per element bf16 weights (2), an fp32 gradient (4:
    # accumulation_steps is null), fp32 master and moments (12), unaligned in HBM; and the
    # same working set as cpu.yaml.
    ("gpu.yaml bf16",
     GPU_YAML, {}, "cpu", 1,
     (ROOT + L1 + L2) * 2 + SLOTS * L1 * 2 + 2 * L1 * 2,
     (4096 + 16384 + 8192 + 12288 + 1024) * (2 + 4 + 12)
     + (ROOT + L1 + L2) * 2 + SLOTS * L1 * 2 + 2 * L1 * 2,
     0),
]


@pytest.mark.parametrize("name,path,overrides,device,ranks,working_set,hbm,dram", PLANS,
                         ids=[p[0] for p in PLANS])
def test_the_plan_is_the_arithmetic_of_the_model(name, path, overrides, device, ranks,
                                                 working_set, hbm, dram):
    """Each term of the working set matters to one of these numbers: the gradients in flight
    (4 slots of the largest unit, and the reduction's fp32 bytes at two ranks), the gathered
    chains, the prefetch limit, and, on a GPU, the DRAM landing buffers."""
    policy = Policy.from_yaml(path, {**BF16, **overrides})
    flats = flat_units(ladder(), policy, 0, ranks, torch.device("cpu"))
    assert [f.padded_numel for f in flats] == BLOCKS + [ROOT]
    plan = memory_plan(policy, torch.device(device), flats)
    assert plan.working_set == working_set
    assert plan.needed(Tier.HBM) == (working_set if hbm is None else hbm)
    if dram is not None:
        assert plan.needed(Tier.DRAM) == dram


def test_initialize_plans_the_same_arithmetic():
    """The plan initialize makes (with the start-up peak it measures on the model: an eager
    model's largest fp32 flat copy, 4 * L1 = 65536 bytes, below the training working set)."""
    engine, _ = tiered.initialize(ladder(), CPU_YAML, **BF16, device="cpu")
    plan = engine.manager.plan
    engine.close()
    assert plan.working_set == (ROOT + L1 + L2) * 2 + SLOTS * L1 * 2 + 2 * L1 * 2 == 256000
    assert plan.needed(Tier.HBM) == 256000


# Without prefetch, so that nothing hides a missing term: (1024 + 16384 + 12288) * 2 gathered
# + 4 * 16384 * 2 in flight.
NO_PREFETCH = {"prefetch": {"enabled": False}}
HAND_HBM = (ROOT + L1 + L2) * 2 + SLOTS * L1 * 2
assert HAND_HBM == 190464


LEAN_HBM = (ROOT + L1 + L2) * 2 + 1 * L1 * 2
"""The same with one gradient landing slot: the least this model trains with."""


def test_a_budget_of_the_hand_arithmetic_trains_and_one_byte_less_bends_then_breaks():
    """A byte under the plan, the engine keeps one gradient landing slot instead of four (see
    [Note: the working set bends]) and trains within the budget; a byte under that hand
    arithmetic too, it refuses, naming the least it needs."""
    engine, optimizer = tiered.initialize(ladder(), CPU_YAML, **BF16, device="cpu",
                                          hbm={"budget": HAND_HBM}, **NO_PREFETCH)
    train(engine, optimizer, 2)
    report, full = engine.memory_report()["hbm"], engine.full_state_dict()
    engine.close()
    assert 0 < report["peak"] <= HAND_HBM
    with pytest.warns(UserWarning, match="1 gradient landing slot instead of 4"):
        engine, optimizer = tiered.initialize(ladder(), CPU_YAML, **BF16, device="cpu",
                                              hbm={"budget": HAND_HBM - 1}, **NO_PREFETCH)
    assert engine.policy.grads.landing_slots == 1
    train(engine, optimizer, 2)
    report, lean = engine.memory_report()["hbm"], engine.full_state_dict()
    engine.close()
    assert 0 < report["peak"] <= LEAN_HBM
    assert all(torch.equal(lean[name], value) for name, value in full.items())  # only slower
    with pytest.raises(tiered.BudgetError) as error:
        tiered.initialize(ladder(), CPU_YAML, **BF16, device="cpu", hbm={"budget": LEAN_HBM - 1},
                          **NO_PREFETCH)
    assert error.value.shortfalls == {"hbm": (LEAN_HBM, LEAN_HBM - 1)}
    assert f"({LEAN_HBM} bytes)" in str(error.value)


# -- device memory, counted by the test ------------------------------------------------------------

class DeviceBytes(TorchDispatchMode):
    """Live bytes of the device buffers the engine allocates for training, counted without the
    engine's counters (``memory_report``, ``TierUsage``), sampled before and after every aten
    op of forward and backward (and when a gradient is made), the peak kept.

    With the CPU playing the device, every tensor is a CPU tensor, so "on the device" cannot be
    told by a tensor's device. What the engine allocates on the device for the HBM working set
    is, on this path:
    - gathered units: each unit's flat ``full`` parameter, whose storage the gatherer resizes
      from 0 to the unit's bytes and back (``untyped_storage().resize_``, which is no aten op,
      so the mode reads those storages' sizes at each op rather than seeing an allocation);
    - unit gradients: the flat gradient autograd makes for ``full`` (seen here by a hook on
      ``full``, which receives it before it is accumulated), alive until the engine has copied
      it off the device and dropped it (tracked by a weak reference to its storage, which
      lives exactly as long as the memory);
    - with several ranks, the fp32 copy and reduced shard of each gradient (not at one rank,
      as here).
    Activations and the per-parameter gradients autograd makes before the flat one are the
    model's and autograd's, outside the HBM budget, and not counted. Resident HBM shards
    (gpu.yaml) are not transient either, and not counted. The DRAM tier and the optimizer's
    CPU work run on the worker thread, which a dispatch mode (thread-local) does not see.
    """

    def __init__(self, engine):
        super().__init__()
        self.flats = engine.runtime.flats
        self.grads: list[weakref.ref] = []
        self.peak = 0
        self.peak_gathered: list[str] = []
        self.grads_seen = 0
        for flat in self.flats:
            flat.full.register_hook(self._gradient)

    def _gradient(self, grad):
        self.grads.append(weakref.ref(grad.untyped_storage()))
        self.grads_seen += 1
        self.sample()

    def live(self) -> int:
        gathered = sum(f.full.untyped_storage().nbytes() for f in self.flats)
        self.grads = [ref for ref in self.grads if ref() is not None]
        return gathered + sum(ref().nbytes() for ref in self.grads)

    def sample(self) -> None:
        live = self.live()
        if live > self.peak:
            self.peak = live
            self.peak_gathered = [f.name for f in self.flats
                                  if f.full.untyped_storage().nbytes()]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.sample()
        out = func(*args, **(kwargs or {}))
        self.sample()
        return out


@pytest.mark.parametrize("prefetch,peak,gathered", [
    # The root (whole forward) and blocks.1 gathered when blocks.1's gradient is made: on the
    # CPU the copy off the device is synchronous, so one gradient is alive at a time.
    (False, (ROOT + L1) * 2 + L1 * 2, ["blocks.1", "<root>"]),                     # 67584
    # Depth 2: when blocks.3's gradient is made (the first of backward), blocks.2 and blocks.1
    # are gathered ahead (8192 + 16384 elements, within 2 * L1 * 2 bytes of prefetch).
    (True, (ROOT + 12288 + 8192 + 16384) * 2 + 12288 * 2,
     ["blocks.1", "blocks.2", "blocks.3", "<root>"]),                              # 100352
], ids=["no prefetch", "prefetch"])
def test_device_bytes_counted_outside_the_engine_stay_within_the_hand_bound(prefetch, peak,
                                                                           gathered):
    hand = (ROOT + L1 + L2) * 2 + SLOTS * L1 * 2 + (2 * L1 * 2 if prefetch else 0)
    engine, optimizer = tiered.initialize(ladder(), CPU_YAML, **BF16, device="cpu",
                                          hbm={"budget": hand},
                                          prefetch={"enabled": prefetch})
    measure = DeviceBytes(engine)
    train(engine, optimizer, 3, measure)
    planned = engine.manager.plan.working_set
    reported = engine.memory_report()["hbm"]["peak"]
    engine.close()
    assert measure.grads_seen == 3 * 5  # every unit's gradient, every step, was seen
    assert (measure.peak, measure.peak_gathered) == (peak, gathered)
    assert measure.peak <= hand and measure.peak <= planned, (
        f"the device held {measure.peak} bytes; the plan allows {planned}, by hand {hand}")
    assert reported == measure.peak  # the engine's own count agrees with what was there


# -- the tier's own refusal, below the plan --------------------------------------------------------

@pytest.mark.parametrize("budget,what,needs,held", [
    # What a plan without the gradient term allows: the gathered units alone. Backward gets
    # through blocks.3 (root + blocks.3 + its gradient: 2 * (1024 + 2 * 12288) = 51200 bytes)
    # and blocks.2, and is refused blocks.1's gradient: 2 * 16384 more on 2 * (1024 + 16384)
    # held (the root and blocks.1) is 67584 > 59392.
    ((ROOT + L1 + L2) * 2, "gradient of unit blocks.1", L1 * 2, (ROOT + L1) * 2),
    # One byte short of the root and the largest block: forward is refused the gather of
    # blocks.1 before its storage is allocated (the root, 2048 bytes, is held).
    ((ROOT + L1) * 2 - 1, "gathered unit blocks.1", L1 * 2, ROOT * 2),
], ids=["gradient", "gather"])
def test_the_hbm_tier_refuses_an_overrun_the_plan_check_did_not_see(budget, what, needs, held):
    """Initialize checks the plan against the policy's budget (the hand arithmetic, which fits);
    the budget the HBM tier enforces is then lowered on the tier itself, below what training
    needs, the plan check not run again: as the plan would have let through had it left out a
    term. What stops the overrun is the tier's own accounting, and its error names the tier,
    the buffer and the bytes."""
    engine, optimizer = tiered.initialize(ladder(), CPU_YAML, **BF16, device="cpu",
                                          hbm={"budget": HAND_HBM}, **NO_PREFETCH)
    engine.manager.hbm.usage.budget = budget
    measure = DeviceBytes(engine)
    with pytest.raises(tiered.BudgetError) as error:
        train(engine, optimizer, 1, measure)
    engine.close()
    assert error.value.shortfalls == {"hbm": (held + needs, budget)}
    message = str(error.value)
    assert message.startswith(f"hbm budget exceeded by {what}: needs {needs // 1024}.00 KiB "
                              f"more"), message
    if what.startswith("gathered"):
        # Refused before blocks.1's storage was allocated: the most the device held was the
        # root and blocks.0, gathered before it.
        assert measure.peak == (ROOT + BLOCKS[0]) * 2 <= budget


# -- on a GPU, the allocator's count ----------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_memory_allocated_stays_within_the_hand_bound_and_activations():
    """torch.cuda.max_memory_allocated over forward and backward, from what was allocated before
    (nothing of the model: cpu.yaml keeps every shard in DRAM): the hand working set, plus the
    activations and autograd's per-parameter gradients, bounded by hand too. Each allocation is
    rounded up to 512 bytes by the caching allocator; every unit's bytes are multiples of 512.
    Activations, saved tensors and the loss: batch 2, at most 128 wide in bf16, each at most
    512 bytes as allocated, under 16 per block in forward and backward together, and the
    loss's few: 64 KiB is far above them. Per-parameter gradients of one unit before its flat
    one: at most L1 * 2. (Not yet run on a GPU when written.)"""
    hand = (ROOT + L1 + L2) * 2 + SLOTS * L1 * 2
    engine, optimizer = tiered.initialize(ladder(), CPU_YAML, **BF16, device="cuda",
                                          hbm={"budget": hand}, **NO_PREFETCH)
    train(engine, optimizer, 1, device="cuda")  # cuBLAS's workspace and the like, kept
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    measure = DeviceBytes(engine)
    train(engine, optimizer, 2, measure, device="cuda")
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    engine.close()
    assert measure.peak <= hand
    assert (ROOT + L1) * 2 + L1 * 2 <= peak <= hand + L1 * 2 + 64 * 1024
