"""``tiered plan MODEL``: what a policy places in each tier for a model, and the step it predicts
on a node, with no GPU and nothing allocated (issue 20, part 4).

MODEL is a Hugging Face ``config.json`` or a folder holding one (the model is built from the
config on the meta device by transformers), or ``module:factory``, a function of no arguments
returning the model, called on the meta device (the current folder is importable, as for
``python -m``). The model is cut into units and planned as ``initialize`` plans it, for rank 0
of ``--ranks`` on one node, except for what only a run knows or does: the peak of building
units is the plan's estimate, not a measurement, and a plan too tight for its budgets is shown
over them, where initialize would first give up prefetch and landing slots.

The budgets are the policy's where it sets them, else the node's: ``--node FILE`` (what
``tiered node --json`` printed there; the reference GPU box's is bench/node_h100.json) or this
node's rates cached by ``tiered node``. Its device memory is the HBM budget, 7/8 of its host
memory shared by the ranks the DRAM budget, as ``initialize`` takes them (on a CPU device the
two tiers split that RAM, as there); the drive's space is
not known, so NVMe bytes are shown without a budget. The prediction reads the same rates
(planning/report.py).

With ``--batch B --seq S`` the model's forward runs on fake tensors on B sequences of S token
ids (a Hugging Face model with them as labels too, so its loss counts) and what autograd keeps
for backward is counted (activations.py): on a CPU it is, to the byte, what a real forward
keeps. Under ``tier: auto`` with ``hbm.reserve: null`` the plan shown is the one the re-plan
after a first step of that batch settles on (the first plan, and the units that then fit
beside the count and 1/16 of the budget moved to the device); and the largest batch whose
activations fit beside the plan is shown. What a backward allocates on its way is not counted
(the sixteenth is for it).
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import os
import sys

import torch
from torch import nn

from ..core.errors import TieredError, UsageError
from ..engine.build import flat_units, forward_order, memory_plan
from ..placement.manager import dram_beside_hbm, split_shared_ram
from ..placement.plan import MemoryPlan
from ..planning.activations import forward_activations
from ..planning.node import NodeRates
from ..planning.planner import MEASURED_MARGIN_SHARE, hbm_reserve, place_units, replanned_units
from ..planning.report import BatchFit, PlanReport, plan_report
from ..policy.config import Device, Policy, Tier


def model_on_meta(spec: str, lora: int | None = None, checkpointing: bool = False) -> nn.Module:
    """The model ``spec`` names (see the module note), its parameters on the meta device;
    with ``lora``, adapters of that rank on every linear layer, the rest frozen; with
    ``checkpointing``, a Hugging Face model's activation checkpointing on (each decoder layer
    keeps its input only, and recomputes the rest in backward)."""
    model = _named_model(spec)
    if checkpointing:
        # activation_checkpointing_enable: gradient_checkpointing_enable's name since
        # transformers 5.2x, the old one deprecated
        enable = (getattr(model, "activation_checkpointing_enable", None)
                  or getattr(model, "gradient_checkpointing_enable", None))
        if enable is None:
            raise UsageError(f"--checkpointing: MODEL {spec!r} is not a Hugging Face model; "
                             f"a factory's model checkpoints as its own code says")
        enable({"use_reentrant": False})
    return model if lora is None else _with_lora(model, lora, os.path.exists(spec))


def _with_lora(model: nn.Module, rank: int, hugging_face: bool) -> nn.Module:
    """PEFT's LoRA of ``rank`` on every linear layer (``target_modules="all-linear"``: a
    Hugging Face model's output layer left out), as a LoRA fine-tune is usually set up."""
    try:
        import peft
    except ImportError:
        raise UsageError("--lora builds the adapters with peft (the 'hf' extra: pip install "
                         "'tiered[hf]')") from None
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear",
                             task_type="CAUSAL_LM" if hugging_face else None)
    try:
        with torch.device("meta"):
            return peft.get_peft_model(model, config)
    except (ValueError, TypeError) as error:
        raise UsageError(f"--lora {rank}: peft could not add adapters to the model: "
                         f"{error}") from None


