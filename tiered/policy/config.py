"""Offload policies: YAML (or a dict) turned once into frozen, validated dataclasses.

A policy is data: which tier holds each piece of training state, the optimizer's settings and the
tiers' budgets. Mechanism (tiers, engine, optimizer) reads a frozen :class:`Policy` and never a
dict. Every error names the source file, the key path and what is allowed. The sections are
here; the values they choose among (tiers, dtypes, the device) are policy/kinds.py's, and the
generic building and checking of a section tree is policy/schema.py's.
"""
from __future__ import annotations

import dataclasses
import enum
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from ..core.errors import PolicyError
from ..core.sizes import parse_size
from ..device.bf16 import bf16_support
from ..tiers.moments import piece_granule
from .deepspeed import read_policy_file
from .kinds import ComputeDtype, Device, FrozenDtype, MasterDtype, MomentsDtype, Tier
from .schema import build, merge, plain_value_in, plain_value_message
from .values import (as_betas, as_bool, as_class_names, as_norm_bound, as_number, as_path,
                     as_size_or_none, as_whole_number, keep_path_as_string, optional, parsed_by)

POLICY_ENV = "TIERED_POLICY_JSON"
"""Environment variable through which ``tiered-launch`` hands the resolved policy to each rank."""


@dataclass(frozen=True)
class ParamsPolicy:
    tier: Tier = Tier.DRAM
    """Where the compute-dtype weights of each shard live between uses: hbm | dram | nvme |
    auto (the planner decides per unit; then for grads and optimizer too)."""
    frozen_dtype: FrozenDtype = FrozenDtype.COMPUTE
    """How units of frozen parameters keep their linear layers' weights, in every tier and on
    every move: compute (the compute dtype) | int8 | nf4 (quantized by torchao, dequantized on
    the device per unit just before use; see [Note: quantized frozen weights])."""


@dataclass(frozen=True)
class GradsPolicy:
    tier: Tier = Tier.DRAM
    """Where each rank's gradient shard accumulates: hbm | dram (where the optimizer reads it) |
    auto. fp32, or the compute dtype with ``optimizer.accumulation_steps: 1`` (plan.state_dtype)."""
    landing_slots: int = field(default=4, metadata=parsed_by(as_whole_number))
    """Units' gradients that may hold device bytes on their way off the device at once, and the
    pinned buffers in which later gradients of a step land until the CPU worker adds them in:
    more overlap backward with the copies, fewer hold less memory. A budget that cannot hold
    them lowers them, down to 1 (see [Note: the working set bends])."""

    def __post_init__(self):
        if self.tier is Tier.NVME:
            raise ValueError("tier must be hbm, dram or auto, got 'nvme'")
        if self.landing_slots < 1:
            raise ValueError(f"landing_slots must be >= 1, got {self.landing_slots}")


@dataclass(frozen=True)
class DelayedUpdatePolicy:
    """ZeRO-Offload's one-step delayed parameter update (DPU).

    After ``warmup_steps`` ordinary steps, ``optimizer.step()`` returns at once and the CPU
    update of step t runs while step t+1's forward and backward use the weights from before it:
    the gradient used at step t >= warmup + 2 is computed at theta_{t-2} and applied to
    theta_{t-1}. The compute-dtype weights are double-buffered for it.
    """

    enabled: bool = field(default=False, metadata=parsed_by(as_bool))
    warmup_steps: int = field(default=0, metadata=parsed_by(as_whole_number))

    def __post_init__(self):
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")


def _check_adamw(lr: float | None, betas: tuple[float, float] | None, eps: float | None,
                 weight_decay: float | None) -> None:
    """AdamW's ranges, for the optimizer's values and a param group's (None: not given)."""
    if lr is not None and lr < 0:
        raise ValueError(f"lr must be >= 0, got {lr}")
    if betas is not None and not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas must each be in [0, 1), got {list(betas)}")
    if eps is not None and eps <= 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    if weight_decay is not None and weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")


