"""The engine's side of frozen units kept quantized (``params.frozen_dtype`` int8 or nf4; see
[Note: quantized frozen weights] in tiers/quantized.py): which units and weights are quantized,
the record gathered and dequantized on the device (the record each rank keeps is quantized by
build.record_shard and checkpoint/pretrained.quantized_shard).
"""
from __future__ import annotations

import torch
from torch import nn

from ..ops.tiled_linear import LinearTile
from ..placement.manager import TierManager
from ..placement.plan import StateKind
from ..placement.units import ParamSpec
from ..policy.config import Policy
from ..policy.kinds import FrozenDtype
from ..tiers.quantized import FORMATS, QuantizedUnit
from .collectives import ProcessGroup, kept_after_failure
from .flat import FlatParam


def is_linear_weight(param: ParamSpec) -> bool:
    """Whether ``param`` is a linear layer's weight and only that (QLoRA quantizes those): a
    weight tied to an embedding is looked up, not multiplied, and stays as it is. A tile of a
    layer that tiling split is one too, quantized as a weight of its own: under int8 (a scale
    per row) that is the layer's quantization of the tile's rows where the tile has whole rows
    (tile_shape splits columns only when a row alone is over the limit); nf4 centres the tile's
    block scales on their own mean, and leaves a tile its blocks do not divide (a ragged last
    one) in the compute dtype, as it does a whole layer."""
    return len(param.shape) == 2 and all(isinstance(module, (nn.Linear, LinearTile))
                                         and attr == "weight" for module, attr in param.holders)


def with_records(flats: list[FlatParam], policy: Policy) -> list[FlatParam]:
    """``flats``, each unit of frozen parameters only with linear weights the format takes
    given the layout of its record (``FlatParam.record``); under ``frozen_dtype: compute``,
    none."""
    if policy.params.frozen_dtype is FrozenDtype.COMPUTE:
        return flats
    fmt = FORMATS[policy.params.frozen_dtype.value]
    for flat in flats:
        if flat.has_trainable:
            continue
        quantize = [is_linear_weight(param) and fmt.takes(param.shape)
                    for param in flat.spec.params]
        if any(quantize):
            flat.record = QuantizedUnit(fmt, [param.shape for param in flat.spec.params],
                                        quantize, policy.compute_dtype.torch_dtype,
                                        flat.world_size)
    return flats


def record(flat: FlatParam) -> QuantizedUnit:
    """The unit's record layout, where the caller knows it keeps one."""
    assert flat.record is not None, f"unit {flat.name} keeps no quantized record"
    return flat.record


def gather_record(flat: FlatParam, full: torch.Tensor, shard: torch.Tensor,
                  group: ProcessGroup) -> None:
    """Fill the unit's gathered buffer ``full`` from this rank's shard of its record (wherever
    it lives): the record's bytes all-gathered on the device, then dequantized there."""
    layout = record(flat)
    whole = torch.empty(layout.nbytes, dtype=torch.uint8, device=full.device)
    mine = layout.shard(whole, flat.rank)
    mine.copy_(shard, non_blocking=True)
    try:
        group.all_gather(whole, mine)
    except BaseException:
        kept_after_failure(whole.untyped_storage())  # the collective may still write into it
        raise
    layout.dequantize(whole, full)


def consolidated(flat: FlatParam, manager: TierManager, group: ProcessGroup) -> torch.Tensor:
    """The unit's whole flat weights in fp32 on the device (a collective: every rank calls
    it): its masters (a frozen unit's weights, where it keeps none) gathered from every rank,
    or its record gathered and dequantized, which is what its frozen weights are now."""
    index = flat.spec.index
    if flat.record is None:
        full = torch.empty(flat.padded_numel, dtype=torch.float32, device=group.device)
        mine = flat.own_shard(full)
        manager.copy_out(index, manager.weights_kind(index), mine)
        group.all_gather(full, mine)
        return full
    shard = torch.empty(flat.record.shard_bytes, dtype=torch.uint8, device=group.device)
    manager.copy_out(index, StateKind.PARAM, shard)
    full = torch.empty(flat.padded_numel, dtype=flat.record.dtype, device=group.device)
    gather_record(flat, full, shard, group)
    return full.float()


def consolidated_bytes(flat: FlatParam) -> int:
    """Device bytes :func:`consolidated` holds at most for the unit: the fp32 flat copy, and
    for a record also its shard, its gathered bytes and the flat copy it is dequantized into."""
    fp32 = flat.padded_numel * 4
    if flat.record is None:
        return fp32
    return fp32 + flat.record.shard_bytes + flat.gathered_bytes
