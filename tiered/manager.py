"""The tier manager: where every shard state lives, how it moves, and what each tier holds.

It owns the three tiers, allocates exactly what a :class:`MemoryPlan` lists, and answers two
questions for the engine and the optimizer: "give me this shard state as a tensor I can compute
with" (:meth:`load`) and "make this the shard state's new value" (:meth:`store`). States in HBM or
DRAM are resident tensors, used in place; states on NVMe pass through a DRAM staging buffer of
their kind, one unit at a time.

It knows nothing of modules or autograd, so the per-node daemon can host it later unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .errors import BudgetError, TieredError
from .limits import memory_bound
from .plan import MemoryPlan, StateKind
from .policy import Policy, Tier
from .tiers import DramTier, HbmTier, NvmeShard, NvmeTier, PinnedSlabSource, SlabSource
from .sizes import align_up, even_pieces, format_size
from .tiers.aio import IoSettings
from .tiers.dram import BLOCK_ALIGN
from .tiers.nvme import free_bytes


@dataclass
class Shard:
    """One state of one unit's shard on this rank, and the one place that holds it."""

    unit: int
    kind: StateKind
    tier: Tier
    numel: int
    dtype: torch.dtype
    resident: torch.Tensor | None = None
    """The storage itself, for HBM and DRAM shards."""
    file: NvmeShard | None = None
    """Its extent, for NVMe shards."""


