"""Cutting a model into units and building them at ``initialize``: each unit's fp32 flat
copy made (materialized and initialized under ``tiered.init``), broadcast from rank 0 and
stored shard by shard in the tiers; and the memory plan those units need."""
from __future__ import annotations

import warnings

import torch
from torch import nn

from ..checkpoint import pretrained
from ..checkpoint.pretrained import PretrainedWeights
from ..core.errors import BudgetError, TieredError
from ..placement.manager import TierManager
from ..placement.plan import MemoryPlan, StateKind, build_plan, by_module, unit_state_kinds
from ..placement.units import UnitSpec, find_units, module_groups
from ..policy.config import Policy
from .collectives import ProcessGroup
from .flat import FlatParam
from .init import Materializer
from .quantized import with_records


def flat_units(model: nn.Module, policy: Policy, rank: int, world_size: int,
               device: torch.device) -> list[FlatParam]:
    """The model's units as the policy cuts it (units.py), each a flat parameter partitioned
    over ``world_size`` ranks (still released: nothing is allocated), with the layout of its
    quantized record where ``params.frozen_dtype`` asks for one (engine/quantized.py)."""
    units = policy.units
    _refuse_renormalized_embeddings(model)
    specs = find_units(model, units.classes, units.split_large, units.split_frozen)
    _refuse_non_floating(specs)
    return with_records([FlatParam(spec, rank, world_size, policy.compute_dtype.torch_dtype,
                                   device) for spec in specs], policy)


def _refuse_renormalized_embeddings(model: nn.Module) -> None:
    """An embedding with ``max_norm`` renormalizes its weight in place in forward: here that
    would write a gathered copy, never the master weights (and autograd refuses a view changed
    in place), so the model would part from PyTorch's without a word."""
    found = [name or "<root>" for name, module in model.named_modules()
             if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.max_norm is not None]
    if found:
        raise TieredError(f"{', '.join(found)}: an embedding with max_norm renormalizes its "
                          f"weight in place during forward, which tiered cannot carry into the "
                          f"master weights; drop max_norm, or renormalize the looked-up rows out "
                          f"of place in forward")


def _refuse_non_floating(specs: list[UnitSpec]) -> None:
    """A parameter becomes part of a flat buffer in the compute dtype: an integer or bool one
    (frozen: only floating tensors take gradients) would come back as floats, failing far from
    here (an index table) or rounding silently (bf16 holds integers exactly only to 256)."""
    wrong = [f"{param.names[0]} ({param.dtype})" for spec in specs for param in spec.params
             if not param.dtype.is_floating_point]
    if wrong:
        raise TieredError(f"tiered keeps parameters as floating-point shards in the compute "
                          f"dtype; these are not floating point: {', '.join(wrong)}. Register "
                          f"them as buffers (module.register_buffer), which stay as they are")