def _named_model(spec: str) -> nn.Module:
    if os.path.exists(spec):
        return _hf_model(spec)
    module_name, _, factory_name = spec.partition(":")
    if not factory_name:
        raise UsageError(f"MODEL {spec!r}: no such file or folder, and not module:factory")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        factory = getattr(importlib.import_module(module_name), factory_name)
    except (ImportError, AttributeError) as error:
        raise UsageError(f"MODEL {spec!r}: {error}") from None
    try:
        with torch.device("meta"):
            model = factory()
    except Exception as error:  # the user's code: say where, not a trace through ours
        raise UsageError(f"MODEL {spec!r}: {factory_name}() failed: "
                         f"{type(error).__name__}: {error}") from None
    if not isinstance(model, nn.Module):
        raise UsageError(f"MODEL {spec!r}: {factory_name}() returned a "
                         f"{type(model).__name__}, not a torch.nn.Module")
    return model


def _hf_model(path: str) -> nn.Module:
    folder = os.path.dirname(path) if os.path.isfile(path) else path
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise UsageError(f"MODEL {path!r}: no config.json there")
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise UsageError("reading a Hugging Face config needs transformers (the 'hf' extra: "
                         "pip install 'tiered[hf]')") from None
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except (ValueError, OSError, KeyError) as error:
        raise UsageError(f"MODEL {path!r}: transformers could not build it: {error}") from None


@dataclasses.dataclass(frozen=True)
class NodeBudgets:
    """What each tier may hold on the planned node (None: not known, not checked). On a CPU
    device the HBM and DRAM tiers share ``shared`` bytes of RAM, which a plan's budgets split
    as initialize splits them (TierManager.budgets_for)."""

    hbm: int | None
    dram: int | None
    nvme: int | None
    shared: int | None = None

    @classmethod
    def of(cls, policy: Policy, rates: NodeRates | None, ranks: int,
           on_cpu: bool) -> "NodeBudgets":
        node_dram = rates.dram_bytes if rates is not None else None
        share = None if node_dram is None else node_dram * 7 // 8 // ranks
        if on_cpu:
            return cls(policy.hbm.budget, policy.dram.budget, policy.nvme.budget, share)
        return cls(policy.hbm.budget if policy.hbm.budget is not None
                   else (rates.hbm_bytes if rates is not None else None),
                   policy.dram.budget if policy.dram.budget is not None else share,
                   policy.nvme.budget)

    @property
    def hbm_capacity(self) -> int | None:
        """What ``hbm.reserve``'s default is a share of: the HBM budget, or the shared RAM."""
        return self.hbm if self.hbm is not None else self.shared

    def dram_room(self, hbm_needed: int) -> int | None:
        """The DRAM a plan may fill (what ``dram.spill`` keeps there), beside ``hbm_needed``."""
        if self.shared is None:
            return self.dram
        return dram_beside_hbm(self.dram if self.dram is not None else self.shared,
                               self.shared, self.hbm, hbm_needed)

    def for_plan(self, plan: MemoryPlan) -> dict[Tier, int | None]:
        """The HBM and DRAM budgets of ``plan`` (on a CPU device: split_shared_ram)."""
        if self.shared is None:
            return {Tier.HBM: self.hbm, Tier.DRAM: self.dram}
        hbm, dram = split_shared_ram(self.shared, self.hbm, self.dram, plan.needed(Tier.DRAM))
        return {Tier.HBM: hbm, Tier.DRAM: dram}


def planned_on_gpu(policy: Policy, rates: NodeRates | None) -> bool:
    """Whether the plan is for a GPU: ``device: auto`` is the node's GPU, or its CPU when its
    rates show none."""
    return not (policy.device is Device.CPU or (
        policy.device is Device.AUTO and rates is not None and rates.hbm_bytes is None))


def batch_activations(spec: str, policy: Policy, batch: int, seq: int, lora: int | None = None,
                      checkpointing: bool = False, for_gpu: bool = True) -> tuple[int, int]:
    """The bytes the forward of model ``spec`` (``lora``, ``checkpointing``: see
    model_on_meta) on ``batch`` sequences of ``seq`` tokens keeps for backward, and what one
    more sequence adds (see the module note; ``for_gpu``: activations.forward_activations)."""
    kept = [_meta_forward_bytes(spec, policy, rows, seq, lora, checkpointing, for_gpu)
            for rows in (batch, 2 * batch)]
    return kept[0], (kept[1] - kept[0]) // batch