def _check_bf16_master(policy: "Policy") -> None:
    """``optimizer.master: bf16`` steps the bf16 weights themselves, so they must be bf16 and
    where the optimizer steps: in DRAM for a CPU update, in HBM for a GPU one."""
    if policy.compute_dtype is not ComputeDtype.BF16:
        auto = (" (auto computes in fp32 where the device has no native bf16)"
                if policy.compute_dtype is ComputeDtype.AUTO else "")
        raise ValueError(f"optimizer.master: bf16 makes the bf16 weights the master: it needs "
                         f"compute_dtype: bf16, got {policy.compute_dtype.value}{auto}")
    params, optimizer = policy.params.tier, policy.optimizer.tier
    on_host = params is Tier.DRAM and optimizer in (Tier.DRAM, Tier.NVME)
    if not (on_host or params is optimizer is Tier.HBM or params is Tier.AUTO):
        raise ValueError(f"optimizer.master: bf16 steps the weights where the optimizer runs: "
                         f"params.tier must be dram (optimizer.tier dram or nvme), hbm with "
                         f"optimizer.tier hbm, or auto; got params.tier {params.value} with "
                         f"optimizer.tier {optimizer.value}")


def _patterns(value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if (not isinstance(value, (list, tuple)) or not value
            or not all(isinstance(v, str) and v for v in value)):
        raise ValueError(f"expected a non-empty list of parameter name patterns, got {value!r}")
    return tuple(value)


@dataclass(frozen=True)
class ParamGroupPolicy:
    """Parameters stepped with their own AdamW hyperparameters, as a ``torch.optim`` param group:
    those with a name (as in ``model.named_parameters()``, and a tied one by any of its names;
    a linear layer split by ``tiling`` has ``<layer>.tiles.<i>.weight``) matching one of
    ``match``'s shell-style patterns (``fnmatch``: ``*.bias``, ``*norm*``), and not matched by
    an earlier group. A value left null is the optimizer's."""

    match: tuple[str, ...] = field(default=(), metadata=parsed_by(_patterns))
    lr: float | None = field(default=None, metadata=optional(as_number))
    betas: tuple[float, float] | None = field(default=None, metadata=optional(as_betas))
    eps: float | None = field(default=None, metadata=optional(as_number))
    weight_decay: float | None = field(default=None, metadata=optional(as_number))

    def __post_init__(self):
        if not self.match:
            raise ValueError("match is required: the parameter name patterns of this group")
        object.__setattr__(self, "match", _patterns(self.match))  # hashable, built in code too
        _check_adamw(self.lr, self.betas, self.eps, self.weight_decay)


@dataclass(frozen=True)
class OptimizerPolicy:
    """AdamW with the semantics of ``torch.optim.AdamW``."""

    tier: Tier = Tier.DRAM
    """Where the fp32 master weights and Adam moments live; the step runs there (GPU for hbm);
    auto: the planner decides per unit."""
    lr: float = field(default=1e-4, metadata=parsed_by(as_number))
    betas: tuple[float, float] = field(default=(0.9, 0.999), metadata=parsed_by(as_betas))
    eps: float = field(default=1e-8, metadata=parsed_by(as_number))
    weight_decay: float = field(default=0.0, metadata=parsed_by(as_number))
    max_grad_norm: float | None = field(default=None, metadata=optional(as_norm_bound))
    """Clip the global gradient norm to this before each step (``clip_grad_norm_`` semantics);
    ``.inf`` takes the norm (``optimizer.last_grad_norm``) and never clips."""
    accumulation_steps: int | None = field(default=None, metadata=optional(as_whole_number))
    """Backward calls per ``optimizer.step()``. When set (and neither clipping nor fp16 needs the
    global norm first), each unit is stepped as soon as its gradient of the last backward lands,
    overlapping the rest of that backward, with the learning rate set at that moment; null waits
    for ``optimizer.step()``. At 1, bf16 and fp16 gradients are kept in the compute dtype, as
    no sum of backwards needs fp32 (2 bytes per parameter less in the grads tier)."""
    delayed_update: DelayedUpdatePolicy = DelayedUpdatePolicy()
    sub_group_size: int = field(default=1 << 25, metadata=parsed_by(as_whole_number))
    """Elements per sub-group when optimizer states stream from NVMe: three sets of pinned
    buffers of this many elements per state (read ahead, stepped, written back)."""
    param_groups: tuple[ParamGroupPolicy, ...] = field(default=(),
                                                       metadata={"items": ParamGroupPolicy})
    """Groups of parameters with their own hyperparameters (``optimizer.param_groups[1:]``);
    the rest are ``param_groups[0]``, with the values above."""
    moments: MomentsDtype = MomentsDtype.FP32
    """How the Adam moments are stored: fp32 | bf16 (2 bytes each, stochastically rounded) |
    int8 (about 1 byte each: 8-bit codes with a scale per block of 256). Opt-in: what they cost
    in loss is measured in bench/RESULTS.md (issue 21)."""
    master: MasterDtype = MasterDtype.FP32
    """fp32, or bf16: no fp32 master weights; the bf16 weights are the master, updated with
    stochastic rounding (needs compute_dtype bf16, and the weights where the optimizer steps
    them: not on NVMe)."""
    rounding_seed: int = field(default=0, metadata=parsed_by(as_whole_number))
    """The seed of stochastic rounding's random stream (with each unit and step: a run and its
    resume round alike)."""

    def __post_init__(self):
        if self.sub_group_size < 1024 or self.sub_group_size % 1024:
            raise ValueError(f"sub_group_size must be a multiple of 1024 elements (4 KiB of "
                             f"fp32), got {self.sub_group_size}")
        granule = piece_granule([torch.float32, self.moments.torch_dtype])
        if self.sub_group_size % granule:
            raise ValueError(f"sub_group_size must be a multiple of {granule} elements with "
                             f"moments: {self.moments.value} (a piece of states on NVMe is "
                             f"whole 4 KiB blocks of each), got {self.sub_group_size}")
        if self.accumulation_steps is not None and self.accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be >= 1 or null, "
                             f"got {self.accumulation_steps}")
        _check_adamw(self.lr, self.betas, self.eps, self.weight_decay)
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be > 0 or null, got {self.max_grad_norm}")


