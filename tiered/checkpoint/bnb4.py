"""Weights a bitsandbytes 4-bit export holds, read as the floating-point weights they stand for.

[Note: bitsandbytes exports]
A Hugging Face model loaded with ``BitsAndBytesConfig(load_in_4bit=True)`` and saved keeps each
quantized linear weight ``W`` as bitsandbytes' ``Params4bit`` state: ``W`` (the 4-bit codes,
two a byte, the first element in the high nibble), ``W.absmax`` (a scale per block of
``blocksize`` elements: fp32, or with double quantization uint8 codes into ``W.nested_quant_map``
times ``W.nested_absmax`` per ``nested_blocksize`` scales, plus ``nested_offset``),
``W.quant_map`` (the 16 values of the 4-bit code book), and ``W.quant_state.bitsandbytes__nf4``
(JSON bytes: the shape, dtype, block sizes, offset). bitsandbytes defines the weight as
``quant_map[code] * absmax[block]`` in fp32, rounded to ``dtype``, the scales first dequantized
as ``nested_quant_map[code] * nested_absmax[group] + nested_offset`` in fp32 (its
``dequantize_4bit``; its CPU kernel uses its own NF4 table, the one ``quant_map`` must hold).

:class:`Bnb4Source` presents such a source as one of those weights: ``W`` with its shape and
dtype, each range of elements dequantized as that definition computes it, in plain torch (so
tiered reads an export without bitsandbytes installed), from the ranges of the codes and scales
it covers; the auxiliary tensors are not listed. What reads it is then the ordinary path: with
``frozen_dtype: compute`` the unit holds bitsandbytes' weights exactly; with ``nf4`` torchao
quantizes them again, unit by unit ([Note: quantized frozen weights] in tiers/quantized.py).

That carries over all but one step: an NF4 block dequantized and quantized again by NF4 with
the same block size gets the same codes and the same absmax (the block's largest element was
coded ±1, which the code book holds, so its absolute value is the block's scale; each element
divided by it is its code's value again, the nearest code). Only the scales' double
quantization differs: bitsandbytes codes them with its 256-entry dynamic map per 256 blocks
around their mean, torchao with int8 per 256 blocks around the mean. So the weights differ from
bitsandbytes' by at most torchao's error on a scale: half a step of its int8 grid, a whole step
for the group's largest (clamped to 127), i.e. ``max |scale - mean| / 128`` in the group, times
the code's value (at most 1). A weight nf4 does not take (tiers/quantized.Nf4.takes) stays in
the compute dtype, bitsandbytes' values exactly.

Refused by name rather than read otherwise: fp4 (another code book, whose re-quantization by
NF4 would be a second rounding), blocks other than 64 (torchao's NF4 block, so that the codes
carry over), 8-bit exports (``LLM.int8``'s ``SCB`` per-row scales), and a state whose tensors'
sizes or code book are not what its JSON says.
"""
from __future__ import annotations

import json
import math

import torch

from .format import CheckpointError

STATE = ".quant_state.bitsandbytes__"
"""The infix of the key holding a 4-bit weight's JSON state; the quant type follows it."""
AUXILIARY = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
"""The suffixes of a 4-bit weight's other tensors besides its codes and state."""
INT8_SCALES = ".SCB"
"""The suffix of an 8-bit (``LLM.int8``) weight's row scales."""
BLOCK = 64
"""The only block size read: torchao's NF4 block (tiers/quantized.NF4_BLOCK), so that a block's
codes and scale carry over."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The weights' dtypes bitsandbytes' 4-bit dequantization produces."""

NF4 = torch.tensor([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0], dtype=torch.float32)
"""QLoRA's NormalFloat4 code book, as bitsandbytes' ``get_4bit_type("nf4")`` lists it (fp32)."""