def memory_plan(policy: Policy, device: torch.device, flats: list[FlatParam],
                dram_available: int | None = None, building: int | None = None,
                lands_every_gradient: bool = False,
                on_device: frozenset[int] = frozenset()) -> MemoryPlan:
    """What ``policy`` places in each tier for these units, before anything is allocated
    (with ``dram.spill: nvme``, given the DRAM available); ``building``: see
    plan.hbm_working_set; ``lands_every_gradient``: plan.staging_buffers; ``on_device``: the
    units ``tier: auto`` keeps in HBM (planner.py)."""
    # Units gathered through the whole forward are gathered as long as the root is.
    paths = ["" if f.spec.whole_forward else f.spec.path for f in flats]
    kinds = [unit_state_kinds(policy, f.has_trainable, [p.dtype for p in f.spec.params],
                              f.record is not None) for f in flats]
    # What a gather holds, in the compute dtype's elements: a record's bytes too (FlatParam.
    # gathered_bytes, which the HBM tier is charged while the unit is gathered).
    gathered = [-(-f.gathered_bytes // policy.compute_dtype.torch_dtype.itemsize) for f in flats]
    return build_plan(policy, device, [f.shard_numel for f in flats], gathered, paths,
                      flats[0].world_size,
                      dram_available=dram_available, unit_kinds=kinds,
                      groups=module_groups([f.spec for f in flats]), building=building,
                      lands_every_gradient=lands_every_gradient, on_device=on_device,
                      records={f.spec.index: f.record.shard_bytes for f in flats
                               if f.record is not None})


def forward_order(flats: list[FlatParam]) -> list[int]:
    """The trained units in the order the forward first needs them: those gathered through
    the whole forward (the root's) first, then as the module tree lists them."""
    trained = [flat for flat in flats if flat.has_trainable]
    whole = [flat.spec.path == "" or flat.spec.whole_forward for flat in trained]
    return ([flat.spec.index for flat, first in zip(trained, whole) if first]
            + [flat.spec.index for flat, first in zip(trained, whole) if not first])


def bend_to_fit(policy: Policy, plan_for, manager: TierManager) -> tuple[Policy, MemoryPlan]:
    """The policy to run and its plan: ``policy``'s own when it fits the budgets, else the
    lean one (see [Note: the working set bends]) when that fits, said in a warning; when
    neither does, a BudgetError with the lean plan's numbers: the least the model needs.
    ``plan_for(policy)`` makes a policy's plan.

    [Note: the working set bends]
    Some of what a plan holds is only for speed: gradients on their way off the device
    (``grads.landing_slots``, 4, each a unit's gradient on the device and a pinned landing
    buffer), units gathered ahead of need (``prefetch``: twice the largest module on the
    device) and NVMe weights read ahead into pinned buffers. Under a budget too tight for them
    the engine keeps one landing slot and no prefetch or read-ahead, the least with which it
    trains, slower, rather than refusing a model that fits without them."""
    plan = plan_for(policy)
    try:
        manager.check(plan)
        return policy, plan
    except BudgetError as full:
        lean = policy.replace(grads={"landing_slots": 1}, prefetch={"enabled": False})
        if lean == policy:
            raise
        lean_plan = plan_for(lean)
        manager.check(lean_plan)
        warnings.warn(f"tiered: the budgets hold this model only without what is for speed: "
                      f"1 gradient landing slot instead of {policy.grads.landing_slots}, no "
                      f"prefetch or read-ahead (it trains, slower); the full plan was refused: "
                      f"{full}", stacklevel=4)
        return lean, lean_plan


def built_together(flats: list[FlatParam]) -> list[list[FlatParam]]:
    """The units in order, those of one module (the halves of a split one) in one list."""
    return by_module(flats, module_groups([f.spec for f in flats]))


@torch.no_grad()
def place_buffers(model: nn.Module, compute_dtype: torch.dtype, group: ProcessGroup) -> None:
    """Move the buffers to the compute device, with rank 0's values on every rank, as its
    parameters have (:func:`partition`) and as DDP and FSDP's ``sync_module_states`` give:
    buffers each rank built from its own random state (a fixed random projection, under
    ``tiered.init`` too) would make the ranks train different models. BatchNorm's running
    stats take the compute dtype (its kernel wants them in its weights' dtype, as after
    ``model.to(dtype)``); other buffers keep theirs."""
    for module in model.modules():
        norm = isinstance(module, nn.modules.batchnorm._NormBase)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                dtype = compute_dtype if norm and buffer.is_floating_point() else None
                module._buffers[name] = buffer.to(group.device, dtype)
    if group.world_size == 1:
        return
    for buffer in model.buffers():  # a buffer shared by several modules once
        if buffer.is_contiguous():
            group.broadcast(buffer)
        else:
            contiguous = buffer.contiguous()
            group.broadcast(contiguous)
            buffer.copy_(contiguous)


def building_bytes(built: list[FlatParam], materializer: Materializer,
                   copied: list[FlatParam] | None = None) -> int:
    """Device bytes while building these units (one module's): the parameters tiered.init
    materializes for them on the device (through a tied parameter, other modules' too), and
    one fp32 flat copy at a time, until the last shard is stored and the parameters dropped.
    The first build bounds the later ones: those find some parameters materialized already.
    ``copied``: the units an fp32 flat copy is made of, where not ``built`` alone (a quantized
    unit read whole from pretrained weights is copied to be quantized)."""
    copied = built if copied is None else copied
    if not copied:
        return 0
    return (max(f.padded_numel for f in copied) * 4
            + materializer.device_bytes([f.spec for f in built]))


@torch.no_grad()
def partition(flats: list[FlatParam], materializer: Materializer, manager: TierManager,
              group: ProcessGroup, weights: PretrainedWeights | None) -> None:
    """Build the units of one module (two halves when split), each an fp32 flat copy of which
    this rank's shard is kept in the tiers; then drop the module's parameters.

    Rank 0's values are broadcast, so every rank starts from the same model (as DDP does) even
    when ranks built or initialized it with different random states. A unit ``weights`` build
    alone (PretrainedWeights.reads_whole) is neither materialized nor broadcast: each rank
    reads its own shard from them. In any other unit they overwrite what initialization gave.
    A unit that keeps a quantized record keeps this rank's shard of it (:func:`record_shard`).
    """
    built = [flat for flat in flats if weights is None or not weights.reads_whole(flat)]
    specs = [flat.spec for flat in built]
    building = building_bytes(built, materializer, copied=[
        flat for flat in flats if flat in built or flat.record is not None])
    manager.hbm.usage.acquire(building, f"building unit {flats[-1].name}")
    materializer.materialize(specs)
    for flat in flats:
        if flat.record is not None:
            manager.store(flat.spec.index, StateKind.PARAM,
                          record_shard(flat, flat in built, materializer, group, weights))
            continue
        if flat in built:
            full = torch.empty(flat.padded_numel, dtype=torch.float32, device=group.device)
            flat.flatten(materializer.values(flat.spec), full)
            group.broadcast(full)
            shard = flat.own_shard(full)
            del full
        else:
            shard = pretrained.shard_buffer(flat)  # every parameter's elements are read
        if weights is not None:
            weights.fill(flat, shard)
        manager.store_weights(flat.spec.index, shard)
        del shard
    drop_parameters(flats)
    manager.hbm.usage.release(building)


def record_shard(flat: FlatParam, built: bool, materializer: Materializer,
                 group: ProcessGroup, weights: PretrainedWeights | None) -> torch.Tensor:
    """This rank's shard of a quantized unit's record (see [Note: quantized frozen weights] in
    tiers/quantized.py), quantized by rank 0 from its fp32 flat copy of the whole unit: as
    initialized (``built``) and then, with ``weights``, their values read over it. A record
    is quantized from whole weights, never from a rank's shard, so rank 0 reads the unit whole
    and the others receive its bytes; a checkpoint in the compute dtype (or any float dtype)
    is thus quantized unit by unit as it streams in, nothing larger than a unit held."""
    def read(full: torch.Tensor) -> None:
        if built:
            flat.flatten(materializer.values(flat.spec), full)
        if weights is not None:
            weights.fill(flat, full, (0, flat.numel))

    return pretrained.quantized_shard(flat, group, read)


def drop_parameters(flats: list[FlatParam]) -> None:
    """The units' parameters leave their modules, whose states the tiers hold now (built, or
    taken over from a service's kept state: engine/reattach.py)."""
    for flat in flats:
        for param in flat.spec.params:
            for module, attr in param.holders:
                module._parameters.pop(attr, None)
        flat.bind_placeholders()  # what a module holds while its unit is released


def restore_parameters(flats: list[FlatParam], values: dict[str, torch.Tensor]) -> None:
    """The inverse of drop_parameters: each parameter back in its modules as an ordinary
    ``nn.Parameter`` holding ``values[name]`` in the dtype the model gave it (one parameter for
    all the holders of a tied one), in place of its placeholder."""
    for flat in flats:
        for spec in flat.spec.params:
            param = nn.Parameter(values[spec.names[0]].to(spec.dtype),
                                 requires_grad=spec.trainable)
            for module, attr in spec.holders:
                module.__dict__.pop(attr, None)
                module.register_parameter(attr, param)
