"""``tiered plan MODEL``: what a policy places in each tier for a model, and the step it predicts
on a node, with no GPU and nothing allocated (issue 20, part 4).

MODEL is a Hugging Face ``config.json`` or a folder holding one (the model is built from the
config on the meta device by transformers), or ``module:factory``, a function of no arguments
returning the model, called on the meta device (the current folder is importable, as for
``python -m``). The model is cut into units and planned exactly as ``initialize`` plans it, for
rank 0 of ``--ranks`` on one node.

The budgets are the policy's where it sets them, else the node's: ``--node FILE`` (what
``tiered node --json`` printed there; the reference GPU box's is bench/node_h100.json) or this
node's rates cached by ``tiered node``. Its device memory is the HBM budget, 7/8 of its host
memory shared by the ranks the DRAM budget, as ``initialize`` takes them; the drive's space is
not known, so NVMe bytes are shown without a budget. The prediction reads the same rates
(plan_report.py). Activations are not planned here: what the forward keeps depends on the batch
and sequence, which only a step measures.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import os
import sys

import torch
from torch import nn

from .engine.build import flat_units, forward_order, memory_plan
from .errors import TieredError, UsageError
from .node import NodeRates
from .plan import MemoryPlan
from .plan_report import PlanReport, plan_report
from .planner import hbm_reserve, place_units
from .policy import Device, Policy, Tier


def model_on_meta(spec: str) -> nn.Module:
    """The model ``spec`` names (see the module note), its parameters on the meta device."""
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
    """What each tier may hold on the planned node (None: not known, not checked)."""

    hbm: int | None
    dram: int | None
    nvme: int | None

    @classmethod
    def of(cls, policy: Policy, rates: NodeRates | None, ranks: int) -> "NodeBudgets":
        node_dram = rates.dram_bytes if rates is not None else None
        return cls(policy.hbm.budget if policy.hbm.budget is not None
                   else (rates.hbm_bytes if rates is not None else None),
                   policy.dram.budget if policy.dram.budget is not None
                   else (None if node_dram is None else node_dram * 7 // 8 // ranks),
                   policy.nvme.budget)

    def as_dict(self, with_nvme: bool) -> dict[Tier, int | None]:
        tiers = {Tier.HBM: self.hbm, Tier.DRAM: self.dram}
        return {**tiers, Tier.NVME: self.nvme} if with_nvme else tiers


def plan_model(model: nn.Module, policy: Policy, ranks: int,
               rates: NodeRates | None) -> PlanReport:
    """The report of ``policy``'s plan for ``model`` on rank 0 of ``ranks`` on a node of
    ``rates``' (the budgets: NodeBudgets.of)."""
    device = torch.device("cpu" if policy.device is Device.CPU else "cuda")
    flats = flat_units(model, policy, 0, ranks, torch.device("cpu"))  # nothing allocated
    if not flats:
        raise TieredError("the model has no parameters to train")
    budgets = NodeBudgets.of(policy, rates, ranks)

    def plan_with(on_device: frozenset[int]) -> MemoryPlan:
        return memory_plan(policy, device, flats, budgets.dram, on_device=on_device)

    if policy.placed_by_planner:
        if budgets.hbm is None:
            raise UsageError("tier: auto places units by the device's memory: set hbm.budget in "
                             "the policy, or give --node a file of `tiered node --json` from a "
                             "node with a GPU")
        plan = place_units(forward_order(flats), plan_with, lambda _: budgets.hbm,
                           hbm_reserve(policy, budgets.hbm))
    else:
        plan = plan_with(frozenset())
    return plan_report(plan, budgets.as_dict(policy.uses_nvme), policy, ranks, rates,
                       device.type == "cpu")


def read_node(path: str) -> NodeRates:
    """A node's rates as ``tiered node --json`` printed them."""
    try:
        with open(path) as file:
            return NodeRates(**json.load(file))
    except OSError as error:
        raise UsageError(f"--node {path}: {error.strerror}") from None
    except (ValueError, TypeError) as error:
        raise UsageError(f"--node {path}: not the JSON of `tiered node --json` ({error})") from None
