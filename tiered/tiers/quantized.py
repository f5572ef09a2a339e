"""A frozen unit's weights kept quantized: one record of bytes per unit, what every tier holds.

[Note: quantized frozen weights]
With ``params.frozen_dtype`` int8 or nf4, a unit whose parameters are all frozen and among which
are linear layers' weights keeps its weights as one record of bytes. Each frozen weight of an
``nn.Linear`` is quantized whole, by torchao: nf4 is QLoRA's NormalFloat4 (``to_nf4``: blocks of
64 with an absmax scale each, the scales double-quantized to int8 per 256 blocks around their
mean), int8 is torchao's weight-only int8 (``Int8Tensor.from_hp`` with ``PerRow``, as
``Int8WeightOnlyConfig`` quantizes: symmetric, an fp32 scale per output row). The unit's other
parameters (biases, norms, embeddings, a weight tied to one, a weight whose size nf4's blocks do
not divide) stay in the compute dtype, as QLoRA leaves them. The record lays each parameter's
tensors end to end, each starting on 16 bytes (so that a slice of the bytes views as its dtype).

The record is cut into the ranks' shards as a flat buffer's elements are, by bytes: evenly, rank
r keeping bytes [r*S, (r+1)*S). That shard is what its tier holds (HBM, DRAM, NVMe) and what
moves between them; a gather all-gathers the record's bytes on the device and dequantizes the
whole unit there, parameter by parameter with torchao's own dequantization, into the unit's flat
buffer in the compute dtype, which is released after use as any gathered unit's.

Why the bytes, not the elements, are sharded: nf4's double quantization subtracts the mean of
all of a tensor's block scales, so a quantization per rank's shard would give other values than
the whole tensor's, other ones at each world size, and a cut on block boundaries would still cut
that mean apart. Quantized whole, a weight has the values QLoRA and torchao give it whatever the
ranks; dequantized after the all-gather, no rank needs to know where its bytes fall. The cost:
every rank dequantizes the whole unit (elementwise work on the device, a unit's worth), and the
all-gather moves the quantized bytes, 2 to 4 times fewer than the compute dtype's.

While a unit is gathered the device holds its flat buffer, the record's gathered bytes and
what dequantizing makes on the way (``FlatParam.gathered_bytes``, which the HBM tier is charged
and the plan's working set counts). torchao's dequantization makes temporaries of its own:
measured (a dispatch mode counting every storage it makes, tests/engine/test_quantized.py),
nf4 makes 8 + 3 x the compute dtype's size bytes an element (int64 code indices among them),
int8 5 + that size (an fp32 product), its output included; for a whole 70 B MLP weight
(8192 x 28672 in bf16) that was 3.3 GB. So a weight is dequantized in chunks of at most
``DEQUANTIZE_CHUNK`` elements, each into its place of the flat buffer: nf4 by whole groups of
64 x 256 blocks (each chunk has its own scales and their factors, the mean and the code book
being the tensor's), int8 by whole rows (at least one: a row of more columns is a chunk), each
element computed as the whole tensor's dequantization computes it, so the values are torchao's
to the bit (tested against its whole-tensor dequantization). The temporaries are then bounded
by a chunk's: ``QuantizedUnit.scratch_bytes``, per unit its largest weight's, at most about
(8 + 3 x size) x 2^20 bytes for nf4 (14 MiB in bf16) and (5 + size) x max(2^20, columns) for
int8, with a few bytes a block or a row for their scales (``Format.scratch_bytes``).

At initialize rank 0 quantizes each unit whole from its fp32 flat copy, which holds the
model's initialized values or pretrained weights read over them (``initialize(weights=...)``,
Hugging Face's ``load_model``: engine/build.record_shard), and the other ranks receive its
bytes: a checkpoint in the compute dtype is quantized unit by unit as it streams in, nothing
larger than a unit held at once. ``load_state_dict`` and ``load_pretrained`` quantize alike,
a unit whole or not at all (checkpoint/pretrained.py).

Quantizing is lossy by choice: the frozen weights the model computes with, and the ones
``full_state_dict`` and exports give back, are the dequantized ones. A checkpoint keeps each
rank's shard of the record as its bytes, and a load at any world size stores them as they were,
never quantized again ([Note: records in checkpoints] in checkpoint/records.py).

torchao is imported on the first quantization or dequantization only (``_torchao``): it takes
about 2 s to import (torch's compiler with it), which no run that keeps its weights in the
compute dtype should pay.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Sequence

import torch

from ..core.errors import TieredError
from ..core.sizes import align_up

ALIGN = 16
"""Bytes each tensor of a record starts on: any dtype's slice views in place."""

