"""``tiered plan MODEL``: what a policy places in each tier for a model, and the step it predicts
on a node, with no GPU and nothing allocated (issue 20, part 4).

MODEL is a Hugging Face ``config.json`` or a folder holding one (the model is built from the
config on the meta device by transformers), or ``module:factory``, a function of no arguments
returning the model, called on the meta device (the current folder is importable, as for
``python -m``). The model is cut into units and planned as ``initialize`` plans it, for rank 0
of ``--ranks`` on one node, except for what only a run knows or does: the peak of building
units is the plan's estimate, not a measurement, and a plan too tight for its budgets is shown
over them, where initialize would first give up prefetch and landing slots.

The budgets are the policy's where it sets them, else the node's memory: ``--node FILE``'s
(what ``tiered node --json`` printed there; the reference GPU box's is bench/node_h100.json),
else this node's, read the same way each time (its GPU's memory, its host's capped by its
cgroups: not what happens to be free), before any rates are measured. The device memory is the
HBM budget, 7/8 of the host memory shared by the ranks the DRAM budget, as ``initialize`` takes
them; on a CPU device (``device: cpu``, or a node without a GPU) the two tiers are that RAM,
held together against it. The drive's space is not known, so NVMe bytes have no budget unless
the policy sets one. The step is predicted from the node's rates (``--node FILE``'s, else
those ``tiered node`` cached here, measured with any NVMe path when none is asked:
planning/report.py) and shown only for a plan that fits. The answer ends with the verdict
(planning/verdict.py; what would make a plan fit is found by planning it: plan_answer.py).

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
import warnings

import torch
from torch import nn

from ..core.errors import TieredError, UsageError
from ..core.sizes import format_size
from ..engine.build import flat_units, forward_order, memory_plan
from ..engine.flat import FlatParam
from ..placement.budgets import dram_beside_hbm, split_shared_ram
from ..placement.plan import MemoryPlan
from ..ops.causal_lm import tile_sequence
from ..planning.activations import forward_activations
from ..planning.blocks import extrapolated, repeated_blocks, with_blocks
from ..planning.node import NodeMemory, NodeRates, this_node_memory
from ..planning.planner import MEASURED_MARGIN_SHARE, hbm_reserve, place_units, replanned_units
from ..planning.report import BatchFit, PlanReport, plan_report
from ..planning.verdict import TierRoom, Verdict
from ..policy.config import Policy
from ..policy.kinds import Device, Tier


def model_on_meta(spec: str, lora: int | None = None, checkpointing: bool = False,
                  tile: int | None = None) -> nn.Module:
    """The model ``spec`` names (see the module note), its parameters on the meta device;
    with ``lora``, adapters of that rank on every linear layer, the rest frozen; with
    ``checkpointing``, a Hugging Face model's activation checkpointing on (each decoder layer
    keeps its input only, and recomputes the rest in backward); with ``tile``, its MLPs and
    loss computed that many tokens at a time (tiered.ops.long_sequence)."""
    model = _named_model(spec)
    if tile is not None:
        _tiled(model, spec, tile)
    if checkpointing:
        # activation_checkpointing_enable: gradient_checkpointing_enable's name since
        # transformers 5.2x, the old one deprecated
        enable = (getattr(model, "activation_checkpointing_enable", None)
                  or getattr(model, "gradient_checkpointing_enable", None))
        if enable is None:
            raise UsageError(f"--checkpointing: MODEL {spec!r} is not a Hugging Face model; "
                             f"a factory's model checkpoints as its own code says")
        enable({"use_reentrant": False})
        config = getattr(model, "config", None)
        if config is not None:
            config.use_cache = False  # as a checkpointed fine-tune sets it: no cache to keep
    return model if lora is None else _with_lora(model, lora, os.path.exists(spec))


def _tiled(model: nn.Module, spec: str, tokens: int) -> None:
    """The model's MLPs and loss ``tokens`` tokens at a time: a Hugging Face causal LM's by
    tiered.ops.causal_lm, a factory's model's by its own ``tile_sequence`` (the
    example GPT's)."""
    if os.path.exists(spec):
        try:
            tile_sequence(model, mlp_tokens=tokens, loss_tokens=tokens)
        except TieredError as error:
            raise UsageError(f"--tile {tokens}: {error}") from None
    elif callable(own := getattr(model, "tile_sequence", None)):
        own(mlp_tokens=tokens, loss_tokens=tokens)
    else:
        raise UsageError(f"--tile: MODEL {spec!r} is neither a Hugging Face model nor one with "
                         f"a tile_sequence(mlp_tokens, loss_tokens) method")


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
        # peft calls transformers' deprecated names: a warning the user can do nothing about
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
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
    def of(cls, policy: Policy, memory: NodeMemory, ranks: int, on_cpu: bool) -> "NodeBudgets":
        share = None if memory.dram_bytes is None else memory.dram_bytes * 7 // 8 // ranks
        if on_cpu:
            return cls(policy.hbm.budget, policy.dram.budget, policy.nvme.budget, share)
        return cls(policy.hbm.budget if policy.hbm.budget is not None else memory.hbm_bytes,
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

    def hbm_for(self, plan: MemoryPlan) -> int:
        """The HBM budget of ``plan`` under ``tier: auto``, planned only where it is known
        (hbm_capacity)."""
        hbm = self.for_plan(plan)[Tier.HBM]
        assert hbm is not None, "tier: auto is planned only with the device's memory known"
        return hbm

    def for_plan(self, plan: MemoryPlan) -> dict[Tier, int | None]:
        """The HBM and DRAM budgets of ``plan`` (on a CPU device: split_shared_ram)."""
        if self.shared is None:
            return {Tier.HBM: self.hbm, Tier.DRAM: self.dram}
        hbm, dram = split_shared_ram(self.shared, self.hbm, self.dram, plan.needed(Tier.DRAM))
        return {Tier.HBM: hbm, Tier.DRAM: dram}


def node_memory(rates: NodeRates | None, from_file: bool) -> NodeMemory:
    """The planned node's memory: a node file's as it recorded it, else this node's, read the
    same way each time (not what rates cached here recorded when measured)."""
    if from_file and rates is not None:
        return NodeMemory(rates.hbm_bytes, rates.dram_bytes, "the node file's")
    return this_node_memory()


def planned_on_gpu(policy: Policy, memory: NodeMemory) -> bool:
    """Whether the plan is for a GPU: ``device: auto`` is the node's GPU, or its CPU when it
    has none."""
    return not (policy.device is Device.CPU or (
        policy.device is Device.AUTO and memory.hbm_bytes is None))


def batch_activations(model: nn.Module, spec: str, policy: Policy, batch: int, seq: int,
                      for_gpu: bool = True, siblings: bool = True) -> tuple[int, int]:
    """The bytes the forward of ``model`` (built by model_on_meta from ``spec``) on ``batch``
    sequences of ``seq`` tokens keeps for backward, and what one more sequence adds (see the
    module note; ``for_gpu``: activations.forward_activations). ``siblings``: count one of
    each list of identical blocks and extrapolate (blocks.py), which gives the same bytes."""
    kept = [forward_bytes(model, spec, policy, rows, seq, for_gpu, siblings)
            for rows in (batch, 2 * batch)]
    return kept[0], (kept[1] - kept[0]) // batch


def forward_bytes(model: nn.Module, spec: str, policy: Policy, rows: int, seq: int,
                  for_gpu: bool, siblings: bool = True) -> int:
    """What ``model``'s forward on ``rows`` sequences of ``seq`` token ids keeps for backward,
    counted on copies (the model is left on the meta device as it was)."""
    hugging_face = os.path.exists(spec)
    dtype = policy.compute_dtype.torch_dtype

    def forward(model: nn.Module):
        ids = torch.zeros((rows, seq), dtype=torch.long)  # fake, as the model is
        return model(input_ids=ids, labels=ids) if hugging_face else model(ids)

    def count(copy: nn.Module) -> int:
        return forward_activations(copy.to(dtype), forward, for_gpu)

    blocks = repeated_blocks(model) if siblings and _alike_by_position(model) else []
    if blocks:
        counted = extrapolated(count, model, blocks)
        if counted is not None:
            return counted
    try:
        return count(with_blocks(model, {}))
    except Exception as error:  # the user's model: say what was asked of it
        raise UsageError(f"MODEL {spec!r}: its forward on a ({rows}, {seq}) batch of token ids "
                         f"on fake tensors failed: {type(error).__name__}: {error}") from None


def _alike_by_position(model: nn.Module) -> bool:
    """Whether a Hugging Face model runs each decoder layer alike: not one whose config gives
    layers of several kinds (``layer_types``: sliding-window and full attention taking turns),
    which may keep what the first layers never show."""
    layer_types = getattr(getattr(model, "config", None), "layer_types", None)
    return not layer_types or len(set(layer_types)) == 1


def plan_model(model: nn.Module, policy: Policy, ranks: int, rates: NodeRates | None,
               batch: tuple[int, int, int, int] | None = None,
               memory: NodeMemory | None = None,
               flats: list[FlatParam] | None = None) -> PlanReport:
    """The report of ``policy``'s plan for ``model`` on rank 0 of ``ranks`` on a node of
    ``memory`` (by default the one ``rates`` recorded; the budgets: NodeBudgets.of) and
    ``rates``, with its verdict. ``device: auto`` is the node's GPU, or its CPU when it has
    none. ``batch``: (sequences, tokens each, the bytes their forward keeps for backward, the
    bytes a sequence adds; batch_activations). ``flats``: the model's units under ``policy``
    (flat_units), when already cut."""
    if memory is None:
        memory = node_memory(rates, from_file=True)
    on_cpu = not planned_on_gpu(policy, memory)
    device = torch.device("cpu" if on_cpu else "cuda")
    if flats is None:
        flats = flat_units(model, policy, 0, ranks, torch.device("cpu"))  # nothing allocated
    if not flats:
        raise TieredError("the model has no parameters to train")
    budgets = NodeBudgets.of(policy, memory, ranks, on_cpu)

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
        plan = place_units(order, plan_with, budgets.hbm_for,
                           hbm_reserve(policy, budgets.hbm_capacity))
        if batch is not None and policy.hbm.reserve is None:  # as the re-plan moves them
            hbm = budgets.hbm_for(plan)
            room = device_room(plan.needed(Tier.HBM), hbm)
            plan = plan.kept_on_device(replanned_units(
                plan, order, hbm, batch[2] - _in_dram(policy, batch[2], room)))
    else:
        plan = plan_with(frozenset())
    shown = budgets.for_plan(plan)
    if policy.uses_nvme:
        shown[Tier.NVME] = budgets.nvme
    # On a CPU device a tier's budget is its own where the policy sets one: the split of the
    # shared RAM (the DRAM tier's is what it pins) would show a budget equal to the plan and
    # another one over; the verdict holds the two together against the RAM.
    if on_cpu:
        shown_own = {**shown, Tier.HBM: policy.hbm.budget, Tier.DRAM: policy.dram.budget}
    report = plan_report(plan, shown_own if on_cpu else shown, policy, ranks, rates, on_cpu)
    fit = None
    if batch is not None:
        rows, seq, kept, per_sequence = batch
        largest = None
        room = device_room(plan.needed(Tier.HBM), shown[Tier.HBM])
        if room is not None and per_sequence > 0:
            largest = max(0, (room - (kept - rows * per_sequence) + policy.activations.block_bytes
                              + policy.activations.file_bytes) // per_sequence)
        in_dram = _in_dram(policy, kept, room)
        fit = BatchFit(rows, seq, kept, per_sequence, largest, in_dram,
                       min(kept - in_dram, policy.activations.file_bytes))
    verdict = Verdict(_rooms(report, policy, budgets, shown, on_cpu, fit),
                      note=_budgets_note(memory, ranks, on_cpu, fit))
    return dataclasses.replace(report, batch=fit, verdict=verdict)


def _in_dram(policy: Policy, kept: int, room: int | None) -> int:
    """What of ``kept`` bytes of activations the DRAM block holds: with ``activations.tier:
    dram`` the engine fills it first, and the rest stays on the device; with ``auto``, none where
    they fit the device's ``room`` beside the plan and its margin (the engine keeps them there
    after its first step), else as with dram (and nvme, whose file holds what is past the
    block). The tensors under ``min_bytes`` that stay on the device are left out: a few small
    ones a layer."""
    activations = policy.activations
    if activations.tier is Tier.AUTO and room is not None and kept <= room:
        return 0
    return min(kept, activations.block_bytes)


def device_room(hbm_needed: int, hbm_budget: int | None) -> int | None:
    """What ``hbm_budget`` leaves beside ``hbm_needed`` bytes of the plan and the re-plan's
    margin (None without a budget): the room for activations."""
    if hbm_budget is None:
        return None
    return hbm_budget - hbm_needed - hbm_budget // MEASURED_MARGIN_SHARE


def _margin(shown: dict[Tier, int | None]) -> int:
    """What the re-plan leaves free beside the activations: 1/16 of the HBM budget."""
    return (shown[Tier.HBM] or 0) // MEASURED_MARGIN_SHARE


def _rooms(report: PlanReport, policy: Policy, budgets: NodeBudgets,
           shown: dict[Tier, int | None], on_cpu: bool,
           fit: BatchFit | None) -> tuple[TierRoom, ...]:
    """Each tier's needs against its budget (``shown``: the plan's budgets, for_plan; see
    planning/verdict.py); the activations and their margin are the HBM tier's, as BatchFit
    counts them."""
    beside = 0 if fit is None else fit.on_device + _margin(shown)
    hbm, dram = report.needed[Tier.HBM] + beside, report.needed[Tier.DRAM]
    if on_cpu:
        rooms = [TierRoom(tier.value, needed, budget) for tier, needed, budget in
                 ((Tier.HBM, hbm, policy.hbm.budget), (Tier.DRAM, dram, policy.dram.budget))
                 if budget is not None]
        rooms.append(TierRoom("ram (hbm and dram together)", hbm + dram, budgets.shared))
    else:
        rooms = [TierRoom("hbm", hbm, shown[Tier.HBM]), TierRoom("dram", dram, shown[Tier.DRAM])]
    if Tier.NVME in report.needed:
        rooms.append(TierRoom("nvme", report.needed[Tier.NVME], budgets.nvme))
    return tuple(rooms)


def _budgets_note(memory: NodeMemory, ranks: int, on_cpu: bool, fit: BatchFit | None) -> str:
    ram = "-" if memory.dram_bytes is None else format_size(memory.dram_bytes)
    share = "7/8" if ranks == 1 else f"7/8 / {ranks} ranks"
    device = ("the CPU (its RAM holds the hbm and dram tiers)" if on_cpu else
              f"a GPU of {format_size(memory.hbm_bytes)}" if memory.hbm_bytes else "a GPU")
    counted = ("activations and a 1/16 margin counted in hbm" if fit is not None else
               "activations not counted: give --batch and --seq")
    return (f"budgets: {memory.of} memory ({ram} of RAM, {share} of it a rank's; device: "
            f"{device}) where the policy sets none; {counted}")


def read_node(path: str) -> NodeRates:
    """A node's rates as ``tiered node --json`` printed them."""
    try:
        with open(path) as file:
            return NodeRates(**json.load(file))
    except OSError as error:
        raise UsageError(f"--node {path}: {error.strerror}") from None
    except (ValueError, TypeError) as error:
        raise UsageError(f"--node {path}: not the JSON of `tiered node --json` ({error})") from None
