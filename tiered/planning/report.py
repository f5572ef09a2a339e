"""A plan, shown: bytes per tier against budgets, where each unit's states sit, and what a step
should cost on this node (issue 20, part 4).

The prediction reads the node's measured rates (node.py; ``tiered node`` measures and caches
them) and the bytes the plan moves each step:
- the CPU's AdamW over the units stepped on the host, the GPU's over those stepped on it;
- PCIe: each unit whose weights are off the device is gathered twice per forward-backward
  (forward and backward), its shard copied up each time, and each gradient kept on the host
  copied down once per backward; weights kept on the device but stepped on the host go up once;
- NVMe: weights on the drive are read for both gathers and (a trained unit's) written once,
  a trained unit's optimizer states read and written once; the drive does one at a time.
Everything here overlaps in the engine, so the step takes at least the largest of them, the
bound; the GPU's forward and backward come on top where they are longer, and are known only
once a step has run. With a step measured (engine/probe.py), the step predicted with its
forward and backward (``compute``):
- on a GPU with the delayed update, everything overlaps: max(compute + GPU update, CPU update,
  PCIe, NVMe);
- on a GPU without it, the update follows the backward: compute + GPU update + max(CPU update,
  NVMe) (an upper estimate: the next forward overlaps its tail unit by unit);
- on the CPU (playing the GPU), compute and every update share the cores: max(compute + the
  update, NVMe); there is no PCIe.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from ..core.report import format_table
from ..core.sizes import format_size
from ..placement.plan import OPTIMIZER_STATES, MemoryPlan, StateKind, reduce_dtype
from ..policy.config import Policy
from ..policy.kinds import ComputeDtype, Tier
from .longest import SequenceFit
from .node import NodeRates
from .verdict import Verdict

SHOWN_STATES = (StateKind.PARAM, StateKind.GRAD, StateKind.MASTER)
"""One row per kind of state: the moments sit with the master weights (a unit without masters,
under ``optimizer.master: bf16``, is counted where its moments are), the delayed update's next
weights with the weights."""


@dataclass(frozen=True)
class StepMeasurement:
    step: int
    """Which ``optimizer.step()`` call (from 1) ended the measured step."""
    compute_s: float
    """From the step's first forward to the end of its last backward, on the compute stream."""
    step_s: float | None
    """From the previous ``optimizer.step()`` to this one (None for the first)."""
    device_peak: int | None
    """The most device memory the process had allocated by then (a GPU's, else None)."""
    backwards: int = 1
    """The step's forward-backward passes."""
    unit_seconds: tuple[tuple[float, float], ...] = ()
    """Per unit: its forward's and its backward's seconds in the step (summed over the step's
    forwards and backwards; a unit's span holds the units nested in it, the root's the whole
    forward)."""
    activations: int = 0
    """The most bytes one of the step's forwards had autograd keep for backward on the device,
    the units' weights left out (activations.py)."""
    activations_in_dram: int = 0
    """The most bytes one of them kept in DRAM instead (``activations.tier: dram``)."""
    activations_on_nvme: int = 0
    """The most bytes one of them kept on the drive (``activations.tier: nvme``)."""


@dataclass(frozen=True)
class StepTerms:
    """Seconds a step spends on each resource (see the module note); None where the node has
    no such rate measured."""

    cpu_update: float
    gpu_update: float | None
    pcie: float | None
    nvme: float | None

    def predicted_step(self, compute_s: float, on_cpu: bool, delayed: bool) -> float:
        """The step with its forward and backward taking ``compute_s`` (see the module note)."""
        gpu, nvme = self.gpu_update or 0.0, self.nvme or 0.0
        if on_cpu:
            return max(compute_s + self.cpu_update + gpu, nvme)
        if delayed:
            return max(compute_s + gpu, self.cpu_update, self.pcie or 0.0, nvme)
        return compute_s + gpu + max(self.cpu_update, nvme)

    def named(self) -> dict[str, float | None]:
        return {"CPU update": self.cpu_update, "GPU update": self.gpu_update,
                "PCIe": self.pcie, "NVMe": self.nvme}

    @property
    def bound(self) -> tuple[str, float]:
        """The term that bounds the step, and its seconds."""
        known = {name: value for name, value in self.named().items() if value is not None}
        name = max(known, key=lambda term: known[term])
        return name, known[name]