def _meta_forward_bytes(spec: str, policy: Policy, rows: int, seq: int, lora: int | None,
                        checkpointing: bool, for_gpu: bool) -> int:
    model = model_on_meta(spec, lora, checkpointing).to(policy.compute_dtype.torch_dtype)
    hugging_face = os.path.exists(spec)

    def forward(model: nn.Module):
        ids = torch.zeros((rows, seq), dtype=torch.long)  # fake, as the model is
        return model(input_ids=ids, labels=ids) if hugging_face else model(ids)

    try:
        return forward_activations(model, forward, for_gpu)
    except Exception as error:  # the user's model: say what was asked of it
        raise UsageError(f"MODEL {spec!r}: its forward on a ({rows}, {seq}) batch of token ids "
                         f"on fake tensors failed: {type(error).__name__}: {error}") from None


def plan_model(model: nn.Module, policy: Policy, ranks: int, rates: NodeRates | None,
               batch: tuple[int, int, int, int] | None = None) -> PlanReport:
    """The report of ``policy``'s plan for ``model`` on rank 0 of ``ranks`` on a node of
    ``rates``' (the budgets: NodeBudgets.of). ``device: auto`` is the node's GPU, or its CPU
    when its rates show none. ``batch``: (sequences, tokens each, the bytes their forward keeps
    for backward, the bytes a sequence adds; batch_activations)."""
    on_cpu = not planned_on_gpu(policy, rates)
    device = torch.device("cpu" if on_cpu else "cuda")
    flats = flat_units(model, policy, 0, ranks, torch.device("cpu"))  # nothing allocated
    if not flats:
        raise TieredError("the model has no parameters to train")
    budgets = NodeBudgets.of(policy, rates, ranks, on_cpu)

    def plan_with(on_device: frozenset[int]) -> MemoryPlan:
        hbm_needed = memory_plan(policy, device, flats, None,
                                 on_device=on_device).needed(Tier.HBM)
        return memory_plan(policy, device, flats, budgets.dram_room(hbm_needed),
                           on_device=on_device)

    if policy.placed_by_planner:
        if budgets.hbm_capacity is None:
            raise UsageError("tier: auto places units by the device's memory: set hbm.budget in "
                             "the policy, or give --node a file of `tiered node --json` from a "
                             "node with a GPU")
        order = forward_order(flats)
        plan = place_units(order, plan_with, lambda plan: budgets.for_plan(plan)[Tier.HBM],
                           hbm_reserve(policy, budgets.hbm_capacity))
        if batch is not None and policy.hbm.reserve is None:  # as the re-plan moves them
            plan = plan.kept_on_device(replanned_units(
                plan, order, budgets.for_plan(plan)[Tier.HBM], batch[2]))
    else:
        plan = plan_with(frozenset())
    shown = budgets.for_plan(plan)
    if policy.uses_nvme:
        shown[Tier.NVME] = budgets.nvme
    report = plan_report(plan, shown, policy, ranks, rates, on_cpu)
    if batch is None:
        return report
    rows, seq, kept, per_sequence = batch
    largest = None
    if shown[Tier.HBM] is not None and per_sequence > 0:
        room = (shown[Tier.HBM] - plan.needed(Tier.HBM) - shown[Tier.HBM] // MEASURED_MARGIN_SHARE
                - (kept - rows * per_sequence))
        largest = max(0, room // per_sequence)
    return dataclasses.replace(report, batch=BatchFit(rows, seq, kept, per_sequence, largest))


def read_node(path: str) -> NodeRates:
    """A node's rates as ``tiered node --json`` printed them."""
    try:
        with open(path) as file:
            return NodeRates(**json.load(file))
    except OSError as error:
        raise UsageError(f"--node {path}: {error.strerror}") from None
    except (ValueError, TypeError) as error:
        raise UsageError(f"--node {path}: not the JSON of `tiered node --json` ({error})") from None
