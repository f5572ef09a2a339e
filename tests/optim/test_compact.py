"""Compact optimizer states (issue 21): the native kernel against its PyTorch reference, the code
maps' bounds, stochastic rounding's bias, and special values against torch.optim.AdamW."""
from __future__ import annotations

import math

import pytest
import torch

from tiered.optim import compact, native
from tiered.optim.adamw import AdamWHyper, _one_pass_scalars
from tiered.optim.compact import Run
from tiered.tiers.moments import (FIRST_MOMENT, INT8, PACKED, QBLOCK, SECOND_MOMENT,
                                  round_bf16_stochastic, stored_numel)

from helpers import same_bits

HYPER = AdamWHyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
MOMENTS = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}

# (gradient, weights, fp32 master kept, moments): every variant the kernel provides.
VARIANTS = [(g, w, True, m) for g, w in [(torch.bfloat16, torch.bfloat16),
                                          (torch.float32, torch.bfloat16),
                                          (torch.float16, torch.float16),
                                          (torch.float32, torch.float16),
                                          (torch.float32, torch.float32)]
            for m in ("bf16", "int8")]
VARIANTS += [(g, torch.bfloat16, False, m) for g in (torch.bfloat16, torch.float32)
             for m in ("fp32", "bf16", "int8")]


def fresh_moments(numel: int, moments: str) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = MOMENTS[moments]
    size = stored_numel(PACKED, numel) if dtype is torch.uint8 else numel
    return torch.zeros(size, dtype=dtype), torch.zeros(size, dtype=dtype)


def run_steps(step, grads, master, weights, moments, runs_of, first):
    """Step ``len(grads)`` times with ``step`` (compact_step or reference_step); the states."""
    exp_avg, exp_avg_sq = fresh_moments(weights.numel(), moments)
    master = None if master is None else master.clone()
    weights = weights.clone()
    for number, grad in enumerate(grads, start=1):
        step(master, weights, grad, exp_avg, exp_avg_sq, weights, first, runs_of(number),
             compact.stream_key(7, 3, number))
    return master, weights, exp_avg, exp_avg_sq


@pytest.mark.parametrize("grad_dtype,weights_dtype,keeps_master,moments", VARIANTS)
def test_the_native_kernel_is_its_reference_bit_for_bit(grad_dtype, weights_dtype,
                                                        keeps_master, moments):
    assert native.native_compact_step(grad_dtype, weights_dtype, keeps_master,
                                      MOMENTS[moments]) is not None
    torch.manual_seed(0)
    numel, first = 9 * 4096 + 300, 5 * QBLOCK  # a partial last block; a piece further in
    master = torch.randn(numel)
    grads = [torch.randn(numel).to(grad_dtype) for _ in range(3)]
    # Special values, and a run of tiny gradients (denormal moments).
    grads[1][17], grads[1][4000], grads[2][9000] = math.nan, math.inf, -math.inf
    grads[0][5000:5600] = 1e-30
    grads[1][6000:6256] = 0.0
    other = AdamWHyper(lr=3e-3, beta1=0.3, beta2=0.95, eps=1e-6, weight_decay=0.0)

    def runs_of(step: int) -> list[Run]:  # three groups, one frozen; edges inside blocks
        return [Run(0, 1000, _one_pass_scalars(HYPER, step, 1.0)),
                Run(1000, 1100, None),
                Run(1100, 20_000, _one_pass_scalars(other, step, 4.0)),
                Run(20_000, numel, _one_pass_scalars(HYPER, step, 0.5))]

    weights = master.to(weights_dtype)
    kept = master if keeps_master else None
    ours = run_steps(compact.compact_step, grads, kept, weights, moments, runs_of, first)
    reference = run_steps(compact.reference_step, grads, kept, weights, moments, runs_of, first)
    for name, a, b in zip(("master", "weights", "exp_avg", "exp_avg_sq"), ours, reference):
        assert (a is None) == (b is None)
        if a is not None:
            assert same_bits(a, b), name
    # Frozen elements keep their weights.
    assert torch.equal(ours[1][1000:1100], weights[1000:1100])