@dataclass(frozen=True)
class BatchFit:
    """What a batch keeps for backward (``tiered plan --batch --seq``, counted on fake tensors:
    activations.py), and the largest batch that fits beside the plan."""

    batch: int
    seq: int
    activations: int
    """Bytes the forward of ``batch`` sequences of ``seq`` tokens keeps for backward."""
    per_sequence: int
    """Bytes one more sequence adds."""
    largest: int | None
    """The most sequences of ``seq`` tokens whose activations fit the HBM budget beside the
    plan and 1/16 of the budget (the re-plan's margin); None without an HBM budget."""
    in_dram: int = 0
    """Bytes of them the activations' DRAM block holds (``activations.tier: dram``); the rest
    are the device's."""
    on_nvme: int = 0
    """Bytes of them the activations' file holds (``activations.tier: nvme``, past the
    block)."""

    @property
    def on_device(self) -> int:
        return self.activations - self.in_dram - self.on_nvme

    def line(self) -> str:
        fits = ("" if self.largest is None else
                f"; the largest batch that fits beside the plan: {self.largest}"
                + (" (this one does not fit)" if self.largest < self.batch else ""))
        where = ("" if not self.in_dram else
                 f", {format_size(self.in_dram)} of them in the DRAM block")
        if self.on_nvme:
            where += f", {format_size(self.on_nvme)} in the file on NVMe"
        return (f"activations at batch {self.batch} x {self.seq} tokens: "
                f"{format_size(self.activations)} kept for backward "
                f"({format_size(self.per_sequence)} a sequence{where}){fits}")