NF4_BLOCK, NF4_SCALER_BLOCK = 64, 256
"""QLoRA's block sizes (torchao's ``to_nf4`` defaults): elements per absmax scale, and scales
per double-quantization scale."""
NF4_GROUP = NF4_BLOCK * NF4_SCALER_BLOCK
"""Elements of a group of blocks whose scales share one double-quantization factor."""

DEQUANTIZE_CHUNK = 1 << 20
"""Elements of a weight dequantized at once (a whole number of nf4's groups): see [Note:
quantized frozen weights]."""
_PAGE = 4096
"""Bytes a chunk's scalar temporaries (nf4's mean, the code book) fit in."""


@dataclass(frozen=True)
class Piece:
    """One tensor of a record: where it lies, in bytes, and what it is."""

    name: str
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def view(self, record: torch.Tensor) -> torch.Tensor:
        """This tensor, a view of the record's bytes."""
        return record[self.offset:self.offset + self.nbytes].view(self.dtype).view(self.shape)


class Format:
    """A quantized format: which weights it takes, its tensors, and torchao's two directions."""

    name: str

    def takes(self, shape: torch.Size) -> bool:
        raise NotImplementedError

    def tensors(self, shape: torch.Size, dtype: torch.dtype) -> list[tuple[str, tuple, torch.dtype]]:
        """(name, shape, dtype) of each tensor a weight of ``shape`` in ``dtype`` is kept as."""
        raise NotImplementedError

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def dequantize(self, parts: dict[str, torch.Tensor], shape: torch.Size,
                   dtype: torch.dtype) -> torch.Tensor:
        """The whole weight ``parts`` hold (or a chunk of it, of ``shape``), by torchao."""
        raise NotImplementedError

    def chunks(self, parts: dict[str, torch.Tensor], shape: torch.Size):
        """(first element, the chunk's parts, its shape) of each chunk of the weight that is
        dequantized alone, in order, each of at most :meth:`chunk_numel` elements."""
        raise NotImplementedError

    def scratch_bytes(self, shape: torch.Size, dtype: torch.dtype) -> int:
        """Device bytes torchao's dequantization of a weight of ``shape`` holds at most, a
        chunk at a time, its output too (measured: [Note: quantized frozen weights])."""
        raise NotImplementedError