class Weight4:
    """One 4-bit weight's state: its JSON's fields, its small tensors read whole (the code
    books, the double quantization's scales), where its codes and block scales lie."""

    def __init__(self, source, name: str, state_key: str):
        where = f"{source.where}: {name}"
        quant_type = state_key[len(name) + len(STATE):]
        if quant_type != "nf4":
            raise CheckpointError(f"{where} is a bitsandbytes {quant_type} weight; tiered reads "
                                  f"bitsandbytes 4-bit exports in nf4 only "
                                  f"(bnb_4bit_quant_type='nf4')")
        state = json.loads(bytes(_whole(source, state_key).tolist()).decode())
        if state.get("blocksize") != BLOCK:
            raise CheckpointError(f"{where} is bitsandbytes nf4 in blocks of "
                                  f"{state.get('blocksize')}; tiered reads blocks of {BLOCK} "
                                  f"only (bitsandbytes' default, torchao's NF4 block)")
        if state.get("dtype") not in DTYPES:
            raise CheckpointError(f"{where}: bitsandbytes dtype {state.get('dtype')!r}, not one "
                                  f"of {sorted(DTYPES)}")
        self.shape = tuple(state["shape"])
        self.dtype = DTYPES[state["dtype"]]
        self.numel = math.prod(self.shape)
        self.codes, self.absmax = name, f"{name}.absmax"
        blocks = -(-self.numel // BLOCK)
        self.nested = f"{name}.nested_absmax" in source.tensors
        sizes = {name: -(-self.numel // 2), self.absmax: blocks, f"{name}.quant_map": 16}
        if self.nested:
            self.group = int(state["nested_blocksize"])
            sizes[f"{name}.nested_absmax"] = -(-blocks // self.group)
            sizes[f"{name}.nested_quant_map"] = 256
        for key, numel in sizes.items():
            if key not in source.tensors or math.prod(source.tensors[key][0]) != numel:
                raise CheckpointError(f"{where}: its bitsandbytes state says {list(self.shape)} "
                                      f"in blocks of {BLOCK}, so {key} holds {numel} elements; "
                                      f"the file's does not")
        if not torch.equal(_whole(source, f"{name}.quant_map").float(), NF4):
            raise CheckpointError(f"{where}.quant_map is not the NF4 code book")
        if self.nested:
            self.nested_map = _whole(source, f"{name}.nested_quant_map").float()
            self.nested_absmax = _whole(source, f"{name}.nested_absmax").float()
            self.offset = torch.tensor(float(state["nested_offset"]), dtype=torch.float32)

    def read(self, source, start: int, count: int) -> torch.Tensor:
        """Elements ``[start, start + count)`` of the weight, flattened, as bitsandbytes'
        ``dequantize_4bit`` computes them (see the module's note)."""
        stop = start + count
        first_byte, first_block = start // 2, start // BLOCK
        packed = source.read(self.codes, first_byte, (stop + 1) // 2 - first_byte)
        codes = torch.stack([packed >> 4, packed & 0xF], dim=1).reshape(-1).long()
        codes = codes[start - 2 * first_byte:][:count]
        blocks = (stop - 1) // BLOCK + 1 - first_block
        scales = source.read(self.absmax, first_block, blocks)
        if self.nested:
            groups = torch.arange(first_block, first_block + blocks) // self.group
            scales = self.nested_map[scales.long()] * self.nested_absmax[groups]
            scales = scales + self.offset
        block_of = (torch.arange(start, stop) // BLOCK) - first_block
        return (NF4[codes] * scales.float()[block_of]).to(self.dtype)


class Bnb4Source:
    """A source whose bitsandbytes 4-bit weights read as the weights they stand for (see
    [Note: bitsandbytes exports]); its other tensors read as they are."""

    def __init__(self, source, states: dict[str, str]):
        """``states``: weight name -> the key of its JSON state."""
        self._source = source
        self.where = source.where
        self.objects = source.objects
        self._weights = {name: Weight4(source, name, key) for name, key in states.items()}
        hidden = set(states.values())
        hidden.update(f"{name}.{suffix}" for name in states for suffix in AUXILIARY)
        self.tensors = {name: value for name, value in source.tensors.items()
                        if name not in hidden}
        self.tensors.update({name: (weight.shape, weight.dtype)
                             for name, weight in self._weights.items()})

    def read(self, name: str, start: int, count: int) -> torch.Tensor:
        weight = self._weights.get(name)
        if weight is None:
            return self._source.read(name, start, count)
        return weight.read(self._source, start, count)

    def close(self) -> None:
        self._source.close()


def recognized(source):
    """``source`` itself, or where it holds bitsandbytes 4-bit weights, a :class:`Bnb4Source`
    over it (it is closed if that refuses them); an 8-bit export is refused."""
    int8 = [name[:-len(INT8_SCALES)] for name in source.tensors if name.endswith(INT8_SCALES)]
    states = {key.split(STATE)[0]: key for key in source.tensors if STATE in key}
    if not int8 and not states:
        return source
    try:
        if int8:
            raise CheckpointError(f"{source.where}: {int8[0]} is a bitsandbytes 8-bit weight "
                                  f"(load_in_8bit: its {INT8_SCALES} row scales); tiered reads "
                                  f"bitsandbytes exports in 4-bit nf4 only")
        return Bnb4Source(source, states)
    except BaseException:
        source.close()
        raise


def _whole(source, name: str) -> torch.Tensor:
    shape, _ = source.tensors[name]
    return source.read(name, 0, math.prod(shape))