def _expand_home(section) -> None:
    """A section's ``path`` as a string (also one given as a ``pathlib.Path``), with a leading
    ``~`` or ``~user`` expanded as a shell would: a path in YAML, in an override or in a quoted
    ``--nvme "~/x"`` meets no shell that would expand it, and a folder named ``~`` in the
    working directory is never what was meant."""
    keep_path_as_string(section)
    if section.path is not None:
        object.__setattr__(section, "path", os.path.expanduser(section.path))


@dataclass(frozen=True)
class NvmePolicy:
    path: str | None = field(default=None, metadata=optional(as_path))
    """Folder on the drive; each run makes its own subfolder there and removes it at exit."""
    budget: int | None = field(default=None, metadata=parsed_by(as_size_or_none))
    """Bytes tiered may use there; null = this rank's share (ranks on the node) of the free
    space of that file system, the smallest any rank measured."""
    block_size: int = field(default=1 << 20, metadata=parsed_by(parse_size))
    """Bytes per I/O request; large transfers are split into requests of this size. The
    defaults are the best point of ``tiered bench-io``'s sweep on the GPU box's disk (see
    bench/RESULTS.md)."""
    queue_depth: int = field(default=16, metadata=parsed_by(as_whole_number))
    """Requests in flight per direction (reads and writes each have their own threads)."""

    def __post_init__(self):
        _expand_home(self)
        if self.block_size < 4096 or self.block_size % 4096:
            raise ValueError(f"block_size must be a multiple of 4096 bytes, got {self.block_size}")
        if self.queue_depth < 1:
            raise ValueError(f"queue_depth must be >= 1, got {self.queue_depth}")


@dataclass(frozen=True)
class HbmPolicy:
    budget: int | None = field(default=None, metadata=parsed_by(as_size_or_none))
    """Bytes of device memory tiered may hold; null = what the device has."""
    reserve: int | None = field(default=None, metadata=parsed_by(as_size_or_none))
    """With ``tier: auto``: bytes of the budget the planner leaves free for what no plan counts
    (activations, the allocator's cache); null = a quarter of the budget until the first step
    has measured them, then re-planned with what it measured (see [Note: re-plan])."""