def test_a_piece_steps_as_the_same_elements_of_a_whole_shard():
    """Random bits and blocks follow the element's index in its unit's shard: stepping a shard
    in two pieces gives the bits of stepping it whole."""
    torch.manual_seed(1)
    numel = 8 * QBLOCK + 77
    weights, grad = torch.randn(numel).bfloat16(), torch.randn(numel).bfloat16()
    scalars = _one_pass_scalars(HYPER, 1, 1.0)
    whole_m, whole_v = fresh_moments(numel, "int8")
    whole = weights.clone()
    compact.compact_step(None, whole, grad, whole_m, whole_v, whole, 0,
                         [Run(0, numel, scalars)], 99)
    split_m, split_v = fresh_moments(numel, "int8")
    split = weights.clone()
    cut = 3 * QBLOCK
    packed_cut = stored_numel(PACKED, cut)
    compact.compact_step(None, split[:cut], grad[:cut], split_m[:packed_cut],
                         split_v[:packed_cut], split[:cut], 0, [Run(0, cut, scalars)], 99)
    compact.compact_step(None, split[cut:], grad[cut:], split_m[packed_cut:],
                         split_v[packed_cut:], split[cut:], cut,
                         [Run(0, numel - cut, scalars)], 99)
    assert torch.equal(split.view(torch.int16), whole.view(torch.int16))
    assert torch.equal(split_m, whole_m) and torch.equal(split_v, whole_v)


@pytest.mark.parametrize("code_map", [FIRST_MOMENT, SECOND_MOMENT], ids=["first", "second"])
def test_the_round_trip_error_is_within_one_step_of_the_code_map(code_map):
    torch.manual_seed(2)
    blocks = 64
    # Each block spans 12 decades (and the second moment's values are positive).
    x = torch.exp(torch.empty(blocks * QBLOCK).uniform_(-28, 0)) * torch.empty(
        blocks * QBLOCK).uniform_(0.1, 10)
    if code_map.signed:
        x = x * torch.where(torch.rand(x.shape) < 0.5, -1.0, 1.0)
    x[::97] = 0.0
    packed = torch.zeros(stored_numel(PACKED, x.numel()), dtype=torch.uint8)
    r8 = compact.random_bits(torch.arange(x.numel()), 5) >> 24
    INT8.encode_into(packed, x, code_map, r8)
    back = INT8.decode(packed, x.numel(), code_map)
    scale = x.view(blocks, QBLOCK).abs().amax(dim=1, keepdim=True) / code_map.largest
    smallest_step = 2.0 ** (-code_map.bias - 2) * scale  # the evenly spaced codes near zero
    # A stochastic rounding lands on one of the two codes around x: within one code's step,
    # which is at most |x| / 8 above the smallest normal code (3 mantissa bits).
    bound = torch.maximum(x.view(blocks, QBLOCK).abs() / 8, smallest_step) * (1 + 1e-6)
    error = (back - x).abs().view(blocks, QBLOCK)
    assert bool((error <= bound).all()), float((error / bound).max())
    assert torch.equal(back[::97], torch.zeros_like(back[::97]))  # zero stays zero
    # Each block's largest magnitude has the largest code, exactly.
    largest = x.view(blocks, QBLOCK).abs().argmax(dim=1) + torch.arange(blocks) * QBLOCK
    torch.testing.assert_close(back[largest].abs(), x[largest].abs(), rtol=2e-7, atol=0)


def test_a_second_moment_rounds_to_zero_only_when_it_is_zero():
    """A v read as 0 beside an m that is not would step its weight by m / eps."""
    x = torch.full((QBLOCK,), 1e-30)
    x[0], x[1] = 1.0, 0.0
    packed = torch.zeros(stored_numel(PACKED, QBLOCK), dtype=torch.uint8)
    INT8.encode_into(packed, x, SECOND_MOMENT, torch.zeros(QBLOCK, dtype=torch.int64))
    back = INT8.decode(packed, QBLOCK, SECOND_MOMENT)
    assert back[1] == 0 and bool((back[2:] > 0).all())


def test_a_nan_keeps_its_own_code_and_spares_its_block():
    x = torch.linspace(-1, 1, QBLOCK)
    x[5], x[6] = math.nan, math.inf
    packed = torch.zeros(stored_numel(PACKED, QBLOCK), dtype=torch.uint8)
    INT8.encode_into(packed, x, FIRST_MOMENT, torch.zeros(QBLOCK, dtype=torch.int64))
    back = INT8.decode(packed, QBLOCK, FIRST_MOMENT)
    assert back[5].isnan() and back[6].isnan()
    rest = torch.cat([back[:5], back[7:]])
    assert bool(rest.isfinite().all())
    torch.testing.assert_close(rest, torch.cat([x[:5], x[7:]]), rtol=1 / 8, atol=1e-5)


