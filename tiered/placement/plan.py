"""What a policy will place in each tier, in bytes, computed before anything large is allocated.

The same plan drives the allocation (the tier manager allocates exactly what the plan lists), so
the memory report of a fresh engine equals this plan, and a policy that cannot fit fails here
with needed versus available bytes for every tier at once.
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Literal

import torch

from ..core.errors import BudgetError
from ..core.sizes import align_up, format_size
from ..policy.config import GradsPolicy, Policy
from ..policy.kinds import MasterDtype, Tier
from ..tiers.dram import BLOCK_ALIGN
from ..tiers.moments import stored_numel
from ..tiers.nvme import nvme_bytes


class StateKind(enum.Enum):
    """The pieces of training state each rank keeps per unit shard."""

    PARAM = "param"            # compute-dtype weights, in policy.params.tier
    PARAM_NEXT = "param_next"  # the delayed update's next weights (double buffer), same tier
    GRAD = "grad"              # gradient (fp32, or compact: see state_dtype), in policy.grads.tier
    MASTER = "master"          # fp32 master weights, in policy.optimizer.tier (none: master bf16)
    EXP_AVG = "exp_avg"        # Adam first moment, in policy.optimizer.tier (optimizer.moments)
    EXP_AVG_SQ = "exp_avg_sq"  # Adam second moment, in policy.optimizer.tier


OPTIMIZER_STATES = (StateKind.MASTER, StateKind.EXP_AVG, StateKind.EXP_AVG_SQ)

BlockKey = tuple[int, StateKind] | tuple[Literal["staging"], str]
"""A DRAM block of a plan: a unit's state by (unit, kind), a staging buffer by ("staging",
name)."""


STAGING_SETS = 3
"""Sub-group buffer sets of the NVMe optimizer stream: read ahead, stepped, written back."""

GRAD_LANDING_SLOTS = GradsPolicy().landing_slots
"""``grads.landing_slots`` by default."""


def state_kinds(policy: Policy) -> list[StateKind]:
    """The states of a unit with parameters to train under this policy (a frozen unit's:
    unit_state_kinds)."""
    kinds = list(StateKind)
    if not policy.optimizer.delayed_update.enabled:
        kinds.remove(StateKind.PARAM_NEXT)
    if policy.optimizer.master is MasterDtype.BF16:  # the bf16 weights are the master
        kinds.remove(StateKind.MASTER)
    return kinds


def unit_state_kinds(policy: Policy, trainable: bool, param_dtypes: list[torch.dtype],
                     quantized: bool = False) -> list[StateKind]:
    """The states one unit's shard has. A unit whose parameters are all frozen gets no gradient
    and is never stepped, so it keeps its weights alone: no gradient, moments or delayed-update
    buffer, and fp32 master weights only where the compute dtype rounds its parameters (fp32
    parameters computed in bf16), so that ``full_state_dict``, exports and checkpoints still
    give them back exactly. A bf16 model fine-tuned in bf16 keeps 2 bytes per frozen parameter
    where a trained one needs 16 to 20. A ``quantized`` one (its record: see [Note: quantized
    frozen weights] in tiers/quantized.py) keeps its record alone: quantizing is lossy by
    choice, no masters keep what it rounded."""
    if trainable:
        return state_kinds(policy)
    if quantized:
        return [StateKind.PARAM]
    compute = policy.compute_dtype.torch_dtype
    exact = compute is torch.float32 or all(dtype is compute for dtype in param_dtypes)
    keep = {StateKind.PARAM} if exact else {StateKind.PARAM, StateKind.MASTER}
    return [kind for kind in StateKind if kind in keep]  # masters also under master: bf16


def state_tier(policy: Policy, kind: StateKind) -> Tier:
    """The policy's tier for ``kind``; under ``tier: auto``, a unit's until the planner places
    it on the device: DRAM (spilled to NVMe where DRAM lacks room and a path is set)."""
    if kind in (StateKind.PARAM, StateKind.PARAM_NEXT):
        tier = policy.params.tier
    elif kind is StateKind.GRAD:
        tier = policy.grads.tier
    else:
        tier = policy.optimizer.tier
    return Tier.DRAM if tier is Tier.AUTO else tier


def spills_to_nvme(policy: Policy) -> bool:
    """Whether states placed in DRAM move to NVMe where DRAM lacks room (``dram.spill: nvme``,
    or ``tier: auto`` with an NVMe path)."""
    return policy.dram.spill is Tier.NVME or (policy.placed_by_planner and policy.uses_nvme)


def state_dtype(policy: Policy, kind: StateKind) -> torch.dtype:
    """The dtype a state is allocated in. Gradients are fp32 so that backwards can add up in
    them, except with ``accumulation_steps: 1``: no second backward can add to a step's
    gradient there (it is refused), so they stay compact, in the compute dtype, saving 2 bytes
    per parameter of the grads tier under bf16 or fp16 (see [Note: gradient states]). Moments
    are ``optimizer.moments``' (uint8 for packed 8-bit ones: tiers/moments.py)."""
    compute = policy.compute_dtype.torch_dtype
    if kind in (StateKind.PARAM, StateKind.PARAM_NEXT):
        return compute
    if kind is StateKind.GRAD and policy.optimizer.accumulation_steps == 1:
        return compute
    if kind in (StateKind.EXP_AVG, StateKind.EXP_AVG_SQ):
        return policy.optimizer.moments.torch_dtype
    return torch.float32