@dataclass(frozen=True)
class DramPolicy:
    budget: int | None = field(default=None, metadata=parsed_by(as_size_or_none))
    """Bytes of (pinned) host memory tiered may hold; null = this rank's share (ranks on the
    node) of 7/8 of the memory available when the engine starts (the host's, capped by the
    process's cgroup memory limit), the smallest any rank measured."""
    spill: Tier | None = field(default=None, metadata=optional(Tier))
    """null, or nvme: states placed in DRAM that do not fit the budget move to NVMe, unit by
    unit (optimizer states first, then weights), so only what does not fit uses the drive."""
    huge_pages: bool = field(default=False, metadata=parsed_by(as_bool))
    """Ask the kernel to back the slabs with 2 MiB transparent huge pages (``madvise``): the
    CPU update streams five arrays at once, and with 4 KiB pages each stream needs a new TLB
    entry every 1-2 K elements, a page walk that costs most under a hypervisor. (A
    ``dram_source`` given to ``initialize`` makes the slabs itself and decides on its own.)"""

    def __post_init__(self):
        if self.spill not in (None, Tier.NVME):
            raise ValueError(f"spill must be null or 'nvme', got {self.spill.value!r}")


@dataclass(frozen=True)
class LossScalePolicy:
    """Dynamic loss scaling for fp16 compute, as ``torch.amp.GradScaler`` does it."""

    initial_scale: float = field(default=2.0**16, metadata=parsed_by(as_number))
    growth_factor: float = field(default=2.0, metadata=parsed_by(as_number))
    backoff_factor: float = field(default=0.5, metadata=parsed_by(as_number))
    growth_interval: int = field(default=2000, metadata=parsed_by(as_whole_number))

    def __post_init__(self):
        if self.initial_scale <= 0 or self.growth_factor <= 1.0:
            raise ValueError("initial_scale must be > 0 and growth_factor > 1")
        if not 0.0 < self.backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {self.backoff_factor}")
        if self.growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {self.growth_interval}")


@dataclass(frozen=True)
class CpuPolicy:
    optimizer_threads: int | None = field(default=None, metadata=optional(as_whole_number))
    """Threads of the CPU optimizer worker; null = the cores this rank may use (affinity and
    cgroup quota), less two when it drives a GPU (the training thread's and the driver's; see
    optim.workers.optimizer_threads)."""

    def __post_init__(self):
        if self.optimizer_threads is not None and self.optimizer_threads < 1:
            raise ValueError(f"optimizer_threads must be >= 1 or null, "
                             f"got {self.optimizer_threads}")


@dataclass(frozen=True)
class PrefetchPolicy:
    """Fetching units ahead of need along the order recorded in the previous iteration."""

    enabled: bool = field(default=True, metadata=parsed_by(as_bool))
    hbm_bytes: int | None = field(default=None, metadata=parsed_by(as_size_or_none))
    """Device bytes of units gathered ahead of need (prefetched, or kept for a use soon);
    null = twice the largest module's (a split module's two halves summed)."""
    dram_bytes: int | None = field(default=None, metadata=parsed_by(as_size_or_none))
    """Pinned bytes of NVMe weights read ahead of their gather; null = two of the largest shard."""
    depth: int = field(default=2, metadata=parsed_by(as_whole_number))
    """How many modules ahead of need to gather, along the trace (a unit released while its
    module is among them stays gathered instead)."""

    def __post_init__(self):
        if self.depth < 1:
            raise ValueError(f"depth must be >= 1, got {self.depth}")