@dataclass(frozen=True)
class PlanReport:
    needed: dict[Tier, int]
    budgets: dict[Tier, int | None]
    units: dict[StateKind, dict[Tier, int]]
    """Per kind of state (SHOWN_STATES), how many units hold it in each tier."""
    terms: StepTerms | None
    """None without the node's rates."""
    rates_of: str | None
    """The machine the rates were measured on."""
    measured: StepMeasurement | None = None
    """The last step measured, if any ran."""
    unit_names: tuple[str, ...] = ()
    """Each unit's name, for the measured units' seconds."""
    predicted_s: float | None = None
    """The step predicted with the measured step's compute (None without both)."""
    hbm_peak: int | None = None
    """The most the HBM tier has held (what the device's peak holds besides activations)."""
    replanned: str | None = None
    """What ``tier: auto``'s re-plan after the first step did (engine/replan.py), and where
    ``activations.tier: auto`` keeps them, once decided (a line each)."""
    batch: BatchFit | None = None
    """``tiered plan --batch --seq``'s activations and largest batch."""
    sequences: SequenceFit | None = None
    """``tiered plan --batch --seq``'s longest sequence for each activation tier (a GPU's)."""
    verdict: Verdict | None = None
    """``tiered plan``'s: whether the plan fits its node, and what would make it fit."""

    def table(self) -> str:
        tiers = [tier for tier in (Tier.HBM, Tier.DRAM, Tier.NVME) if tier in self.budgets]
        rows = [["tier", "planned", "budget", *(f"units: {kind.value}" for kind in SHOWN_STATES)]]
        for tier in tiers:
            budget = self.budgets[tier]
            over = budget is not None and self.needed[tier] > budget
            rows.append([tier.value, format_size(self.needed[tier]) + (" (over)" if over else ""),
                         "-" if budget is None else format_size(budget),
                         *(str(self.units[kind].get(tier, 0)) for kind in SHOWN_STATES)])
        lines = [format_table(rows)]
        if self.verdict is not None and not self.verdict.fits:
            lines.append("predicted step: none, the plan does not fit (see the verdict)")
        elif self.terms is None:
            lines.append("predicted step: run `tiered node` to measure this node's rates")
        else:
            parts = ", ".join(f"{name} {value:.3g} s" for name, value in self.terms.named().items()
                              if value is not None)
            name, seconds = self.terms.bound
            lines.append(f"predicted step: at least {seconds:.3g} s, bound by {name} ({parts}; "
                         f"the forward and backward are measured by the first step); "
                         f"rates of {self.rates_of}")
        if self.batch is not None:
            lines.append(self.batch.line())
        if self.sequences is not None:
            lines.append(self.sequences.line())
        measured = self.measured
        if measured is not None:
            line = (f"measured at step {measured.step}: forward and backward "
                    f"{measured.compute_s:.3g} s")
            if measured.step_s is not None:
                line += f", the step {measured.step_s:.3g} s"
            if self.predicted_s is not None:
                line += f"; predicted with them: {self.predicted_s:.3g} s"
            if measured.device_peak is not None and self.hbm_peak is not None:
                line += (f"; device memory peak {format_size(measured.device_peak)}, the HBM "
                         f"tier's {format_size(self.hbm_peak)} of it")
            line += f"; activations kept for backward {format_size(measured.activations)}"
            if measured.activations_in_dram or measured.activations_on_nvme:
                line += (f" on the device, {format_size(measured.activations_in_dram)} in "
                         f"DRAM")
            if measured.activations_on_nvme:
                line += f", {format_size(measured.activations_on_nvme)} on NVMe"
            lines.append(line)
            slowest = self._slowest_unit()
            if slowest is not None:
                name, (forward, backward) = slowest
                lines.append(f"slowest unit: {name}, forward {forward:.3g} s, backward "
                             f"{backward:.3g} s")
        if self.replanned is not None:
            lines.append(self.replanned)
        if self.verdict is not None:
            lines += self.verdict.lines()
        return "\n".join(lines)


    def _slowest_unit(self) -> tuple[str, tuple[float, float]] | None:
        """The unit whose forward and backward took longest, leaving out the root's span (the
        whole forward); None before a step is measured."""
        if self.measured is None or not self.measured.unit_seconds:
            return None
        named = [(name, seconds) for name, seconds in zip(self.unit_names,
                                                          self.measured.unit_seconds)
                 if name != "<root>"]
        return max(named, key=lambda item: sum(item[1]), default=None)

    def to_dict(self) -> dict:
        """As JSON holds it: tiers and states by name, the terms in seconds (none for a plan
        that does not fit, as the table shows none)."""
        terms = self.terms if self.verdict is None or self.verdict.fits else None
        return {"needed": {t.value: n for t, n in self.needed.items()},
                "budgets": {t.value: b for t, b in self.budgets.items()},
                "units": {k.value: {t.value: c for t, c in by_tier.items()}
                          for k, by_tier in self.units.items()},
                "terms": None if terms is None else terms.named(),
                "bound": None if terms is None else terms.bound[0],
                "rates_of": self.rates_of,
                "measured": None if self.measured is None else dict(
                    dataclasses.asdict(self.measured),
                    unit_seconds=dict(zip(self.unit_names, self.measured.unit_seconds))),
                "predicted_s": self.predicted_s, "hbm_peak": self.hbm_peak,
                "replanned": self.replanned,
                "batch": None if self.batch is None else dataclasses.asdict(self.batch),
                "sequences": (None if self.sequences is None
                              else dataclasses.asdict(self.sequences)),
                "verdict": None if self.verdict is None else self.verdict.to_dict()}