def state_buffer(policy: Policy, label: str, tier: Tier, kind: StateKind,
                 params: int) -> "Buffer":
    """The buffer of a ``kind`` state of ``params`` parameters."""
    dtype = state_dtype(policy, kind)
    return Buffer(label, tier, stored_numel(dtype, params), dtype)


@dataclass(frozen=True)
class Buffer:
    """One allocation of the plan: a shard state of a unit, or a staging buffer."""

    label: str
    tier: Tier
    numel: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        raw = self.numel * self.dtype.itemsize
        # DRAM blocks and NVMe files are whole 4 KiB blocks (O_DIRECT alignment).
        return raw if self.tier is Tier.HBM else align_up(max(raw, 1), BLOCK_ALIGN)


def staging_buffers(policy: Policy, device: torch.device, placement: "Placement",
                    world_size: int, lands_every_gradient: bool = False) -> dict[str, Buffer]:
    """DRAM buffers through which shards move when they are not where they are used.

    Each is sized for the largest shard it serves and reused unit after unit; each has one user
    thread:
    - "param_in0", "param_in1", ...: weights read from NVMe ahead of their gather (the I/O
      thread of readahead.py; ``prefetch.dram_bytes`` of them, at least one);
    - "param_out": new weights cast on the CPU on their way to NVMe or HBM (CPU worker);
    - "master0".."master2", "exp_avg0".., "exp_avg_sq0"..: three sets of sub-group buffers
      through which optimizer states stream from NVMe (CPU worker; see [Note: state stream]);
      "master0" alone where only a frozen unit's masters are there (read for exports);
    - "grad0", "grad1", ...: reduced gradient shards landing from the GPU (filled by backward,
      emptied by the CPU worker; ``grads.landing_slots`` of them); on a CPU device too when the
      host is the node's service's (``lands_every_gradient``), which sees only shared buffers;
    - "activations": what autograd saves for backward, with ``activations.tier: dram``,
      ``nvme`` or ``auto`` (the training thread's: engine/offloaded_activations.py);
    - "activations_io": with ``activations.tier: nvme``, the slots through which saved tensors
      go to the drive and come back (activation_slots; engine/activations_nvme.py).
    """
    compute = policy.compute_dtype.torch_dtype
    out = {}
    # Sized in the compute dtype's elements; a quantized unit's record is bytes.
    nvme_params = max(placement.largest(StateKind.PARAM, Tier.NVME),
                      -(-placement.largest_record(Tier.NVME) // compute.itemsize))
    streamed = placement.largest(StateKind.EXP_AVG, Tier.NVME)
    nvme_states = max(streamed, placement.largest(StateKind.MASTER, Tier.NVME))
    if nvme_params:
        for slot in range(read_ahead_slots(policy, nvme_params)):
            out[f"param_in{slot}"] = Buffer(f"staging param_in{slot}", Tier.DRAM, nvme_params,
                                            compute)
    # Without masters (optimizer.master: bf16) a unit's new weights wait there while its
    # moments stream from NVMe, until their versions commit (stepper.UnitStepper._weights).
    masterless = StateKind.MASTER not in state_kinds(policy)
    param_out = max(nvme_params, placement.largest_stepped_apart(StateKind.PARAM, Tier.HBM),
                    placement.largest(StateKind.EXP_AVG, Tier.NVME) if masterless else 0)
    if param_out:
        out["param_out"] = Buffer("staging param_out", Tier.DRAM, param_out, compute)
    if nvme_states:
        piece = min(nvme_states, policy.optimizer.sub_group_size)
        # Masters alone (a frozen unit's) only pass through master0 for exports; moments
        # stream with the masters (where there are any) through all sets when a trained unit's
        # states are on NVMe.
        kinds = [kind for kind in OPTIMIZER_STATES if kind in state_kinds(policy)]
        for kind in kinds if streamed else (StateKind.MASTER,):
            for slot in range(STAGING_SETS if streamed else 1):
                out[f"{kind.value}{slot}"] = state_buffer(
                    policy, f"staging {kind.value}{slot}", Tier.DRAM, kind, piece)
    if policy.activations.uses_dram:  # see [Note: activations in DRAM]
        out["activations"] = Buffer("staging activations", Tier.DRAM,
                                    policy.activations.dram_bytes, torch.uint8)
    if policy.activations.file_bytes:  # see [Note: activations on NVMe]
        slots, slot_bytes = activation_slots(policy)
        out["activations_io"] = Buffer("staging activations_io", Tier.DRAM, slots * slot_bytes,
                                       torch.uint8)
    # Sized for trained units: a frozen one never has a gradient to land.
    landing = placement.largest(StateKind.GRAD, Tier.DRAM)
    if landing and (device.type != "cpu" or lands_every_gradient):
        for slot in range(policy.grads.landing_slots):
            out[f"grad{slot}"] = Buffer(f"staging grad{slot}", Tier.DRAM, landing,
                                        reduce_dtype(policy, world_size))
    return out


def activation_slots(policy: Policy) -> tuple[int, int]:
    """How many pinned slots saved tensors pass through on their way to and from the drive
    (``activations.tier: nvme``), and the bytes of each: one full queue of the I/O engine's
    requests (``nvme.block_size`` x ``nvme.queue_depth``), as many as ``activations.prefetch_bytes``
    fill and one more for the read that cannot wait, at least two (one fills while the other
    moves)."""
    slot_bytes = policy.nvme.block_size * policy.nvme.queue_depth
    return max(2, -(-policy.activations.prefetch_bytes // slot_bytes) + 1), slot_bytes


def read_ahead_slots(policy: Policy, max_shard: int) -> int:
    """Pinned buffers for NVMe weights read ahead: ``prefetch.dram_bytes`` worth, at least one
    (two of the largest shard when null)."""
    if not policy.prefetch.enabled:
        return 1
    # Each buffer holds whole O_DIRECT blocks (Buffer.nbytes): counted so, they fit the limit.
    shard_bytes = align_up(max(1, max_shard * policy.compute_dtype.torch_dtype.itemsize),
                           BLOCK_ALIGN)
    if policy.prefetch.dram_bytes is None:
        return 2
    return max(1, policy.prefetch.dram_bytes // shard_bytes)


def by_module(per_unit: list, groups: list[int] | None) -> list[list]:
    """Per-unit items, one list per module (units.module_groups; by default a unit each)."""
    lists: dict[int, list] = {}
    for unit, item in enumerate(per_unit):
        lists.setdefault(groups[unit] if groups else unit, []).append(item)
    return list(lists.values())


def prefetch_limit(policy: Policy, full_numels: list[int], groups: list[int] | None = None) -> int:
    """Device bytes that may be gathered ahead of need (``prefetch.hbm_bytes``; by default
    twice the largest module's, its units summed: see units.module_groups)."""
    if not policy.prefetch.enabled:
        return 0
    if policy.prefetch.hbm_bytes is not None:
        return policy.prefetch.hbm_bytes
    largest = max((sum(sizes) for sizes in by_module(full_numels, groups)), default=0)
    return 2 * largest * policy.compute_dtype.torch_dtype.itemsize


def reduce_dtype(policy: Policy, world_size: int) -> torch.dtype:
    """The dtype of a reduced gradient shard: fp32 when ranks are summed, else the compute dtype."""
    return torch.float32 if world_size > 1 else policy.compute_dtype.torch_dtype


def grad_dtypes(policy: Policy, world_size: int) -> set[torch.dtype]:
    """The dtypes the optimizer may find a unit's gradient in: a compact buffer's own, or an fp32
    buffer's sum and the reduced shard's dtype, kept as it is until a second gradient comes."""
    held = state_dtype(policy, StateKind.GRAD)
    if held is not torch.float32:
        return {held}
    return {held, reduce_dtype(policy, world_size)}


def hbm_working_set(policy: Policy, full_numels: list[int], unit_paths: list[str],
                    world_size: int, groups: list[int] | None = None,
                    trained: list[bool] | None = None, building: int | None = None) -> int:
    """Peak bytes of the engine's transient device buffers; ``unit_paths`` are the units' module
    paths, "" for the root and for the units gathered with it through the whole forward;
    ``groups``: units.module_groups (the halves of a split module), by default a unit each;
    ``trained``: per unit, whether it has gradients (by default every unit has).

    A unit stays gathered while any unit nested in it runs, so what is gathered at once is a
    chain of nested units (the root, and each unit's enclosing units). In backward the next
    chain is gathered before the current one has been reduced and released, so two chains are
    held at once (the root counted once): with flat blocks, the root and the two largest blocks.
    Up to ``grads.landing_slots`` units' flat gradients are on their way off the device at once,
    each (with several ranks) with its fp32 copy and reduced fp32 shard (see [Note: gradients
    in flight] in engine/gradients.py). On top of that, up to
    ``prefetch.hbm_bytes`` of units gathered ahead of need. Building a unit at start-up needs
    its fp32 flat copy and, for a model built under ``tiered.init``, the unit's parameters
    materialized on the device (fp32 at most): those of all the units built with it, which
    are materialized at once. ``building`` is that peak as the engine measures it on the
    model (a parameter tied across units materializes every module holding it); without it,
    each module's own units are assumed.
    """
    compute = policy.compute_dtype.torch_dtype.itemsize
    root = sum(n for n, path in zip(full_numels, unit_paths) if path == "")

    own: dict[str, int] = {}
    for n, path in zip(full_numels, unit_paths):
        if path:
            own[path] = own.get(path, 0) + n

    def chain(path: str) -> int:
        # The path and each enclosing unit's, by its dotted prefixes: summing over every unit
        # for each made a plan of a many-layer model quadratic (issue 33, item 2).
        parts = path.split(".")
        return sum(own.get(".".join(parts[:end]), 0) for end in range(1, len(parts) + 1))

    chains = sorted((chain(p) for p in set(unit_paths) if p), reverse=True)[:2]
    largest = max((n for n, has in zip(full_numels, trained or [True] * len(full_numels))
                   if has), default=0)  # the largest gradient
    gathered = (root + sum(chains)) * compute
    grad = largest * compute
    if world_size > 1:
        grad += largest * 4 * (compute != 4) + largest // world_size * 4
    grad *= policy.grads.landing_slots
    startup = building if building is not None else max(
        ((sum(sizes) + max(sizes)) * 4 for sizes in by_module(full_numels, groups)), default=0)
    return max(gathered + grad + prefetch_limit(policy, full_numels, groups), startup)


@dataclass(frozen=True)
class MemoryPlan:
    shards: dict[tuple[int, StateKind], Buffer]
    staging: dict[str, Buffer]
    working_set: int
    """Transient HBM bytes (gathered units, gradients in flight), counted against the HBM budget."""
    left_pinned: int = 0
    """DRAM bytes of blocks whose states a re-plan moved to HBM: pinned still (slabs are never
    cut), so counted in the DRAM tier's needs."""
    in_place_nvme: int = 0
    """NVMe bytes of a file written in place, without spares (``activations.tier: nvme``'s:
    what it holds lives within a step, which no failure needs to keep readable)."""

    def needed(self, tier: Tier) -> int:
        buffers = [b for b in (*self.shards.values(), *self.staging.values()) if b.tier is tier]
        if tier is Tier.NVME:  # extents, with spares for atomic writes
            return nvme_bytes([b.nbytes for b in buffers]) + self.in_place_nvme
        extra = {Tier.HBM: self.working_set, Tier.DRAM: self.left_pinned}.get(tier, 0)
        return sum(b.nbytes for b in buffers) + extra

    def kept_on_device(self, units: list[int]) -> "MemoryPlan":
        """This plan with every state of ``units`` in HBM (the re-plan of ``tier: auto``,
        engine/replan.py): its staging and working set stay as they are, and the DRAM blocks
        the states leave stay pinned."""
        chosen = set(units)
        moved = [buf for key, buf in self.shards.items() if key[0] in chosen]
        return dataclasses.replace(
            self, shards={key: dataclasses.replace(buf, tier=Tier.HBM) if key[0] in chosen
                          else buf for key, buf in self.shards.items()},
            left_pinned=self.left_pinned + sum(buf.nbytes for buf in moved
                                               if buf.tier is Tier.DRAM))

    def steps_on_host(self) -> bool:
        """Whether the CPU steps any unit: a trained unit's moments (a frozen one has none) are
        outside HBM."""
        return any(buf.tier is not Tier.HBM for (_, kind), buf in self.shards.items()
                   if kind is StateKind.EXP_AVG)

    def check(self, available: dict[Tier, int]) -> None:
        """Raise BudgetError naming every tier whose needs exceed what is available."""
        short = {t: (self.needed(t), available[t]) for t in available
                 if self.needed(t) > available[t]}
        if short:
            lines = [f"{t.value}: needs {format_size(n)} ({n} bytes), {format_size(a)} "
                     f"({a} bytes) available" for t, (n, a) in short.items()]
            raise BudgetError("the policy does not fit its tier budgets:\n  " + "\n  ".join(lines),
                              {t.value: v for t, v in short.items()})


@dataclass(frozen=True)
class Placement:
    """The tier of every (unit, state), and the shard sizes."""

    tiers: dict[tuple[int, StateKind], Tier]
    shard_numels: list[int]
    records: dict[int, int] = dataclasses.field(default_factory=dict)
    """The units whose weights are a quantized record, with the bytes of its shard: their
    PARAM state (tiers/quantized.py)."""

    def largest(self, kind: StateKind, tier: Tier) -> int:
        """The largest shard whose ``kind`` state is in ``tier`` (0 if none is); a quantized
        record is not counted in elements (see :meth:`largest_record`)."""
        return max((n for u, n in enumerate(self.shard_numels)
                    if self.tiers.get((u, kind)) is tier
                    and not (kind is StateKind.PARAM and u in self.records)), default=0)

    def largest_record(self, tier: Tier) -> int:
        """The bytes of the largest shard of a quantized record in ``tier`` (0 if none is)."""
        return max((n for u, n in self.records.items()
                    if self.tiers.get((u, StateKind.PARAM)) is tier), default=0)

    def largest_stepped_apart(self, kind: StateKind, tier: Tier) -> int:
        """The largest shard whose ``kind`` state is in ``tier`` and whose masters are off the
        device, so stepped (or loaded) on the CPU: new weights for the device written on the
        host (0 if none is). A unit without masters is frozen and exact, never stepped, or keeps
        its weights as the master (optimizer.master: bf16), which the policy keeps beside
        its optimizer: not stepped apart."""
        return max((n for u, n in enumerate(self.shard_numels)
                    if self.tiers.get((u, kind)) is tier
                    and self.tiers.get((u, StateKind.MASTER)) not in (None, Tier.HBM)),
                   default=0)

    def moved(self, unit: int, kinds: tuple[StateKind, ...], tier: Tier) -> "Placement":
        tiers = dict(self.tiers)
        for kind in kinds:
            tiers[(unit, kind)] = tier
        return Placement(tiers, self.shard_numels, self.records)


def _plan(policy: Policy, device: torch.device, placement: Placement, full_numels: list[int],
          unit_paths: list[str], world_size: int, groups: list[int] | None,
          building: int | None, lands_every_gradient: bool) -> MemoryPlan:
    shards = {(unit, kind): state_buffer(policy, f"unit {unit} {kind.value}", tier, kind,
                                         placement.shard_numels[unit])
              for (unit, kind), tier in placement.tiers.items()}
    for unit, nbytes in placement.records.items():
        label = f"unit {unit} {StateKind.PARAM.value} ({policy.params.frozen_dtype.value})"
        tier = placement.tiers[(unit, StateKind.PARAM)]
        shards[(unit, StateKind.PARAM)] = Buffer(label, tier, nbytes, torch.uint8)
    return MemoryPlan(
        shards=shards,
        staging=staging_buffers(policy, device, placement, world_size, lands_every_gradient),
        working_set=hbm_working_set(policy, full_numels, unit_paths, world_size, groups,
                                    [(unit, StateKind.GRAD) in placement.tiers
                                     for unit in range(len(full_numels))], building),
        in_place_nvme=align_up(policy.activations.file_bytes, BLOCK_ALIGN))


def build_plan(policy: Policy, device: torch.device, shard_numels: list[int],
               full_numels: list[int], unit_paths: list[str], world_size: int,
               dram_available: int | None = None,
               unit_kinds: list[list[StateKind]] | None = None,
               groups: list[int] | None = None, building: int | None = None,
               lands_every_gradient: bool = False,
               on_device: frozenset[int] = frozenset(),
               records: dict[int, int] | None = None) -> MemoryPlan:
    """The plan of ``policy``; ``unit_kinds``: the states of each unit (unit_state_kinds), by
    default all of the policy's; ``records``: the units whose weights are a quantized record,
    with its shard's bytes; ``groups`` and ``building``: see hbm_working_set;
    ``lands_every_gradient``: see staging_buffers; ``on_device``: under ``tier: auto``, the
    units the planner keeps wholly in HBM, stepped there (planner.py). With
    ``dram.spill: nvme`` (or ``tier: auto`` and a path), states placed in DRAM move to NVMe
    until what stays fits ``dram_available``: the optimizer states of the largest units first
    (read and written once per step), then their weights (read twice per step), never the
    gradients. Staging buffers for what moved are counted as it moves."""
    if unit_kinds is None:
        unit_kinds = [state_kinds(policy)] * len(shard_numels)
    tiers = {(unit, kind): Tier.HBM if unit in on_device else state_tier(policy, kind)
             for unit, kinds in enumerate(unit_kinds) for kind in kinds}
    placement = Placement(tiers, shard_numels, dict(records or {}))
    plan = _plan(policy, device, placement, full_numels, unit_paths, world_size, groups,
                 building, lands_every_gradient)
    if not spills_to_nvme(policy) or dram_available is None:
        return plan
    weights = (StateKind.PARAM, StateKind.PARAM_NEXT)  # a unit's own, as below
    by_size = sorted(range(len(shard_numels)), key=lambda u: -shard_numels[u])
    # Trained weights that are the master (optimizer.master: bf16) are stepped in place in
    # DRAM: they stay; a frozen unit's, never stepped, may go.
    masters_stay = policy.optimizer.master is MasterDtype.BF16
    for kinds in (OPTIMIZER_STATES, weights):
        for unit in by_size:
            if plan.needed(Tier.DRAM) <= dram_available:
                return plan
            if kinds is weights and masters_stay and (unit, StateKind.EXP_AVG) in placement.tiers:
                continue
            present = tuple(k for k in kinds if (unit, k) in placement.tiers)
            if present and all(placement.tiers[(unit, k)] is Tier.DRAM for k in present):
                placement = placement.moved(unit, present, Tier.NVME)
                plan = _plan(policy, device, placement, full_numels, unit_paths, world_size,
                             groups, building, lands_every_gradient)
    return plan