@dataclass(frozen=True)
class ActivationsPolicy:
    """Where what autograd saves for backward waits for it (see [Note: activations in DRAM] in
    engine/offloaded_activations.py, [Note: activations on NVMe] in
    engine/activations_nvme.py)."""

    tier: Tier = Tier.HBM
    """hbm: on the device, as PyTorch keeps it; dram: each saved tensor of at least
    ``min_bytes`` copied into DRAM as the forward saves it, and back as its backward needs it;
    nvme: as dram, and what the DRAM block cannot hold written to a file under ``nvme.path``;
    auto: in DRAM for the first step, then on the device if what it saved fits there beside
    the plan (see [Note: activations in DRAM])."""
    dram_bytes: int = field(default=1 << 30, metadata=parsed_by(parse_size))
    """With ``tier: dram``, ``nvme`` or ``auto``: the pinned bytes of the DRAM tier that hold
    them (counted against ``dram.budget``); what does not fit stays on the device (with
    ``nvme``: goes to the drive)."""
    nvme_bytes: int = field(default=64 << 30, metadata=parsed_by(parse_size))
    """With ``tier: nvme``: the bytes of the file under ``nvme.path`` that holds what the DRAM
    block cannot (reserved when the engine starts, in this rank's NVMe budget, so that a full
    drive shows then); what fits neither stays on the device."""
    min_bytes: int = field(default=1 << 20, metadata=parsed_by(parse_size))
    """With ``tier: dram`` or ``nvme``: smaller saved tensors stay on the device (a copy each
    would cost more than the bytes it frees)."""
    prefetch_bytes: int = field(default=256 << 20, metadata=parsed_by(parse_size))
    """With ``tier: dram`` or ``nvme`` on a device with streams: how many bytes of the tensors
    backward reads next are copied back (read back from the drive) ahead of need, beside the
    compute (0: each as it is read). With ``nvme`` the reads land in a pinned block of about as
    many bytes (plan.activation_slots)."""

    def __post_init__(self):
        if self.uses_dram and self.dram_bytes <= 0:
            raise ValueError(f"dram_bytes must be > 0 with tier: {self.tier.value}, got "
                             f"{self.dram_bytes}")
        if self.tier is Tier.NVME and self.nvme_bytes <= 0:
            raise ValueError(f"nvme_bytes must be > 0 with tier: nvme, got {self.nvme_bytes}")

    @property
    def uses_dram(self) -> bool:
        """Whether the plan holds a DRAM block for them (tier: dram or nvme, or auto's first
        step)."""
        return self.tier in (Tier.DRAM, Tier.NVME, Tier.AUTO)

    @property
    def block_bytes(self) -> int:
        """The DRAM block the plan holds for them (0 with tier: hbm)."""
        return self.dram_bytes if self.uses_dram else 0

    @property
    def file_bytes(self) -> int:
        """The NVMe file the plan holds for them (0 but with tier: nvme)."""
        return self.nvme_bytes if self.tier is Tier.NVME else 0


@dataclass(frozen=True)
class TilingPolicy:
    max_unit_bytes: int | None = field(default=None, metadata=parsed_by(as_size_or_none))
    """Every nn.Linear whose weight (in the compute dtype) is larger becomes a TiledLinear whose
    tiles are units of at most this size; null = no automatic tiling."""


@dataclass(frozen=True)
class TracePolicy:
    path: str | None = field(default=None, metadata=optional(as_path))
    """Write a Chrome-trace timeline here (the environment's TIERED_TRACE wins)."""

    def __post_init__(self):
        _expand_home(self)


@dataclass(frozen=True)
class UnitsPolicy:
    classes: tuple[str, ...] | None = field(default=None, metadata=parsed_by(as_class_names))
    """Module class names that each become a unit; null = every repeated block (see units.py)."""
    split_large: bool = field(default=True, metadata=parsed_by(as_bool))
    """Also make a unit of every module outside the units whose own parameters are as large as
    the largest unit (an untied token embedding, an output head). Such a unit is gathered for the
    whole forward, as the root is, but its gradient leaves when its own backward is done instead
    of waiting in the root's buffer through the whole backward (see units.py)."""
    split_frozen: bool = field(default=True, metadata=parsed_by(as_bool))
    """Make two units of a unit whose parameters are partly frozen: its frozen parameters, which
    keep their weights alone, and its trainable ones, gathered together, each released after
    its own backward. LoRA adapters in a frozen block then cost optimizer state for themselves
    only (see units.py)."""