def five_sigma(step: float, count: int, resolution_bits: int) -> float:
    """How far the mean of ``count`` stochastic roundings between two values ``step`` apart may
    stray from the exact value: five standard deviations (at most step / 2 each), plus the bias
    of deciding with ``resolution_bits`` random bits (step / 2^bits)."""
    return 5 * step / 2 / math.sqrt(count) + step / 2 ** resolution_bits


def test_stochastic_rounding_of_the_weights_is_unbiased():
    """An update of 1/100 of a bf16 step: to nearest it would never move a weight; stochastic
    rounding moves 1 in 100, so that the mean moves by the update."""
    count = 1 << 20
    step = 2.0 ** -8  # bf16's step just below 1
    exact = torch.full((count,), 1.0 - step / 100)
    rounded = round_bf16_stochastic(exact, compact.random_bits(torch.arange(count), 11)
                                            & 0xFFFF).float()
    assert set(rounded.unique().tolist()) == {1.0 - step, 1.0}
    assert abs(rounded.mean().item() - exact[0].item()) < five_sigma(step, count, 16)
    assert exact.bfloat16().float().unique().tolist() == [1.0]  # to nearest: no move at all


@pytest.mark.parametrize("code_map", [FIRST_MOMENT, SECOND_MOMENT], ids=["first", "second"])
def test_stochastic_rounding_of_codes_is_unbiased(code_map):
    """A value between two codes (the block's largest, 1.0, sets the scale) rounds to either,
    in the proportion that keeps the mean."""
    count_blocks = 4096
    x = torch.full((count_blocks, QBLOCK), 0.3)
    x[:, 0] = code_map.largest  # a scale of 1: codes are the map's own values
    packed = torch.zeros(stored_numel(PACKED, x.numel()), dtype=torch.uint8)
    r8 = compact.random_bits(torch.arange(x.numel()), 3) >> 24
    INT8.encode_into(packed, x.view(-1), code_map, r8)
    back = INT8.decode(packed, x.numel(), code_map).view(count_blocks, QBLOCK)[:, 1:]
    below, above = sorted(back.unique().tolist())
    assert below < 0.3 < above
    assert abs(back.mean().item() - 0.3) < five_sigma(above - below, back.numel(), 8)


def test_moments_in_bf16_follow_a_slowly_decaying_second_moment():
    """beta2 = 0.999 moves v by 0.1% a step, a quarter of bf16's step: rounded to nearest it
    would stay where it is for ever; stochastically it decays as in fp32."""
    count, steps = 4096, 300
    scalars = _one_pass_scalars(AdamWHyper(0.0, 0.9, 0.999, 1e-8, 0.0), 1, 1.0)
    weights = torch.zeros(count, dtype=torch.bfloat16)
    exp_avg = torch.zeros(count, dtype=torch.bfloat16)
    exp_avg_sq = torch.ones(count, dtype=torch.bfloat16)
    grad = torch.zeros(count, dtype=torch.bfloat16)
    for step in range(1, steps + 1):
        compact.compact_step(None, weights, grad, exp_avg, exp_avg_sq, weights, 0,
                             [Run(0, count, scalars)], compact.stream_key(0, 0, step))
    expected = 0.999 ** steps
    assert abs(exp_avg_sq.float().mean().item() - expected) < 0.01 * expected


@pytest.mark.parametrize("moments", ["bf16", "int8"])
def test_special_gradients_end_as_in_torch_adamw(moments):
    """Zeros, denormals, infinities and NaN: each weight is finite, NaN or unchanged where
    torch.optim.AdamW's is, and a NaN spoils only its own element."""
    torch.manual_seed(3)
    numel = 4 * QBLOCK
    master = torch.randn(numel)
    grad = torch.randn(numel)
    grad[3], grad[300], grad[301] = math.nan, math.inf, -math.inf
    grad[512:768] = 0.0
    grad[768:800] = 1e-40  # denormal
    param = torch.nn.Parameter(master.clone())
    optimizer = torch.optim.AdamW([param], lr=HYPER.lr, betas=(HYPER.beta1, HYPER.beta2),
                                  eps=HYPER.eps, weight_decay=HYPER.weight_decay)
    param.grad = grad.clone()
    optimizer.step()
    expected = param.detach()
    ours = master.clone()
    exp_avg, exp_avg_sq = fresh_moments(numel, moments)
    weights = torch.empty(numel, dtype=torch.bfloat16)
    compact.compact_step(ours, weights, grad, exp_avg, exp_avg_sq, weights, 0,
                         [Run(0, numel, _one_pass_scalars(HYPER, 1, 1.0))], 1)
    assert torch.equal(ours.isnan(), expected.isnan())
    assert torch.equal(ours[512:768], expected[512:768])  # a zero gradient: decay alone
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-6, equal_nan=True)