class Nf4(Format):
    name = "nf4"

    def takes(self, shape: torch.Size) -> bool:
        # to_nf4 needs whole blocks and whole groups of block scales.
        return len(shape) == 2 and shape.numel() % (NF4_BLOCK * NF4_SCALER_BLOCK) == 0

    def tensors(self, shape, dtype):
        n = shape.numel()
        return [("quantized_data", (n // 2,), torch.uint8),
                ("quantized_scalers", (n // NF4_BLOCK,), torch.int8),
                ("quantization_factor", (n // NF4_BLOCK // NF4_SCALER_BLOCK,), dtype),
                ("scaler_mean", (), dtype),
                ("nf4", (16,), dtype)]  # the code book, in the weight's dtype

    def quantize(self, weight):
        quantized = _torchao().to_nf4(weight, NF4_BLOCK, NF4_SCALER_BLOCK)
        return {name: getattr(quantized, name) for name, _, _ in self.tensors(weight.shape,
                                                                             weight.dtype)}

    def dequantize(self, parts, shape, dtype):
        ao = _torchao()
        meta = ao.SubclassTensorArgs(shape, (shape[1], 1), 0, dtype, parts["nf4"].device, False)
        return ao.NF4Tensor.__tensor_unflatten__(
            parts, {"tensor_meta": meta, "block_size": NF4_BLOCK,
                    "n_blocks": shape.numel() // NF4_BLOCK,
                    "scaler_block_size": NF4_SCALER_BLOCK}, shape, (shape[1], 1)
        ).get_original_weight()

    def chunks(self, parts, shape):
        n = shape.numel()
        for first in range(0, n, DEQUANTIZE_CHUNK):  # whole groups: the chunk and n are
            stop = min(n, first + DEQUANTIZE_CHUNK)
            yield first, {
                "quantized_data": parts["quantized_data"][first // 2:stop // 2],
                "quantized_scalers": parts["quantized_scalers"][first // NF4_BLOCK:
                                                                stop // NF4_BLOCK],
                "quantization_factor": parts["quantization_factor"][first // NF4_GROUP:
                                                                    stop // NF4_GROUP],
                "scaler_mean": parts["scaler_mean"], "nf4": parts["nf4"],
            }, torch.Size(((stop - first) // NF4_BLOCK, NF4_BLOCK))

    def scratch_bytes(self, shape, dtype):
        # An element: two int64 code indices a byte (8), the codes looked up, scaled and
        # interleaved (3 in the dtype); a block: its scale dequantized (an fp32 quotient, the
        # dtype's value and the mean added); the chunk's few scalars within the page.
        numel = min(shape.numel(), DEQUANTIZE_CHUNK)
        return (numel * (8 + 3 * dtype.itemsize) + numel // NF4_BLOCK * (4 + 2 * dtype.itemsize)
                + _PAGE)


class Int8(Format):
    name = "int8"

    def takes(self, shape: torch.Size) -> bool:
        return len(shape) == 2

    def tensors(self, shape, dtype):
        rows = shape[0]
        return [("qdata", tuple(shape), torch.int8), ("scale", (rows, 1), torch.float32),
                ("zero_point", (rows, 1), torch.int8)]

    def quantize(self, weight):
        ao = _torchao()
        quantized = ao.Int8Tensor.from_hp(weight, ao.PerRow())
        return {"qdata": quantized.qdata, "scale": quantized.scale,
                "zero_point": quantized.zero_point}

    def dequantize(self, parts, shape, dtype):
        return _torchao().Int8Tensor(parts["qdata"], parts["scale"], [1, shape[1]], dtype,
                                     zero_point=parts["zero_point"]).dequantize()

    def chunks(self, parts, shape):
        rows, columns = shape
        step = self._rows(shape)
        for first in range(0, rows, step):
            stop = min(rows, first + step)
            yield first * columns, {name: parts[name][first:stop]
                                    for name in ("qdata", "scale", "zero_point")}, \
                torch.Size((stop - first, columns))

    @staticmethod
    def _rows(shape: torch.Size) -> int:
        return min(shape[0], max(1, DEQUANTIZE_CHUNK // shape[1]))

    def scratch_bytes(self, shape, dtype):
        # An element: the codes in the dtype less the zero point, their product with the
        # fp32 scale (fp32 whatever the dtype), cast back; a row: its scale and zero point
        # converted (4 + 2 in the dtype at most).
        rows = self._rows(shape)
        return rows * shape[1] * (5 + dtype.itemsize) + rows * (4 + 2 * dtype.itemsize) + _PAGE


FORMATS: dict[str, Format] = {"nf4": Nf4(), "int8": Int8()}
"""By ``params.frozen_dtype``'s value."""


@dataclass(frozen=True)
class Entry:
    """One parameter of a unit in its record: its elements in the unit's flat buffer, and its
    tensors in the record (one, in the compute dtype, where it is not quantized)."""

    start: int
    """Its first element in the unit's flat buffer."""
    shape: torch.Size
    quantized: bool
    pieces: tuple[Piece, ...]


class QuantizedUnit:
    """The layout of one unit's record, and its two directions: the compute-dtype flat buffer
    to the record (at initialize) and back (at each gather).

    ``shapes``: each parameter's shape in the unit's flat order; ``quantize``: whether each is
    a weight to quantize (the format must take its shape)."""

    def __init__(self, fmt: Format, shapes: Sequence[torch.Size], quantize: Sequence[bool],
                 dtype: torch.dtype, world_size: int):
        self.format = fmt
        self.dtype = dtype
        entries, offset, start = [], 0, 0
        for shape, wanted in zip(shapes, quantize):
            tensors = (fmt.tensors(shape, dtype) if wanted
                       else [("value", tuple(shape), dtype)])
            pieces = []
            for name, piece_shape, piece_dtype in tensors:
                piece = Piece(name, offset, piece_shape, piece_dtype)
                pieces.append(piece)
                offset = align_up(offset + piece.nbytes, ALIGN)
            entries.append(Entry(start, shape, wanted, tuple(pieces)))
            start += shape.numel()
        self.entries = tuple(entries)
        self.numel = start
        self.scratch_bytes = max((fmt.scratch_bytes(entry.shape, dtype)
                                  for entry in entries if entry.quantized), default=0)
        """Device bytes dequantizing holds at most beside the record and the flat buffer: its
        largest weight's largest chunk's temporaries."""
        self.data_bytes = offset
        """The record's bytes before the padding: the same at any world size (a checkpoint's
        record loads under another one by these bytes: checkpoint/records.py)."""
        self.nbytes = align_up(max(offset, 1), world_size)
        """The record's bytes, padded to a whole number of ranks' shards."""
        self.shard_bytes = self.nbytes // world_size

    def shard(self, record: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s shard of the whole ``record``'s bytes (a view)."""
        return record[rank * self.shard_bytes:(rank + 1) * self.shard_bytes]

    def quantize(self, flat: torch.Tensor, record: torch.Tensor) -> None:
        """Write the record of the unit whose weights are the flat buffer ``flat`` (any float
        dtype: each parameter is taken in the compute dtype first) into ``record`` (bytes)."""
        record.zero_()  # the gaps between pieces and the padding: defined bytes on every rank
        for entry in self.entries:
            value = flat[entry.start:entry.start + entry.shape.numel()].view(entry.shape)
            value = value.to(self.dtype)
            parts = self.format.quantize(value) if entry.quantized else {"value": value}
            for piece in entry.pieces:
                piece.view(record).copy_(parts[piece.name])

    def dequantize(self, record: torch.Tensor, flat: torch.Tensor) -> None:
        """Fill the unit's flat buffer ``flat`` (the compute dtype, padded) from its whole
        ``record``, on the record's device; the padding is zeros."""
        for entry in self.entries:
            parts = {piece.name: piece.view(record) for piece in entry.pieces}
            if not entry.quantized:
                flat[entry.start:entry.start + entry.shape.numel()].copy_(
                    parts["value"].reshape(-1))
                continue
            for first, chunk, shape in self.format.chunks(parts, entry.shape):
                value = self.format.dequantize(chunk, shape, self.dtype)
                at = entry.start + first
                flat[at:at + shape.numel()].copy_(value.reshape(-1))
        flat[self.numel:].zero_()


@contextlib.contextmanager
def torchao_logs_held_back():
    """While torchao is imported, here or by transformers (whose quantizers import it wherever
    it is installed): its warning for each CUDA-only kernel file a CPU build lacks, and torch's
    about an enum it registers, say nothing about what tiered uses (plain torch ops), and would
    be the first lines of every run's log."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


@functools.cache
def _torchao() -> SimpleNamespace:
    """The few torchao names this module uses, imported on first use."""
    # Inside a function: torchao is optional (tiered[quantized]) and slow to import.
    try:
        with torchao_logs_held_back():
            from torchao.quantization import Int8Tensor, NF4Tensor, PerRow, to_nf4
            from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import (
                SubclassTensorArgs)
    except ImportError as error:
        raise TieredError(f"params.frozen_dtype int8 and nf4 quantize with torchao, which is "
                          f"not installed ({error}): pip install 'tiered[quantized]'") from None
    return SimpleNamespace(Int8Tensor=Int8Tensor, NF4Tensor=NF4Tensor, PerRow=PerRow,
                           to_nf4=to_nf4, SubclassTensorArgs=SubclassTensorArgs)