@dataclass(frozen=True)
class Policy:
    """Where each piece of training state lives, and the optimizer that updates it.

    Built in code, its fields take the enums and section classes (``ComputeDtype.FP32``,
    ``ParamsPolicy(Tier.NVME)``); plain values as YAML has them (``"fp32"``, ``{"tier":
    "nvme"}``) go through :meth:`from_dict`. A plain value given here is refused with a
    PolicyError that names the field and the ``from_dict`` call taking it, not converted: taken,
    it would fail later, deep in the engine (``'str' object has no attribute 'torch_dtype'``).
    """

    compute_dtype: ComputeDtype = ComputeDtype.AUTO
    device: Device = Device.AUTO
    params: ParamsPolicy = ParamsPolicy()
    grads: GradsPolicy = GradsPolicy()
    optimizer: OptimizerPolicy = OptimizerPolicy()
    nvme: NvmePolicy = NvmePolicy()
    hbm: HbmPolicy = HbmPolicy()
    dram: DramPolicy = DramPolicy()
    loss_scale: LossScalePolicy = LossScalePolicy()
    units: UnitsPolicy = UnitsPolicy()
    cpu: CpuPolicy = CpuPolicy()
    prefetch: PrefetchPolicy = PrefetchPolicy()
    activations: ActivationsPolicy = ActivationsPolicy()
    trace: TracePolicy = TracePolicy()
    tiling: TilingPolicy = TilingPolicy()

    def __post_init__(self):
        misplaced = plain_value_in(self)
        if misplaced is not None:
            raise PolicyError(plain_value_message(*misplaced))
        tiers = {"params": self.params.tier, "grads": self.grads.tier,
                 "optimizer": self.optimizer.tier}
        if Tier.AUTO in tiers.values() and set(tiers.values()) != {Tier.AUTO}:
            given = ", ".join(f"{name}.tier: {tier.value}" for name, tier in tiers.items())
            raise ValueError(f"tier: auto places a unit's weights, gradient and optimizer states "
                             f"together: set it for params, grads and optimizer alike (got "
                             f"{given})")
        if self.hbm.reserve is not None and Tier.AUTO not in tiers.values():
            raise ValueError(f"hbm.reserve ({self.hbm.reserve} bytes) is what tier: auto leaves "
                             f"free on the device; no tier is auto here: drop it, or set "
                             f"params, grads and optimizer to auto")
        expected_grads = {Tier.HBM: Tier.HBM, Tier.AUTO: Tier.AUTO}.get(self.optimizer.tier,
                                                                         Tier.DRAM)
        if self.grads.tier is not expected_grads:
            raise ValueError(
                f"grads.tier must be {expected_grads.value!r} when optimizer.tier is "
                f"{self.optimizer.tier.value!r}: the optimizer steps where its states live and "
                f"reads the gradient there")
        if self.optimizer.master is MasterDtype.BF16:
            _check_bf16_master(self)
        # auto may choose fp32: its element is the one a tile must hold.
        element = (ComputeDtype.FP32 if self.compute_dtype is ComputeDtype.AUTO
                   else self.compute_dtype)
        tile_limit = self.tiling.max_unit_bytes
        if tile_limit is not None and tile_limit < element.torch_dtype.itemsize:
            # A tile holds at least one element; below that, tiling divided by zero.
            raise ValueError(f"tiling.max_unit_bytes must be null or at least "
                             f"{element.torch_dtype.itemsize} bytes (one {element.value} "
                             f"element), got {tile_limit}")
        # Last: the one check an override commonly satisfies (the path of --nvme or nvme=), so
        # that a file lacking only the path still shows its other errors as its own.
        if self.uses_nvme and not self.nvme.path:
            asking = [f"{key}: nvme" for key, tier in self._nvme_keys() if tier is Tier.NVME]
            raise ValueError(f"nvme.path is required by {' and '.join(asking)} (set it in the "
                             f"policy or pass tiered-launch --nvme PATH)")

    def _nvme_keys(self) -> tuple[tuple[str, Tier | None], ...]:
        """The keys that may ask for a drive, each with its value."""
        return (("params.tier", self.params.tier), ("optimizer.tier", self.optimizer.tier),
                ("dram.spill", self.dram.spill), ("activations.tier", self.activations.tier))

    @property
    def uses_nvme(self) -> bool:
        """Whether the run has an NVMe tier (under ``tier: auto``, whenever a path is set)."""
        return any(tier is Tier.NVME for _, tier in self._nvme_keys()) or (
            self.placed_by_planner and bool(self.nvme.path))

    @property
    def placed_by_planner(self) -> bool:
        """``tier: auto``: the planner places each unit's states (planner.py)."""
        return self.optimizer.tier is Tier.AUTO

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, source: str = "<dict>") -> "Policy":
        """Build from a mapping of the YAML schema; missing keys take their defaults."""
        return build(cls, {} if data is None else data, key_path="", source=source)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, overrides: Mapping[str, Any] | None = None) -> "Policy":
        """A YAML policy file, or a DeepSpeed config (``ds_config.json``) translated as
        policy/deepspeed.py says."""
        return _with_overrides(read_policy_file(path), str(path), overrides or {})

    def to_dict(self) -> dict[str, Any]:
        """The YAML schema form: plain types only, so it round-trips through JSON and YAML."""
        def plain(value):
            if isinstance(value, enum.Enum):
                return value.value
            if dataclasses.is_dataclass(value):
                return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
            if isinstance(value, tuple):
                return [plain(v) for v in value]
            return value
        return plain(self)

    def replace(self, **overrides: Any) -> "Policy":
        """A copy with schema-form overrides merged in (``optimizer={"lr": 1e-3}``)."""
        return _with_overrides(self.to_dict(), "a tiered.Policy", overrides)


