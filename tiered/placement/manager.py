"""The tier manager: where every shard state lives, how it moves, and what each tier holds.

It owns the three tiers, allocates exactly what a :class:`MemoryPlan` lists, and answers two
questions for the engine and the optimizer: "give me this shard state as a tensor I can compute
with" (:meth:`load`) and "make this the shard state's new value" (:meth:`store`). States in HBM or
DRAM are resident tensors, used in place; states on NVMe pass through a DRAM staging buffer of
their kind, one unit at a time.

It knows nothing of modules or autograd, so the node's service hosts it unchanged (service/hosting.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from ..core.errors import BudgetError, TieredError
from ..core.limits import memory_bound
from ..core.sizes import align_up, even_pieces, format_size
from ..device import accelerator_for
from ..policy.config import Policy
from ..policy.kinds import Tier
from ..tiers import DramTier, HbmTier, NvmeTier, PinnedSlabSource, SlabSource
from ..tiers.aio import IoSettings
from ..tiers.dram import BLOCK_ALIGN, default_budget
from ..tiers.moments import stored_granule
from ..tiers.faces import NvmeFace, ShardFile
from ..tiers.scratch import ScratchFile
from .budgets import budgets_past_the_node, dram_beside_hbm, refusal, split_shared_ram
from .plan import BlockKey, Buffer, MemoryPlan, StateKind


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
    file: ShardFile | None = None
    """Its extent, for NVMe shards."""

    @property
    def memory(self) -> torch.Tensor:
        """``resident``, where the caller knows the shard is in memory."""
        assert self.resident is not None, f"unit {self.unit}'s {self.kind.value} is on NVMe"
        return self.resident

    @property
    def extent(self) -> ShardFile:
        """``file``, where the caller knows the shard is on NVMe."""
        assert self.file is not None, f"unit {self.unit}'s {self.kind.value} is not on NVMe"
        return self.file


def typed(block: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """The first ``numel`` elements of ``dtype`` of a uint8 block."""
    return block.view(dtype)[:numel]


def _pieces(shard: "Shard", block: torch.Tensor):
    """(first element, elements, byte offset, bytes to move) of each piece of an NVMe shard
    that fits ``block``; byte counts round up to whole 4 KiB blocks (the extent has them)."""
    itemsize = shard.dtype.itemsize
    room = block.numel() // itemsize
    granule = stored_granule(shard.dtype)
    most = room if shard.numel <= room else room // granule * granule
    for start, numel in even_pieces(shard.numel, most, granule):
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
                 agree: Callable[[int], int] = int, nvme_tier: Callable[..., NvmeFace] = NvmeTier):
        """``ranks``: the ranks on this node, which share its DRAM and its drive when no budget
        is set. ``agree``: a collective that turns this rank's measured share into the one every
        rank uses (the smallest any measured: ProcessGroup.smallest). Each rank then makes the
        same plan, so all of them fit or all refuse, and none is left waiting in a collective
        for a rank that refused; and no rank spills more than another, to be waited for. (The
        HBM default, the device's capacity, is agreed the same way, for devices that differ.)

        ``nvme_tier``: what makes the NVMe tier, called as NvmeTier is (root, budget, rank, I/O
        settings, ranks); the node's service holds a rank's files in another process
        (service/files.py), whose face the trainer's tier then is.

        Raises BudgetError when the policy sets a budget larger than this rank's share of the
        node (see :func:`budgets_past_the_node`), leaving nothing behind."""
        self.policy = policy
        self.rank = rank
        self.shards: dict[tuple[int, StateKind], Shard] = {}
        self.plan: MemoryPlan | None = None
        """What :meth:`allocate` allocated."""
        self._staging: dict[str, torch.Tensor] = {}
        self._swapped: set[int] = set()
        """Units whose PARAM and PARAM_NEXT buffers are swapped (see :meth:`swap_params`)."""
        self.hbm = HbmTier(device, policy.hbm.budget)
        # Registered with this engine's device: a CPU engine on a machine with CUDA (a
        # benchmark's writer, a test) would pin every slab (0.6 s/GiB) and start a CUDA context.
        source = dram_source or PinnedSlabSource(accelerator_for(device),
                                                 huge_pages=policy.dram.huge_pages)
        self.dram = DramTier(policy.dram.budget, source, ranks)
        io = IoSettings(policy.nvme.block_size, policy.nvme.queue_depth)
        self.cpu_ram: int | None = None
        """On a CPU device, the RAM its HBM tier and the DRAM tier share (a null DRAM budget's
        amount), which their budgets split once the plan is known (see :meth:`budgets_for`);
        None on a GPU."""
        self.nvme: NvmeFace | None = None
        self.activations_file: ScratchFile | None = None
        """The plan's file for saved activations (``activations.tier: nvme``; plan.in_place_nvme),
        this process's own also where the node's service holds the rank's other files."""
        try:  # from here on a failure (or an interrupt) must not leave the NVMe run folder, nor
            # a service's connection open (the DRAM source's)
            self.nvme = (nvme_tier(policy.nvme.path, policy.nvme.budget, rank, io, ranks)
                         if policy.uses_nvme else None)
            for tier, budget in ((self.hbm, policy.hbm.budget), (self.dram, policy.dram.budget),
                                 (self.nvme, policy.nvme.budget)):
                if tier is not None and budget is None:
                    tier.usage.budget = agree(tier.usage.budget)
            if device.type == "cpu":
                self.cpu_ram = agree(default_budget(ranks))
                if policy.hbm.budget is None:  # not the machine's total: the RAM is shared
                    self.hbm.usage.budget = self.cpu_ram
            past = budgets_past_the_node(policy, device.type == "cpu", ranks, agree)
            if past:
                hint = self.nvme.live_runs_hint() if "nvme" in past and self.nvme else ""
                raise refusal(past, hint)
        except BaseException:
            if self.nvme is not None:
                self.nvme.close()
            self.dram.close()
            raise

    def dram_room_beside(self, hbm_needed: int) -> int:
        """DRAM a plan may fill (``dram.spill: nvme`` moves the rest to NVMe): what its budget
        leaves and, on a CPU device, no more than the shared RAM leaves beside the HBM tier's
        budget or, when null, its plan's needs ``hbm_needed`` (which the spill does not
        change)."""
        room = self.available()[Tier.DRAM]
        if self.cpu_ram is None:
            return max(0, room)
        return dram_beside_hbm(room, self.cpu_ram, self.policy.hbm.budget, hbm_needed)

    def budgets_for(self, plan: MemoryPlan) -> dict[Tier, int]:
        """Each tier's budget for ``plan``. On a CPU device the HBM and DRAM tiers are the same
        RAM, ``cpu_ram``, which their budgets split so that it is not counted twice: a budget
        the policy sets stays, a null one is what the other leaves, and with both null the DRAM
        tier's is what the plan pins there (it pins nothing more later), the HBM tier's the
        rest (its transient buffers come and go)."""
        budgets = {Tier.HBM: self.hbm.usage.budget, Tier.DRAM: self.dram.usage.budget}
        if self.nvme is not None:
            budgets[Tier.NVME] = self.nvme.usage.budget
        if self.cpu_ram is not None:
            budgets[Tier.HBM], budgets[Tier.DRAM] = split_shared_ram(
                self.cpu_ram, self.policy.hbm.budget, self.policy.dram.budget,
                plan.needed(Tier.DRAM))
        return budgets

    def hbm_room(self, plan: MemoryPlan) -> int:
        """The HBM bytes ``plan`` may fill (on a CPU device, what its DRAM needs leave)."""
        return self.budgets_for(plan)[Tier.HBM] - self.hbm.usage.current

    def check(self, plan: MemoryPlan) -> None:
        """Raise BudgetError if the plan does not fit its budgets (on a CPU device, the RAM
        that the HBM and DRAM tiers share; see :meth:`budgets_for`)."""
        budgets = self.budgets_for(plan)
        if self.cpu_ram is not None and None in (self.policy.hbm.budget, self.policy.dram.budget):
            hbm, dram = plan.needed(Tier.HBM), plan.needed(Tier.DRAM)
            if hbm + dram > self.cpu_ram:
                raise BudgetError(
                    f"on the CPU device the hbm and dram tiers are the same RAM: the plan needs "
                    f"{format_size(hbm)} in hbm and {format_size(dram)} in dram, "
                    f"{format_size(hbm + dram)} in all, but this rank may use "
                    f"{format_size(self.cpu_ram)} (7/8 of {memory_bound()[1]}, shared by the "
                    f"ranks on this node); place states on nvme, or train on a GPU",
                    {"hbm": (hbm, budgets[Tier.HBM]), "dram": (dram, budgets[Tier.DRAM])})
        current = {Tier.HBM: self.hbm.usage.current, Tier.DRAM: self.dram.usage.current,
                   Tier.NVME: self.nvme.usage.current if self.nvme is not None else 0}
        try:
            plan.check({tier: budget - current[tier] for tier, budget in budgets.items()})
        except BudgetError as error:
            if "nvme" not in error.shortfalls or self.nvme is None:
                raise
            hint = self.nvme.live_runs_hint()
            if plan.in_place_nvme:  # not a state the user placed: say which key asks for it
                hint += (f"; {format_size(plan.in_place_nvme)} of the needs are the file for "
                         f"saved activations (activations.nvme_bytes)")
            if not hint:
                raise
            raise BudgetError(f"{error}{hint}", error.shortfalls) from None

    def available(self) -> dict[Tier, int]:
        out = {Tier.HBM: self.hbm.usage.budget - self.hbm.usage.current,
               Tier.DRAM: self.dram.usage.budget - self.dram.usage.current}
        if self.nvme is not None:
            out[Tier.NVME] = self.nvme.usage.budget - self.nvme.usage.current
        return out

    def allocate(self, plan: MemoryPlan, kept: bool = False) -> None:
        """Check the plan against every budget, then allocate all of it.

        Optimizer moments start at zero: resident ones are zeroed, NVMe files read back as
        zeros because they were just preallocated. ``kept``: the DRAM source hands back slabs
        that hold a rank's states already (a trainer reattached to its service's kept state),
        which are used as they are.
        """
        self.check(plan)
        budgets = self.budgets_for(plan)
        self.hbm.usage.budget, self.dram.usage.budget = budgets[Tier.HBM], budgets[Tier.DRAM]
        if plan.in_place_nvme:
            assert self.policy.nvme.path is not None  # the policy asks for one with tier: nvme
            self.activations_file = ScratchFile(
                self.policy.nvme.path, plan.in_place_nvme, self.rank,
                IoSettings(self.policy.nvme.block_size, self.policy.nvme.queue_depth),
                "saved activations", "activations.nvme_bytes")
        self._allocate(plan, zero_moments=not kept)

    def adopt(self, plan: MemoryPlan, blocks: dict[BlockKey, torch.Tensor]) -> None:
        """Take over ``plan``, which another process (a trainer) checked and allocated: its DRAM
        states and staging buffers are ``blocks`` (keyed as :meth:`descriptors` keys them: the
        trainer's memory, as this process maps it), and its NVMe states the shards its NVMe
        tier hands back, as they are: nothing is zeroed. Plans with nothing in HBM are adopted
        (the node's service runs their hosts: see service/hosting.py)."""
        if any(buf.tier is Tier.HBM
               for buf in (*plan.shards.values(), *plan.staging.values())):
            raise TieredError("only a plan with nothing in HBM can be adopted")
        needed = {key: buf.nbytes for key, buf in _dram_buffers(plan).items()}
        wrong = [key for key, nbytes in needed.items()
                 if key not in blocks or blocks[key].numel() < nbytes]
        if wrong:
            raise TieredError(f"the trainer's memory holds no block of the plan's size for "
                              f"{wrong[0]} ({len(wrong)} of {len(needed)}): another plan")
        self._allocate(plan, zero_moments=False, blocks=blocks)

    def descriptors(self, locate: Callable[[torch.Tensor], tuple[int, int]]
                    ) -> dict[BlockKey, tuple[int, int, int]]:
        """Where each DRAM state and staging buffer of the plan lies: (segment, byte offset,
        bytes) of the DRAM source's memory, ``locate`` giving a block's segment and offset. A
        process that maps the same segments wraps them as the same states (:meth:`adopt`).
        Asked before any delayed-update swap, so each state is where the plan put it."""
        assert not self._swapped, "descriptors are the plan's, asked before any swap_params"
        assert self.plan is not None
        return {key: (*locate(self._staging[key[1]] if key[0] == "staging"
                              else self.shards[key].memory), buf.nbytes)
                for key, buf in _dram_buffers(self.plan).items()}

    def _allocate(self, plan: MemoryPlan, zero_moments: bool,
                  blocks: dict[BlockKey, torch.Tensor] | None = None) -> None:
        self.plan = plan
        if blocks is None:
            blocks = self.dram.reserve({key: buf.nbytes
                                        for key, buf in _dram_buffers(plan).items()})
        for name in plan.staging:
            self._staging[name] = blocks[("staging", name)]
        for (unit, kind), buf in plan.shards.items():
            shard = Shard(unit, kind, buf.tier, buf.numel, buf.dtype)
            if buf.tier is Tier.DRAM:
                shard.resident = typed(blocks[(unit, kind)], buf.numel, buf.dtype)
            elif buf.tier is Tier.HBM:
                shard.resident = self.hbm.empty(buf.numel, buf.dtype, buf.label)
            else:
                shard.file = self.nvme_tier.create(buf.label, buf.nbytes)
            if zero_moments and shard.resident is not None and kind in (StateKind.EXP_AVG,
                                                                        StateKind.EXP_AVG_SQ):
                shard.resident.zero_()
            self.shards[(unit, kind)] = shard
        # Transient HBM (gathered units, gradients in flight) is acquired as it happens; the plan
        # has already shown that its worst case fits beside everything resident.

    def move_to_device(self, plan: MemoryPlan) -> None:
        """Take ``plan``: the one allocated, some units' states moved to HBM (the re-plan of
        ``tier: auto``, engine/replan.py), with the worker idle and nothing gathered. Each state
        that moves is copied into a new HBM buffer, then leaves its tier: its NVMe extent is
        removed, its DRAM block stays pinned (slabs are never cut: the DRAM tier holds what it
        held). All or nothing: when a copy fails, every state stays where it was."""
        moving = [key for key, buf in plan.shards.items() if buf.tier is not self.shards[key].tier]
        assert all(plan.shards[key].tier is Tier.HBM for key in moving), "only to the device"
        copies: dict[tuple[int, StateKind], torch.Tensor] = {}
        try:
            for key in moving:
                shard = self.shards[key]
                copies[key] = self.hbm.empty(shard.numel, shard.dtype, plan.shards[key].label)
                self.copy_out(*key, copies[key])
        except BaseException:
            for copy in copies.values():
                self.hbm.free(copy)
            raise
        for key, copy in copies.items():
            shard = self.shards[key]
            if shard.file is not None:
                self.nvme_tier.remove(shard.file)
            shard.tier, shard.resident, shard.file = Tier.HBM, copy, None
        self.plan = plan

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
        read through their staging buffer. Elements of the state's dtype: bytes, whole blocks
        of codes, for packed 8-bit moments."""
        shard = self.shards[(unit, kind)]
        if shard.resident is not None:
            granule = stored_granule(shard.dtype)
            step = max(granule, max_bytes // shard.dtype.itemsize // granule * granule)
            for start in range(0, shard.numel, step):
                yield start, shard.resident[start:start + step].cpu()
            return
        block = self._staging[_staging_name(kind)]
        for start, numel, offset, nbytes in _pieces(shard, block):
            shard.extent.start_read(block, offset, nbytes).wait()
            yield start, typed(block, numel, shard.dtype)

    def has(self, unit: int, kind: StateKind) -> bool:
        """Whether the unit has this state (a frozen unit has its weights only: see
        plan.unit_state_kinds)."""
        return (unit, kind) in self.shards

    def nvme_file(self, unit: int, kind: StateKind) -> ShardFile | None:
        """The state's extent, or None when it is resident (or the unit has no such state)."""
        shard = self.shards.get((unit, kind))
        return shard.file if shard is not None else None

    def nvme_shard(self, unit: int, kind: StateKind) -> ShardFile:
        """The state's extent, which the plan put on NVMe."""
        return self.shards[(unit, kind)].extent

    def staging_block(self, name: str) -> torch.Tensor:
        return self._staging[name]

    def read_param(self, unit: int, slot: str) -> torch.Tensor:
        """Read an NVMe weight shard into the staging buffer ``slot`` (one of the read-ahead
        ring "param_in0", "param_in1", ...)."""
        shard = self.shards[(unit, StateKind.PARAM)]
        shard.extent.read_into(self._staging[slot])
        return typed(self._staging[slot], shard.numel, shard.dtype)

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
            staged = typed(self._staging[staging], shard.numel, shard.dtype)
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
        version = shard.extent.next_version()
        try:
            for start, numel, offset, nbytes in _pieces(shard, block):
                staged = typed(block, numel, shard.dtype)
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
        landed = typed(self._staging[name], value.numel(), value.dtype)
        landed.copy_(value, non_blocking=True)
        return landed

    def grad_buffer(self, unit: int, dtype: torch.dtype) -> torch.Tensor:
        """The unit's grads-tier buffer as ``dtype``: itself when it is allocated in ``dtype``
        (fp32, or compact in the compute dtype), or the first half of an fp32 one viewed as a
        2-byte ``dtype`` (where a pending gradient is kept; see [Note: gradient states])."""
        grad = self.shards[(unit, StateKind.GRAD)].memory
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

    def param_target(self, unit: int, kind: StateKind, cpu_only: bool,
                     staged: bool = False) -> torch.Tensor:
        """Where new weights of ``kind`` may be written in place: the resident shard itself
        (see :meth:`param_in_place`), or the "param_out" staging buffer for weights bound for
        NVMe, or for HBM from the CPU, or that must wait (``staged``) (then :meth:`store`
        moves them)."""
        shard = self.shards[(unit, kind)]
        if self.param_in_place(unit, kind, cpu_only) and not staged:
            return shard.memory
        return typed(self._staging["param_out"], shard.numel, shard.dtype)

    def grad_device(self, unit: int) -> torch.device:
        """Where unit ``unit``'s gradient is held: the device for a grads-tier buffer in HBM,
        else the CPU (a frozen unit has none: the CPU)."""
        return self._device_of(unit, StateKind.GRAD)

    def optimizer_device(self, unit: int) -> torch.device:
        """Where unit ``unit`` is stepped: where its optimizer states are, the device for HBM,
        else the CPU (NVMe states stream through DRAM). Its moments say (a unit may have no
        masters: optimizer.master bf16); a frozen unit's masters, where it has any."""
        return self.hbm.device if self.optimizer_in_hbm(unit) else torch.device("cpu")

    def optimizer_in_hbm(self, unit: int) -> bool:
        """Whether unit ``unit``'s optimizer states are in the HBM tier (see optimizer_device)."""
        kind = StateKind.EXP_AVG if self.has(unit, StateKind.EXP_AVG) else StateKind.MASTER
        shard = self.shards.get((unit, kind))
        return shard is not None and shard.tier is Tier.HBM

    def _device_of(self, unit: int, kind: StateKind) -> torch.device:
        shard = self.shards.get((unit, kind))
        return self.hbm.device if shard is not None and shard.tier is Tier.HBM else \
            torch.device("cpu")

    def swap_params(self, unit: int) -> None:
        """The delayed update's next weights of ``unit`` become its current ones (and the old
        current ones the buffer the next update writes)."""
        current = self.shards[(unit, StateKind.PARAM)]
        following = self.shards[(unit, StateKind.PARAM_NEXT)]
        current.resident, following.resident = following.resident, current.resident
        current.file, following.file = following.file, current.file
        self._swapped ^= {unit}

    def swapped_units(self) -> list[int]:
        """The units whose current weights are in the buffer the plan names PARAM_NEXT (swapped
        an odd number of times): what another manager over the same memory swaps to agree."""
        return sorted(self._swapped)

    @property
    def current_plan(self) -> MemoryPlan:
        """The plan the states are placed by, where the caller knows they are placed."""
        assert self.plan is not None, "nothing is placed yet"
        return self.plan

    @property
    def nvme_tier(self) -> NvmeFace:
        """The NVMe tier, where the caller knows the policy has one."""
        assert self.nvme is not None, "the policy places nothing on NVMe"
        return self.nvme

    def tier_of(self, unit: int, kind: StateKind) -> Tier:
        return self.shards[(unit, kind)].tier

    def memory_report(self) -> dict[str, Mapping[str, int | None]]:
        """Per tier: bytes held now, the most held, and the budget. On a CPU device the hbm
        and dram budgets are two parts of the same RAM (see :meth:`budgets_for`)."""
        report: dict[str, Mapping[str, int | None]] = {"hbm": self.hbm.usage.report(),
                                                       "dram": self.dram.usage.report()}
        report["nvme"] = (self.nvme.usage.report() if self.nvme is not None
                          else {"current": 0, "peak": 0, "budget": self.policy.nvme.budget})
        if self.nvme is not None and self.activations_file is not None:
            # In the NVMe budget, as the plan counts it (held whole from the start, so the
            # peaks add up).
            tier, held = self.nvme.usage, self.activations_file.usage
            report["nvme"] = {"current": tier.current + held.current,
                              "peak": tier.peak + held.peak, "budget": tier.budget}
        return report

    def close(self, clean: bool = False) -> None:
        """Free every tier; the NVMe run folder is removed. Safe to call more than once.
        ``clean``: the run ended well (see SlabSource.close)."""
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
        if self.activations_file is not None:
            self.activations_file.close()
        self.dram.close(clean)


def _dram_buffers(plan: MemoryPlan) -> dict[BlockKey, Buffer]:
    """The plan's DRAM states by (unit, kind) and its staging buffers by ("staging", name)."""
    buffers: dict[BlockKey, Buffer] = {key: buf for key, buf in plan.shards.items()
                                    if buf.tier is Tier.DRAM}
    buffers.update({("staging", name): buf for name, buf in plan.staging.items()})
    return buffers
