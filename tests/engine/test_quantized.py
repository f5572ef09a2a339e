"""Frozen weights kept quantized (``params.frozen_dtype`` int8 | nf4; [Note: quantized frozen
weights] in tiers/quantized.py). The reference is outside the product: a plain PyTorch LoRA
GPT whose frozen linear weights are torchao's own quantized and dequantized values (nf4:
``to_nf4(w).get_original_weight()``, QLoRA's format; int8: what ``Int8WeightOnlyConfig``
quantizes, dequantized), trained by ``torch.optim.AdamW`` on its adapters. The engine is given
the model with its original weights and quantizes them itself.

The GPT is helpers_quantized.qlora_model: the parity GPT at width 128."""
from __future__ import annotations

import functools
import os
import weakref

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torchao.quantization import Int8Tensor, PerRow, to_nf4

import tiered
from tiered.core.sizes import align_up
from tiered.device import DEVICE_ENV, simulated_device
from tiered.ops.tiled_linear import LinearTile, tile_large_linears
from tiered.placement.plan import StateKind
from tiered.tiers.quantized import DEQUANTIZE_CHUNK, QuantizedUnit
from tiered.tiers.quantized import FORMATS as FORMATS_BY_NAME

from distributed import run_ranks
from helpers import REPO
from gpt import GPT
from helpers_models import (OPTIM, SEQ, VOCAB, assert_parity, batches, model_loss, run_engine,
                           train_torch)
from helpers_quantized import FORMATS, qlora_engine, qlora_model, torchao_roundtrip
from helpers_tiers import dram_bytes

LINEARS = ("qkv", "proj", "fc", "out")


def reference_model(fmt: str) -> nn.Module:
    model = qlora_model()
    with torch.no_grad():
        for block in model.blocks:
            for name in LINEARS:
                layer = getattr(block, name)
                layer.weight.copy_(torchao_roundtrip(layer.weight.detach(), fmt))
    return model


def recording(losses: list[float]):
    def loss(model, idx):
        value = model_loss(model, idx)
        losses.append(value.item())
        return value
    return loss


@functools.cache
def reference(fmt: str) -> tuple[dict, list[float]]:
    """The reference's state after the parity run's steps, and its losses."""
    model, losses = reference_model(fmt), []
    state = train_torch(model, torch.optim.AdamW(model.parameters(), fused=True, **OPTIM),
                        loss=recording(losses))
    return state, losses


def trained(fmt: str, policy: str, nvme: str, rank: int = 0, world: int = 1,
            weights: str = "built"):
    """``weights``: qlora_model's own ("built"), read at initialize ("initialize": the model
    given zeros, qlora_engine's ``pretrained``), or loaded by ``load_state_dict`` before any
    step into an engine built from other weights ("loaded")."""
    engine, optimizer = qlora_engine(fmt, policy, nvme, pretrained=weights == "initialize",
                                     seed=7 if weights == "loaded" else 0)
    losses: list[float] = []
    try:
        if weights == "loaded":
            engine.load_state_dict(qlora_model().state_dict())
        quantized = [flat.name for flat in engine.runtime.flats if flat.record is not None]
        state = run_engine(engine, optimizer, rank=rank, world=world, loss=recording(losses))
    finally:
        engine.close()
    assert quantized == ["blocks.0 (frozen)", "blocks.1 (frozen)"]
    return state, losses


@pytest.mark.parametrize("fmt", FORMATS)
def test_in_bf16_the_forward_computes_with_torchaos_bf16_weights(fmt, tmp_path):
    # QLoRA's usual case: the weights quantized from their bf16 values, dequantized to bf16;
    # the bias beside them is the bf16 one.
    engine = tiered.initialize(qlora_model(), os.path.join(REPO, "configs", "cpu.yaml"),
                               compute_dtype="bf16", device="cpu", optimizer=OPTIM,
                               params={"frozen_dtype": fmt})[0]
    seen = {}
    layer = engine.module.blocks[1].fc
    layer.register_forward_hook(lambda module, args, out: seen.update(
        weight=module.weight.clone(), bias=module.bias.clone()))
    try:
        engine(batches()[0][0])
    finally:
        engine.close()
    initial = qlora_model().blocks[1].fc
    expected = torchao_roundtrip(initial.weight.detach().bfloat16(), fmt)
    assert seen["weight"].dtype is torch.bfloat16 and torch.equal(seen["weight"], expected)
    assert torch.equal(seen["bias"], initial.bias.detach().bfloat16())


