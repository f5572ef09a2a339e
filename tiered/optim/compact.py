"""Compact optimizer states: why they round as they do, the random stream, and the step in plain
PyTorch (the formats themselves, their layout and codes: tiers/moments.py).

[Note: compact states]
AdamW keeps 12 bytes per trained parameter beside the weights (fp32 master, two fp32 moments).
``optimizer.moments`` and ``optimizer.master`` keep fewer:
- ``moments: bf16``: 2 bytes each, stochastically rounded. To nearest, a second moment would
  never move: its step at beta2 = 0.999 is 0.1% of it, under half of bf16's 0.8% spacing.
- ``moments: int8``: a byte each, plus an fp32 scale per block of 256 (260 bytes a block: its
  codes, then its scale; tiers/moments.py). A code is a tiny float, 3 mantissa bits and 4 exponent
  bits for the first moment (with a sign) or 5 for the second (which spans the square of the
  gradients' range), scaled so that the block's largest finite magnitude is the map's largest
  code. Each step of a code is 1/8 to 1/16 of its value, and rounding to it is stochastic too,
  for the same reason as bf16's. A second moment never rounds to zero unless it is zero: an
  element whose v read as 0 while its m did not would step by m / eps. A NaN or infinity gets a
  code of its own (NaN) and stays out of its block's scale: it does not wipe out the block, and
  the weight it steps is NaN from then on, as in PyTorch.
- ``master: bf16``: no fp32 master; the bf16 weights are the master, stepped in fp32 and rounded
  stochastically, so that updates smaller than half a bf16 step still move them on average.
The update itself is computed in fp32 from the stored values, with the fp32 kernel's formulas;
only what is stored is compact.

Stochastic rounding takes its bits from a counter-based stream: murmur3's 32-bit finalizer of
the element's index in its unit's shard (each rank's own shard: the ranks' shards of a unit,
other parameters, share the bits) plus a key made from (seed, unit, step) (stream_key). A step
is then the same whatever the threads, pieces or machine, and a resumed run repeats the one it
resumes. One hash per element and step serves all three: its low 16 bits round the weights,
the next 8 the first moment and the top 8 the second. 8 bits resolve 1/256 of a moment's
rounding step, where the smallest change that must survive, a second moment's 0.1% a step, is a
quarter of bf16's and a twentieth of a code's; a weight's update can be a hundredth of its
step (lr 1e-6), so it has 16.

``reference_step`` is the native kernel's (adamw_compact.c) specification, in PyTorch: the two
agree bit for bit (tests/optim/test_compact.py), and ``compact_step`` runs it where the kernel is not
(a GPU's tensors, no C compiler).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from ..tiers.moments import (FIRST_MOMENT, MASK32, QBLOCK, SECOND_MOMENT, divide, format_of,
                             round_bf16_nearest, round_bf16_stochastic, stored_span)
from . import native


def stream_key(seed: int, unit: int, step: int) -> int:
    """The 32-bit key of the random stream of one unit's step."""
    digest = hashlib.blake2b(f"{seed}:{unit}:{step}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def random_bits(index: torch.Tensor, key: int) -> torch.Tensor:
    """The stream's 32 bits for each element index (int64, below 2^32), as int64."""
    h = (index + key) & MASK32
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & MASK32  # int64 wraps; its low 32 bits are the product's
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & MASK32
    return h ^ (h >> 16)


@dataclass(frozen=True)
class Run:
    """Elements [start, stop) of a piece, of one param group: stepped with ``scalars``
    (adamw._one_pass_scalars), or frozen (None)."""

    start: int
    stop: int
    scalars: torch.Tensor | None


def reference_step(master: torch.Tensor | None, weights_in: torch.Tensor, grad: torch.Tensor,
                   exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, weights_out: torch.Tensor,
                   first: int, runs: list[Run], key: int) -> None:
    """One step of a piece of ``grad.numel()`` elements starting at element ``first`` of its
    unit's shard (a multiple of QBLOCK with 8-bit moments). The moments are fp32, bf16 or
    packed 8-bit (uint8) tensors; ``master`` is the fp32 master, or None when the bf16 weights
    are (read from ``weights_in``, which may be ``weights_out``)."""
    n = grad.numel()
    device = grad.device
    index = torch.arange(first, first + n, device=device)
    random = random_bits(index, key)
    m_old = format_of(exp_avg.dtype).decode(exp_avg, n, FIRST_MOMENT)
    v_old = format_of(exp_avg_sq.dtype).decode(exp_avg_sq, n, SECOND_MOMENT)
    p_old = master[:n] if master is not None else weights_in[:n].float()
    m, v, p = m_old.clone(), v_old.clone(), p_old.clone()
    g_all = grad.float()
    for run in runs:
        if run.scalars is None:
            continue
        here = slice(run.start, run.stop)
        decay, beta2, avg_weight, sq_weight, eps, step_size, bias2_sqrt, divisor = (
            run.scalars.to(device).unbind())
        g = divide(g_all[here], divisor)
        from_end = bool(avg_weight.abs() >= 0.5)
        lerp_by = -(1.0 - avg_weight) if from_end else avg_weight
        start = g if from_end else m_old[here]
        m[here] = start + lerp_by * (g - m_old[here])
        v[here] = v_old[here] * beta2 + g * (g * sq_weight)
        p[here] = p_old[here] * decay - step_size * m[here] / (
            divide(_sqrt(v[here]), bias2_sqrt) + eps)
    format_of(exp_avg.dtype).encode_into(exp_avg, m, FIRST_MOMENT, (random >> 16) & 0xFF)
    format_of(exp_avg_sq.dtype).encode_into(exp_avg_sq, v, SECOND_MOMENT, random >> 24)
    if master is not None:
        master[:n] = p
        weights_out[:n] = round_bf16_nearest(p) if weights_out.dtype is torch.bfloat16 else p
    else:
        weights_out[:n] = round_bf16_stochastic(p, random & 0xFFFF)


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root, as the kernel's ``sqrtf``: torch's fp32 ``sqrt`` on the
    CPU (MKL's, torch 2.13) is off by one in the last bit for some inputs; the fp64 root rounded
    to fp32 is exact (fp64 carries more than twice fp32's bits, enough for a square root)."""
    return x.double().sqrt().float()


def compact_step(master: torch.Tensor | None, weights_in: torch.Tensor, grad: torch.Tensor,
                 exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, weights_out: torch.Tensor,
                 first: int, runs: list[Run], key: int) -> None:
    """reference_step's step, by the native kernel (adamw_compact.c) on the CPU where there is
    one, else by reference_step itself (a GPU, or no C compiler): the same bits either way."""
    if exp_avg.dtype is torch.uint8 and first % QBLOCK:
        raise ValueError(f"tiered: a piece of 8-bit moments starts on a block of {QBLOCK} "
                         f"elements, not at element {first}")
    if first + grad.numel() > 1 << 32:
        raise ValueError("tiered: compact states index a unit's shard by 32 bits: a shard of "
                         f"{first + grad.numel()} elements is too large (tile the layer)")
    edges = [0] + [edge for run in runs for edge in (run.start, run.stop)] + [grad.numel()]
    if not runs or edges[::2] != edges[1::2]:
        raise ValueError(f"tiered: the runs must cover the piece's {grad.numel()} elements one "
                         f"after another, got {[(run.start, run.stop) for run in runs]}")
    tensors = [t for t in (master, weights_in, grad, exp_avg, exp_avg_sq, weights_out)
               if t is not None]
    kernel = None
    if grad.device.type == "cpu" and all(t.is_contiguous() for t in tensors):
        kernel = native.native_compact_step(grad.dtype, weights_out.dtype, master is not None,
                                            exp_avg.dtype)
    if kernel is None:
        _reference_in_chunks(master, weights_in, grad, exp_avg, exp_avg_sq, weights_out, first,
                             runs, key)
        return
    bounds = torch.tensor([run.start for run in runs] + [runs[-1].stop], dtype=torch.int64)
    frozen = torch.tensor([0.0] * 8 + [1.0])  # the kernel's ninth scalar: a frozen run
    scalars = torch.stack([frozen if run.scalars is None else
                           torch.cat([run.scalars.float().cpu(), torch.zeros(1)])
                           for run in runs])
    kernel(master, weights_in, grad, exp_avg, exp_avg_sq, weights_out, first, bounds, scalars,
           key)


REFERENCE_CHUNK = 1 << 22
"""Parameters reference_step takes at once where it stands in for the kernel (a GPU's units):
its temporaries (int64 random bits and codes, fp32 copies) are some 60 bytes a parameter, which
no plan counts; 4 M of them stay within 256 MB whatever the unit's size."""


def _reference_in_chunks(master, weights_in, grad, exp_avg, exp_avg_sq, weights_out,
                         first: int, runs: list[Run], key: int) -> None:
    """reference_step over the piece in chunks of whole blocks: the same bits (blocks and
    random bits follow the element's place in its unit), bounded temporaries."""
    n = grad.numel()
    for start in range(0, n, REFERENCE_CHUNK):
        stop = min(start + REFERENCE_CHUNK, n)
        here = slice(start, stop)
        first_moment, second_moment = (
            state.narrow(0, *stored_span(state.dtype, start, stop - start))
            for state in (exp_avg, exp_avg_sq))
        chunk_runs = [Run(max(run.start, start) - start, min(run.stop, stop) - start,
                          run.scalars)
                      for run in runs if max(run.start, start) < min(run.stop, stop)]
        reference_step(None if master is None else master[here], weights_in[here], grad[here],
                       first_moment, second_moment, weights_out[here], first + start,
                       chunk_runs, key)