def plan_report(plan: MemoryPlan, budgets: Mapping[Tier, int | None], policy: Policy,
                world_size: int, rates: NodeRates | None, on_cpu: bool,
                measured: StepMeasurement | None = None, hbm_peak: int | None = None,
                unit_names: tuple[str, ...] = (), replanned: str | None = None) -> PlanReport:
    """``on_cpu``: the CPU is the device (it steps every unit, and no PCIe is crossed)."""
    units: dict[StateKind, dict[Tier, int]] = {kind: {} for kind in SHOWN_STATES}
    for (unit, kind), buffer in plan.shards.items():
        if kind is StateKind.EXP_AVG and (unit, StateKind.MASTER) not in plan.shards:
            kind = StateKind.MASTER  # the optimizer's states are where its moments are
        if kind in units:
            units[kind][buffer.tier] = units[kind].get(buffer.tier, 0) + 1
    tiers = [Tier.HBM, Tier.DRAM] + ([Tier.NVME] if Tier.NVME in budgets else [])
    backwards = (measured.backwards if measured is not None
                 else policy.optimizer.accumulation_steps or 1)
    terms = (None if rates is None
             else step_terms(plan, policy, world_size, rates, on_cpu, backwards))
    predicted = None
    if terms is not None and measured is not None:
        predicted = terms.predicted_step(measured.compute_s, on_cpu,
                                         policy.optimizer.delayed_update.enabled)
    return PlanReport({tier: plan.needed(tier) for tier in tiers},
                      {tier: budgets.get(tier) for tier in tiers}, units, terms,
                      None if rates is None else rates.machine, measured, unit_names,
                      predicted, hbm_peak, replanned)


def step_terms(plan: MemoryPlan, policy: Policy, world_size: int, rates: NodeRates,
               on_cpu: bool = False, backwards: int = 1) -> StepTerms:
    """What one step of ``plan`` costs on a node of ``rates`` (see the module note); ``on_cpu``:
    the CPU is the device, so it steps the HBM tier's units too, and nothing crosses PCIe;
    ``backwards``: forward-backward passes per step (each gathers the weights and sends the
    gradients down again)."""
    grad_bytes = reduce_dtype(policy, world_size).itemsize
    trained = {unit for unit, kind in plan.shards if kind is StateKind.EXP_AVG}
    """A frozen unit is never stepped: its masters stay put, its weights are never written."""
    host_params = device_params = 0
    up = down = drive_read = drive_write = 0
    for (unit, kind), buffer in plan.shards.items():
        n, tier = buffer.numel, buffer.tier
        stepped_on_host = unit in trained and (
            on_cpu or plan.shards[(unit, StateKind.EXP_AVG)].tier is not Tier.HBM)
        if kind is StateKind.EXP_AVG:  # a trained unit: stepped where its moments are
            params = plan.shards[(unit, StateKind.PARAM)].numel  # 8-bit moments are packed
            if stepped_on_host:
                host_params += params
            else:
                device_params += params
        elif kind is StateKind.PARAM:
            weights = n * buffer.dtype.itemsize  # or a quantized record's bytes
            if tier is not Tier.HBM:
                up += 2 * weights * backwards
            elif stepped_on_host and not on_cpu:  # new weights go up once a step
                up += weights
            if tier is Tier.NVME:
                drive_read += 2 * weights * backwards
                drive_write += weights if unit in trained else 0
        elif kind is StateKind.GRAD and tier is not Tier.HBM:
            down += n * grad_bytes * backwards
        if kind in OPTIMIZER_STATES and tier is Tier.NVME and unit in trained:
            drive_read += n * buffer.dtype.itemsize  # each step reads and writes them all
            drive_write += n * buffer.dtype.itemsize
    cpu_rate = (rates.cpu_adamw_params_per_s if policy.compute_dtype is ComputeDtype.FP32
                else rates.cpu_one_pass_params_per_s)
    gpu = (device_params / rates.gpu_adamw_params_per_s
           if rates.gpu_adamw_params_per_s else None)
    pcie = None
    if rates.both_gbps and rates.h2d_gbps and rates.d2h_gbps and not on_cpu:
        pcie = max(up / (rates.h2d_gbps * 1e9), down / (rates.d2h_gbps * 1e9),
                   (up + down) / (rates.both_gbps * 1e9))
    nvme = None
    if rates.nvme_read_gbps and rates.nvme_write_gbps:
        nvme = drive_read / (rates.nvme_read_gbps * 1e9) + \
            drive_write / (rates.nvme_write_gbps * 1e9)
    return StepTerms(host_params / cpu_rate, gpu, pcie, nvme)