def resolve(policy: "Policy | str | os.PathLike | Mapping[str, Any] | None",
            overrides: Mapping[str, Any] | None = None) -> Policy:
    """The one place a user's policy argument becomes a Policy.

    ``None`` takes the policy ``tiered-launch`` passed through the environment, else the
    built-in defaults (equal to ``configs/cpu.yaml``). ``overrides``: the keyword arguments of
    ``initialize`` and ``tiered.init`` (or tiered-launch's ``--nvme``), merged on top.
    """
    overrides = dict(overrides or {})
    if policy is None:
        launched = os.environ.get(POLICY_ENV)
        if launched:
            return _with_overrides(json.loads(launched), f"${POLICY_ENV} (from tiered-launch)",
                                   overrides)
        return _with_overrides({}, "the built-in defaults", overrides)
    if isinstance(policy, Policy):
        return policy.replace(**overrides) if overrides else policy
    if isinstance(policy, Mapping):
        return _with_overrides(policy, "<dict>", overrides)
    if isinstance(policy, (str, os.PathLike)):
        return Policy.from_yaml(policy, overrides)
    raise PolicyError(f"policy must be a YAML path, a dict or a tiered.Policy, got "
                      f"{type(policy).__name__}")


def resolve_compute_dtype(policy: Policy, device: torch.device,
                          agree: Callable[[bool], bool] = bool) -> tuple[Policy, str]:
    """``policy`` with ``compute_dtype: auto`` made concrete for ``device`` (bf16 where it
    computes bf16 natively, else fp32), and the dtype with why, as a log line says it. Done
    once, at initialize: the plan, the optimizer and a checkpoint see the concrete dtype.
    ``agree``: whether every rank holds a value (a collective, called under auto only), so
    that ranks on different machines compute alike; one without native bf16 makes it fp32."""
    if policy.compute_dtype is not ComputeDtype.AUTO:
        return policy, f"{policy.compute_dtype.value} (the policy's)"
    support = bf16_support(device)
    everywhere = agree(support.native)
    why = support.why if everywhere or not support.native else (
        "another rank's device has no native bf16")
    chosen = ComputeDtype.BF16 if everywhere else ComputeDtype.FP32
    return dataclasses.replace(policy, compute_dtype=chosen), f"{chosen.value} (auto: {why})"


def _with_overrides(base: Mapping[str, Any], source: str,
                    overrides: Mapping[str, Any]) -> Policy:
    """``base`` (read from ``source``) with ``overrides`` merged in.

    An error is the base's only when the base alone gives the very same one; otherwise the
    overrides brought it (a key or value of theirs, or one that does not go with the base), and
    the message names them, so that ``initialize(model, "cpu.yaml", bogus=1)`` does not send
    the user looking for ``bogus`` in cpu.yaml. The base alone may be incomplete: an override
    may supply what it lacks (nvme.path for nvme.yaml).
    """
    merged = merge(base, overrides)
    try:
        return Policy.from_dict(merged, source)
    except PolicyError as error:
        if not overrides or str(error) == _error_of(base, source):
            raise
    # Built again under a source that names the overrides, it fails the same way.
    return Policy.from_dict(merged, f"{source} with overrides {dict(overrides)!r}")


def _error_of(data: Mapping[str, Any], source: str) -> str | None:
    """The message of the PolicyError ``data`` gives, if any."""
    try:
        Policy.from_dict(data, source)
    except PolicyError as error:
        return str(error)
    return None