def test_the_step_refuses_pieces_it_cannot_step():
    weights = torch.zeros(QBLOCK, dtype=torch.bfloat16)
    exp_avg, exp_avg_sq = fresh_moments(QBLOCK, "int8")
    scalars = _one_pass_scalars(HYPER, 1, 1.0)
    with pytest.raises(ValueError, match="starts on a block of 256"):
        compact.compact_step(None, weights, weights, exp_avg, exp_avg_sq, weights, 100,
                             [Run(0, QBLOCK, scalars)], 1)
    with pytest.raises(ValueError, match="must cover the piece"):
        compact.compact_step(None, weights, weights, exp_avg, exp_avg_sq, weights, 0,
                             [Run(0, 100, scalars), Run(120, QBLOCK, scalars)], 1)


@pytest.mark.gpu
@pytest.mark.parametrize("keeps_master,moments", [(True, "int8"), (False, "int8"),
                                                  (False, "bf16")])
def test_a_units_step_on_the_gpu_gives_the_native_kernels_bits(keeps_master, moments):
    """Units placed on the device step with the reference on CUDA tensors (compact_step)."""
    torch.manual_seed(4)
    numel = 3 * 4096 + 100
    master = torch.randn(numel)
    grads = [torch.randn(numel).bfloat16() for _ in range(2)]

    def runs_of(step: int) -> list[Run]:
        return [Run(0, 700, _one_pass_scalars(HYPER, step, 1.0)), Run(700, 900, None),
                Run(900, numel, _one_pass_scalars(HYPER, step, 2.0))]

    def on(device):
        def step(m, w_in, g, a, b, w_out, first, runs, key):
            moved = [None if t is None else t.to(device) for t in (m, w_in, g, a, b)]
            out = moved[1] if w_out is w_in else w_out.to(device)
            compact.compact_step(*moved, out, first, runs, key)
            for original, new in zip((m, w_in, a, b, w_out), (*moved[:2], *moved[3:], out)):
                if original is not None:
                    original.copy_(new.cpu())
        return step

    weights = master.bfloat16()
    kept = master if keeps_master else None
    cpu = run_steps(on("cpu"), grads, kept, weights, moments, runs_of, 0)
    gpu = run_steps(on("cuda"), grads, kept, weights, moments, runs_of, 0)
    for name, a, b in zip(("master", "weights", "exp_avg", "exp_avg_sq"), cpu, gpu):
        if a is not None:
            assert same_bits(a, b), name


def test_where_no_kernel_is_the_reference_steps_in_chunks_to_the_same_bits(monkeypatch):
    """A GPU's units, or a machine without a C compiler: reference_step in chunks of whole
    blocks (bounded temporaries), runs cut at the chunks' edges, the kernel's bits."""
    torch.manual_seed(6)
    numel = 5 * 1024 + 300
    grads = [torch.randn(numel).bfloat16() for _ in range(2)]
    weights = torch.randn(numel).bfloat16()

    def runs_of(step: int) -> list[Run]:  # one run across a chunk's edge, one inside
        return [Run(0, 1500, _one_pass_scalars(HYPER, step, 1.0)), Run(1500, 1600, None),
                Run(1600, numel, _one_pass_scalars(HYPER, step, 3.0))]

    native_bits = run_steps(compact.compact_step, grads, None, weights, "int8", runs_of, 512)
    monkeypatch.setattr(compact, "REFERENCE_CHUNK", 1024)
    monkeypatch.setattr(native, "native_compact_step", lambda *args: None)
    chunked = run_steps(compact.compact_step, grads, None, weights, "int8", runs_of, 512)
    for name, a, b in zip(("master", "weights", "exp_avg", "exp_avg_sq"), native_bits, chunked):
        if a is not None:
            assert same_bits(a, b), name