def _typed(block: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
    return block.view(dtype)[:numel]


def _pieces(shard: "Shard", block: torch.Tensor):
    """(first element, elements, byte offset, bytes to move) of each piece of an NVMe shard
    that fits ``block``; byte counts round up to whole 4 KiB blocks (the extent has them)."""
    itemsize = shard.dtype.itemsize
    for start, numel in even_pieces(shard.numel, block.numel() // itemsize,
                                    BLOCK_ALIGN // itemsize):
        yield start, numel, start * itemsize, align_up(numel * itemsize, BLOCK_ALIGN)


def _staging_name(kind: StateKind) -> str:
    """The staging buffer a state moves through between its tier and where it is used (see
    plan.staging_buffers).

    Weights go through "param_out" both ways, not through a read-ahead buffer: a gather's
    host-to-device copy may still be reading one of those after its iteration (the ring waits
    for that copy's event, a copy out would not). Copies out run with the CPU worker idle
    (exports, checkpoints, loads), when "param_out", its buffer for new weights, is free."""
    weights = (StateKind.PARAM, StateKind.PARAM_NEXT)
    return "param_out" if kind in weights else f"{kind.value}0"


class TierManager:
    def __init__(self, policy: Policy, device: torch.device, rank: int,
                 dram_source: SlabSource | None = None, ranks: int = 1,
                 agree: Callable[[int], int] = int):
        """``ranks``: the ranks on this node, which share its DRAM and its drive when no budget
        is set. ``agree``: a collective that turns this rank's measured share into the one every
        rank uses (the smallest any measured: ProcessGroup.smallest). Each rank then makes the
        same plan, so all of them fit or all refuse, and none is left waiting in a collective
        for a rank that refused; and no rank spills more than another, to be waited for. (The
        HBM default, the device's capacity, is agreed the same way, for devices that differ.)"""
        self.policy = policy
        self.hbm = HbmTier(device, policy.hbm.budget)
        # Pinned only for a GPU's copies: a CPU engine on a machine with CUDA (a benchmark's
        # writer, a test) would register every slab (0.6 s/GiB) and start a CUDA context.
        source = dram_source or PinnedSlabSource(pin=device.type == "cuda",
                                                 huge_pages=policy.dram.huge_pages)
        self.dram = DramTier(policy.dram.budget, source, ranks)
        io = IoSettings(policy.nvme.block_size, policy.nvme.queue_depth)
        self.nvme = (NvmeTier(policy.nvme.path, policy.nvme.budget, rank, io, ranks)
                     if policy.uses_nvme else None)
        for tier, budget in ((self.hbm, policy.hbm.budget), (self.dram, policy.dram.budget),
                             (self.nvme, policy.nvme.budget)):
            if tier is not None and budget is None:
                tier.usage.budget = agree(tier.usage.budget)
        self._node_shares = self._shares_of_explicit_budgets(ranks, agree)
        self.shards: dict[tuple[int, StateKind], Shard] = {}
        self.plan: MemoryPlan | None = None
        """What :meth:`allocate` allocated."""
        self._staging: dict[str, torch.Tensor] = {}

    def _shares_of_explicit_budgets(self, ranks: int, agree: Callable[[int], int]):
        """Per tier whose budget the policy sets: (its key, this rank's share of what the node
        has, what sets that share), agreed across ranks as a null budget's share is."""
        ranks, shares = max(1, ranks), {}
        if self.policy.dram.budget is not None:
            memory, bound = memory_bound()
            shares[Tier.DRAM] = ("dram.budget", agree(memory // ranks), bound)
        if self.nvme is not None and self.policy.nvme.budget is not None:
            path = self.policy.nvme.path
            shares[Tier.NVME] = ("nvme.budget", agree(free_bytes(path) // ranks),
                                 f"the free space of the file system of {path}")
        if ranks > 1:
            shares = {tier: (key, share, f"1/{ranks} (ranks on this node) of {bound}")
                      for tier, (key, share, bound) in shares.items()}
        return shares

    def check(self, plan: MemoryPlan) -> None:
        """Raise BudgetError if the plan does not fit its budgets, or needs more of a tier than
        this rank's share of the node where the policy's budget allows more than that share: a
        budget is a limit, but past the memory the OOM killer ends the process without a word,
        and past the free space an extent's fallocate fails midway."""
        plan.check(self.available())
        short = {tier: (plan.needed(tier), share, key, bound)
                 for tier, (key, share, bound) in self._node_shares.items()
                 if plan.needed(tier) > share}
        if short:
            lines = [f"{tier.value}: needs {format_size(needed)} within {key} "
                     f"{format_size(getattr(self.policy, tier.value).budget)}, but this rank may "
                     f"use {format_size(share)} ({bound})"
                     for tier, (needed, share, key, bound) in short.items()]
            raise BudgetError("the policy's budgets exceed what this node has:\n  "
                              + "\n  ".join(lines) + "\nlower them (dram.spill: nvme then moves "
                              "what does not fit to NVMe), or leave them null",
                              {t.value: (n, s) for t, (n, s, _, _) in short.items()})

    def available(self) -> dict[Tier, int]:
        out = {Tier.HBM: self.hbm.usage.budget - self.hbm.usage.current,
               Tier.DRAM: self.dram.usage.budget - self.dram.usage.current}
        if self.nvme is not None:
            out[Tier.NVME] = self.nvme.usage.budget - self.nvme.usage.current
        return out

    def allocate(self, plan: MemoryPlan) -> None:
        """Check the plan against every budget, then allocate all of it.

        Optimizer moments start at zero: resident ones are zeroed, NVMe files read back as
        zeros because they were just preallocated.
        """
        self.check(plan)
        self.plan = plan
        dram = {key: buf.nbytes for key, buf in plan.shards.items() if buf.tier is Tier.DRAM}
        dram.update({("staging", name): buf.nbytes for name, buf in plan.staging.items()})
        blocks = self.dram.reserve(dram)
        for name in plan.staging:
            self._staging[name] = blocks[("staging", name)]
        for (unit, kind), buf in plan.shards.items():
            shard = Shard(unit, kind, buf.tier, buf.numel, buf.dtype)
            if buf.tier is Tier.DRAM:
                shard.resident = _typed(blocks[(unit, kind)], buf.numel, buf.dtype)
            elif buf.tier is Tier.HBM:
                shard.resident = self.hbm.empty(buf.numel, buf.dtype, buf.label)
            else:
                shard.file = self.nvme.create(buf.label, buf.nbytes)
            if shard.resident is not None and kind in (StateKind.EXP_AVG, StateKind.EXP_AVG_SQ):
                shard.resident.zero_()
            self.shards[(unit, kind)] = shard
        # Transient HBM (gathered units, gradients in flight) is acquired as it happens; the plan
        # has already shown that its worst case fits beside everything resident.

    def load(self, unit: int, kind: StateKind) -> torch.Tensor:
        """A resident (HBM or DRAM) shard state itself, to compute with in place. NVMe states
        are read by the read-ahead ring (weights), the optimizer's stream (optimizer states) or
        :meth:`copy_out`."""
        shard = self.shards[(unit, kind)]
        assert shard.resident is not None, f"unit {unit} {kind.value} is on NVMe"
        return shard.resident

    def copy_out(self, unit: int, kind: StateKind, out: torch.Tensor) -> None:
        """Copy the shard state into ``out`` (any device or dtype), piece by piece through its
        staging buffer when it is on NVMe."""
        for start, piece in self.pieces(unit, kind):
            out[start:start + piece.numel()].copy_(piece)

    def pieces(self, unit: int, kind: StateKind, max_bytes: int = 64 << 20):
        """(first element, contents) of the shard state, piece by piece, as CPU tensors valid
        until the next piece: slices of a DRAM shard, copies of an HBM one, and NVMe extents
        read through their staging buffer."""
        shard = self.shards[(unit, kind)]
        if shard.resident is not None:
            step = max(1, max_bytes // shard.dtype.itemsize)
            for start in range(0, shard.numel, step):
                yield start, shard.resident[start:start + step].cpu()
            return
        block = self._staging[_staging_name(kind)]
        for start, numel, offset, nbytes in _pieces(shard, block):
            shard.file.start_read(block, offset, nbytes).wait()
            yield start, _typed(block, numel, shard.dtype)

    def has(self, unit: int, kind: StateKind) -> bool:
        """Whether the unit has this state (a frozen unit has its weights only: see
        plan.unit_state_kinds)."""
        return (unit, kind) in self.shards

    def nvme_file(self, unit: int, kind: StateKind) -> NvmeShard | None:
        """The state's extent, or None when it is resident (or the unit has no such state)."""
        shard = self.shards.get((unit, kind))
        return shard.file if shard is not None else None

    def staging_block(self, name: str) -> torch.Tensor:
        return self._staging[name]

    def read_param(self, unit: int, slot: str) -> torch.Tensor:
        """Read an NVMe weight shard into the staging buffer ``slot`` (one of the read-ahead
        ring "param_in0", "param_in1", ...)."""
        shard = self.shards[(unit, StateKind.PARAM)]
        shard.file.read_into(self._staging[slot])
        return _typed(self._staging[slot], shard.numel, shard.dtype)

    def staging_names(self, prefix: str) -> list[str]:
        return [name for name in self._staging if name.startswith(prefix)]

    def store(self, unit: int, kind: StateKind, value: torch.Tensor) -> None:
        """Make ``value`` (any device or dtype, ``numel`` elements) the shard state's contents.

        A value that must change both dtype and device (new fp32 master weights on the CPU for
        bf16 weights on the GPU) is cast on its own side into the staging buffer first, so only
        the smaller dtype crosses PCIe; NVMe shards are always written from their staging buffer.
        """
        shard = self.shards[(unit, kind)]
        target = shard.resident
        if target is not None and value.data_ptr() == target.data_ptr():
            return
        staging = _staging_name(kind)
        if target is None:
            self._write_nvme(shard, self._staging[staging], value)
            return
        cross = value.device != target.device and value.dtype != target.dtype
        if cross and staging in self._staging:
            staged = _typed(self._staging[staging], shard.numel, shard.dtype)
            staged.copy_(value)
            value = staged
        target.copy_(value)

    def weights_kind(self, unit: int) -> StateKind:
        """Where the unit's weights are held at full precision: its fp32 masters, or its
        compute-dtype weights where it keeps no masters (plan.unit_state_kinds)."""
        return StateKind.MASTER if self.has(unit, StateKind.MASTER) else StateKind.PARAM

    def store_weights(self, unit: int, value: torch.Tensor) -> None:
        """Make ``value`` (fp32) the unit's weights: its master weights and compute-dtype
        weights, both of the delayed update's buffers (they start equal), where it has them."""
        for kind in (StateKind.MASTER, StateKind.PARAM, StateKind.PARAM_NEXT):
            if self.has(unit, kind):
                self.store(unit, kind, value)

    def _write_nvme(self, shard: Shard, block: torch.Tensor, value: torch.Tensor) -> None:
        """Write ``value`` as the shard's next version, piece by piece through ``block``
        (which ``value`` may already be), switching only once all of it is written."""
        version = shard.file.next_version()
        try:
            for start, numel, offset, nbytes in _pieces(shard, block):
                staged = _typed(block, numel, shard.dtype)
                if value.data_ptr() != staged.data_ptr():
                    staged.copy_(value[start:start + numel])
                version.write(block, offset, nbytes).wait()  # the block is reused next
        except BaseException:
            version.abandon()  # a part-written version must never become current
            raise
        version.commit()
        version.wait()

    def land_grad(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """Copy the gradient shard ``value`` into the landing buffer ``name`` (``non_blocking``:
        the caller records an event after it); returns the landed view."""
        landed = _typed(self._staging[name], value.numel(), value.dtype)
        landed.copy_(value, non_blocking=True)
        return landed

    def grad_buffer(self, unit: int, dtype: torch.dtype) -> torch.Tensor:
        """The unit's grads-tier buffer as ``dtype``: itself when it is allocated in ``dtype``
        (fp32, or compact in the compute dtype), or the first half of an fp32 one viewed as a
        2-byte ``dtype`` (where a pending gradient is kept; see [Note: gradient states])."""
        grad = self.shards[(unit, StateKind.GRAD)].resident
        if grad.dtype is dtype:
            return grad
        if grad.dtype is not torch.float32:
            raise TieredError(f"unit {unit}'s gradient buffer is compact ({grad.dtype}, as "
                              f"accumulation_steps: 1 allows) and cannot hold a {dtype} gradient")
        return grad.view(torch.uint8)[:grad.numel() * dtype.itemsize].view(dtype)

    def param_in_place(self, unit: int, kind: StateKind, cpu_only: bool) -> bool:
        """Whether new weights of ``kind`` are written into the resident shard itself (when
        ``cpu_only``, only one in DRAM), not through the "param_out" staging buffer."""
        resident = self.shards[(unit, kind)].resident
        return resident is not None and (resident.device.type == "cpu" or not cpu_only)

    def param_target(self, unit: int, kind: StateKind, cpu_only: bool) -> torch.Tensor:
        """Where new weights of ``kind`` may be written in place: the resident shard itself
        (see :meth:`param_in_place`), or the "param_out" staging buffer for weights bound for
        NVMe, or for HBM from the CPU (then :meth:`store` moves them)."""
        shard = self.shards[(unit, kind)]
        if self.param_in_place(unit, kind, cpu_only):
            return shard.resident
        return _typed(self._staging["param_out"], shard.numel, shard.dtype)

    def grad_device(self) -> torch.device:
        return self.hbm.device if self.policy.grads.tier is Tier.HBM else torch.device("cpu")

    def swap_params(self, unit: int) -> None:
        """The delayed update's next weights of ``unit`` become its current ones (and the old
        current ones the buffer the next update writes)."""
        current = self.shards[(unit, StateKind.PARAM)]
        following = self.shards[(unit, StateKind.PARAM_NEXT)]
        current.resident, following.resident = following.resident, current.resident
        current.file, following.file = following.file, current.file

    def tier_of(self, unit: int, kind: StateKind) -> Tier:
        return self.shards[(unit, kind)].tier

    def memory_report(self) -> dict[str, dict[str, int | None]]:
        report = {"hbm": self.hbm.usage.report(), "dram": self.dram.usage.report()}
        report["nvme"] = (self.nvme.usage.report() if self.nvme is not None
                          else {"current": 0, "peak": 0, "budget": self.policy.nvme.budget})
        return report

    def close(self) -> None:
        """Free every tier; the NVMe run folder is removed. Safe to call more than once."""
        for shard in self.shards.values():
            if shard.tier is Tier.HBM and shard.resident is not None:
                self.hbm.free(shard.resident)
            shard.resident = None
        self.shards.clear()
        self._staging.clear()
        # NVMe first: closing it waits for I/O still in flight, which may be writing into or
        # reading out of DRAM slabs (a transfer abandoned by a failure); then the slabs go.
        if self.nvme is not None:
            self.nvme.close()
        self.dram.close()