@pytest.mark.parametrize("policy", ["cpu", "nvme"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_quantized_base_trains_as_torch_over_torchaos_weights(fmt, policy, tmp_path):
    # The same operations in the same order as the reference: bit for bit, the losses, the
    # adapters, and the frozen weights given back (the dequantized ones).
    state, losses = trained(fmt, policy, str(tmp_path))
    expected, expected_losses = reference(fmt)
    assert losses == expected_losses
    original = qlora_model().state_dict()
    for name in expected:
        assert torch.equal(state[name], expected[name]), name
    for block in range(2):  # quantized: what the model computes with is not the original
        for name in LINEARS:
            key = f"blocks.{block}.{name}.weight"
            assert not torch.equal(state[key], original[key]), key
    assert not torch.equal(state["blocks.0.fc.lora_a"], original["blocks.0.fc.lora_a"])


TILE_BYTES = 129 * 128 * 4
"""A unit of 128 rows of 128 fp32 weights with their biases: tiling splits the width-128 GPT's
qkv and fc into 128 x 128 tiles and out into 32 x 512 ones, each one of nf4's whole groups of
blocks (16,384 weights); proj (128 x 128 with its bias) fits whole."""


def frozen_tiled_model(fmt: str | None = None) -> nn.Module:
    """The width-128 GPT (no adapters) whose blocks' linear layers are frozen, the rest
    trained; ``fmt``: tiled as TILE_BYTES tiles it, each frozen weight (a tile's, or a whole
    layer's) replaced by torchao's round trip of it."""
    torch.manual_seed(0)
    model = GPT(VOCAB, 128, 2, 2, max_seq=SEQ, tied=True, qkv_bias=False)
    for block in model.blocks:
        for name in LINEARS:
            getattr(block, name).requires_grad_(False)
    if fmt is not None:
        tile_large_linears(model, TILE_BYTES, 4)
        with torch.no_grad():
            for module in model.blocks.modules():
                if isinstance(module, (nn.Linear, LinearTile)):
                    module.weight.copy_(torchao_roundtrip(module.weight, fmt))
    return model


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_tile_of_a_layer_tiling_split_is_quantized_as_a_weight_of_its_own(fmt):
    # The reference computes with the same tiles (whose products round as nn.Linear's to
    # DESIGN's tolerance: tests/ops/test_tiled_linear.py), each tile's weight torchao's round
    # trip of it. Tiles are rows of the layer's full width, so under int8 (scales per row) a
    # tile's bits are the whole layer's too; nf4 centres a weight's block scales on their
    # mean before it quantizes them, a tile's own.
    engine, optimizer = tiered.initialize(
        frozen_tiled_model(), os.path.join(REPO, "configs", "cpu.yaml"), compute_dtype="fp32",
        device="cpu", params={"frozen_dtype": fmt}, tiling={"max_unit_bytes": TILE_BYTES},
        optimizer=OPTIM)
    losses: list[float] = []
    try:
        quantized = [flat.name for flat in engine.runtime.flats if flat.record is not None]
        state = run_engine(engine, optimizer, loss=recording(losses))
    finally:
        engine.close()
    assert quantized == [name for block in range(2) for name in (
        f"blocks.{block} (frozen)", *[f"blocks.{block}.qkv.tiles.{i}" for i in range(3)],
        *[f"blocks.{block}.fc.tiles.{i}" for i in range(4)],
        *[f"blocks.{block}.out.tiles.{i}" for i in range(4)])], quantized
    model, expected_losses = frozen_tiled_model(fmt), []
    expected = train_torch(model, torch.optim.AdamW(model.parameters(), fused=True, **OPTIM),
                           loss=recording(expected_losses))
    assert losses == expected_losses
    for name in expected:
        assert torch.equal(state[name], expected[name]), name
    if fmt == "int8":  # a tile's rows quantized alone are the whole layer's rows quantized
        whole = frozen_tiled_model()
        layer = whole.blocks[0].fc
        assert torch.equal(state["blocks.0.fc.weight"], torchao_roundtrip(layer.weight, fmt))


@pytest.mark.parametrize("weights", ["initialize", "loaded"])
def test_pretrained_weights_are_quantized_as_they_are_read(weights, tmp_path):
    # initialize(weights=) and load_state_dict read each quantized unit whole and quantize
    # it: the run is the reference's, bit for bit, though the model the engine was built from
    # held zeros, or other weights.
    state, losses = trained("nf4", "nvme", str(tmp_path), weights=weights)
    expected, expected_losses = reference("nf4")
    assert losses == expected_losses
    for name in expected:
        assert torch.equal(state[name], expected[name]), name


TWO_RANK_RUNS = (("nf4", "cpu", "built"), ("nf4", "nvme", "built"), ("int8", "cpu", "built"),
                 ("nf4", "cpu", "initialize"), ("nf4", "cpu", "loaded"))
"""nf4 in DRAM and on NVMe, int8 in DRAM: the record's bytes are sharded alike whatever the
format; and nf4 from pretrained weights at initialize and by load_state_dict, which rank 0
reads and quantizes (each rank start costs seconds on CI: one process per rank for all of
them)."""


def test_on_the_simulated_device_every_copy_is_ordered(monkeypatch, tmp_path):
    # The record's shard read ahead from NVMe into a pinned buffer, copied to the device,
    # all-gathered and dequantized on the gather stream, the weights read on the compute
    # stream: a race a GPU would run fails here, naming both sites; the bits stay torchao's.
    monkeypatch.setenv(DEVICE_ENV, "sim")
    with simulated_device().tracking():
        state, losses = trained("nf4", "nvme", str(tmp_path))
    expected, expected_losses = reference("nf4")
    assert losses == expected_losses
    assert all(torch.equal(state[name], expected[name]) for name in expected)


def _two_ranks(rank: int, world: int, folder: str) -> None:
    results = {(fmt, policy, weights): trained(fmt, policy, folder, rank, world, weights)[0]
               for fmt, policy, weights in TWO_RANK_RUNS}
    torch.save(results, os.path.join(folder, f"rank{rank}.pt"))


def test_two_ranks_hold_shards_of_one_record(tmp_path):
    # Each rank keeps its shard of the record's bytes and dequantizes the whole unit: the
    # frozen weights are torchao's to the bit at two ranks too, and DRAM and NVMe train alike
    # to the bit. The adapters are PyTorch's within [Note: ulps AdamW enlarges]: two ranks
    # add two halves of each batch's gradient where PyTorch adds it whole.
    run_ranks(2, _two_ranks, str(tmp_path))
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        in_dram, on_nvme = results[("nf4", "cpu", "built")], results[("nf4", "nvme", "built")]
        read, loaded = results[("nf4", "cpu", "initialize")], results[("nf4", "cpu", "loaded")]
        assert all(torch.equal(in_dram[name], other[name]) for name in in_dram
                   for other in (on_nvme, read, loaded))
        for fmt in FORMATS:
            state, (expected, _) = results[(fmt, "cpu", "built")], reference(fmt)
            assert_parity(state, expected)
            for name in expected:
                if "lora_" not in name:
                    assert torch.equal(state[name], expected[name]), name


def record_bytes(fmt: str, shapes: list[torch.Size], quantized: list[bool], world: int) -> int:
    """A unit's record by the formats' sizes (fp32 compute): nf4 half a byte an element, an
    int8 scale per 64 elements and an fp32 one per 256 of those, the mean and the 16 codes;
    int8 a byte an element, an fp32 scale and an int8 zero point per row; fp32 for the rest.
    Each tensor starts on 16 bytes; the record is a whole number of ranks' shards."""
    total = 0
    for shape, quantize in zip(shapes, quantized):
        n = shape.numel()
        if not quantize:
            sizes = [4 * n]
        elif fmt == "nf4":
            sizes = [n // 2, n // 64, 4 * (n // 64 // 256), 4, 16 * 4]
        else:
            sizes = [n, 4 * shape[0], shape[0]]
        total += sum(align_up(size, 16) for size in sizes)
    return align_up(total, world)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_tiers_hold_the_quantized_bytes(fmt, tmp_path):
    for policy in ("cpu", "nvme"):
        engine, _ = qlora_engine(fmt, policy, str(tmp_path))
        try:
            placement, manager = engine.placement(), engine.manager
            in_dram = 0
            for flat in engine.runtime.flats:
                kinds = [StateKind(kind) for kind in placement[flat.name]]
                if flat.record is None:
                    in_dram += dram_bytes(flat, kinds, torch.float32) if policy == "cpu" else 0
                    continue
                assert kinds == [StateKind.PARAM], flat.name  # no masters: nothing to round
                params = flat.spec.params
                record = record_bytes(fmt, [p.shape for p in params],
                                      [p.names[0].endswith(tuple(f"{name}.weight"
                                                                 for name in LINEARS))
                                       for p in params], 1)
                buffer = manager.current_plan.shards[(flat.spec.index, StateKind.PARAM)]
                assert (buffer.numel, buffer.dtype) == (record, torch.uint8), flat.name
                if policy == "cpu":  # a DRAM block: whole 4 KiB blocks
                    in_dram += align_up(record, 4096)
                else:  # a real O_DIRECT extent of the record's bytes
                    extent = manager.nvme_shard(flat.spec.index, StateKind.PARAM)
                    assert extent.nbytes == align_up(record, 4096), flat.name
            if policy == "cpu":
                assert engine.memory_report()["dram"]["current"] == in_dram
        finally:
            engine.close()


def test_a_load_of_part_of_a_record_is_refused_and_close_gives_back_the_dequantized_base(
        tmp_path):
    # A record is quantized from its whole unit: a load that holds part of one is refused by
    # name and changes nothing (what it lacks would be quantized again from its dequantized
    # values). Closing gives back the base the model computed with, dequantized (for peft's
    # merge_and_unload).
    engine, _ = qlora_engine("nf4", "cpu", str(tmp_path))
    model = engine.module
    weights = qlora_model(seed=7).state_dict()
    del weights["blocks.1.fc.weight"]
    try:
        with pytest.raises(tiered.CheckpointError, match=r"unit blocks.1 \(frozen\) keeps its "
                                                         r"frozen weights quantized.* but not "
                                                         r"blocks.1.fc.weight"):
            engine.load_state_dict(weights, strict=False)
    finally:
        engine.close(restore_weights=True)
    expected = reference_model("nf4").state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name


class StoragePeak(TorchDispatchMode):
    """The most bytes of storages made under it alive at once: every op's outputs' storages
    but its inputs' (a view, an op in place), each counted until it is freed."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {tensor.untyped_storage().data_ptr()
                  for tensor in tree_flatten((args, kwargs))[0] if isinstance(tensor, torch.Tensor)}
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and type(tensor) is torch.Tensor:
                storage = tensor.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.live and key not in inputs:
                    self.live[key] = storage.nbytes()
                    self.now += storage.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(storage, self._freed, key)
        return out

    def _freed(self, key: int) -> None:
        self.now -= self.live.pop(key)


def torchao_whole(weight: torch.Tensor, fmt: str):
    """torchao's quantization of ``weight`` and the function that dequantizes it whole."""
    if fmt == "nf4":
        quantized = to_nf4(weight, 64, 256)
        return quantized.get_original_weight
    return Int8Tensor.from_hp(weight, PerRow()).dequantize


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantized_in_chunks_bit_for_bit_within_the_bound_the_plan_counts(fmt, dtype):
    # 1.5 chunks of nf4's groups, int8's rows: each chunk is dequantized alone into its place
    # of the flat buffer, to the bit as torchao's whole-tensor dequantization (the oracle),
    # the temporaries within scratch_bytes, which torchao's whole dequantization passes.
    shape = torch.Size((DEQUANTIZE_CHUNK * 3 // 2 // 1024, 1024))
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    layout = QuantizedUnit(FORMATS_BY_NAME[fmt], [shape], [True], dtype, world_size=1)
    assert len(list(layout.format.chunks(
        {piece.name: torch.empty(piece.shape, dtype=piece.dtype)
         for piece in layout.entries[0].pieces}, shape))) == 2
    record = torch.empty(layout.nbytes, dtype=torch.uint8)
    layout.quantize(weight, record)
    flat = torch.empty(shape.numel(), dtype=dtype)
    with StoragePeak() as chunked:
        layout.dequantize(record, flat)
    whole = torchao_whole(weight, fmt)
    with StoragePeak() as at_once:
        expected = whole()
    assert torch.equal(flat.view(shape), expected)
    assert chunked.peak <= layout.scratch_bytes < at_once.peak, (chunked.peak, at_once.peak)
