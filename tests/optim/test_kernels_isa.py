"""The native AdamW kernels on every instruction set they build for (tiered/optim/native.py;
issue 31, items 4 and 5): each builds here whatever this CPU is (so a build error of the AVX-512
loop shows on a CPU without it), and each that this CPU runs gives the portable loop's bits, the
one-pass kernel and the compact-state ones, at the edges of their vectors (one element, a
vector less one, the first and last aligned vector, a start off the streaming stores'
alignment), with and without weight decay, a divisor, lerp from either end. A loop this CPU
cannot run is skipped, saying so; the box's check (bench/gpu_check.sh) runs the AVX-512 one.

Against PyTorch: two ranks train as torch.optim.AdamW does with every process on AVX2 (torch's
kernels too, ATEN_CPU_CAPABILITY): what an AVX2-only CI machine runs, on any CPU that has
AVX2."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch

from tiered.optim import compact, native
from tiered.optim.adamw import AdamWHyper, _one_pass_scalars
from tiered.optim.compact import Run
from tiered.tiers.moments import PACKED, QBLOCK, stored_numel

from helpers import REPO, clean_env, same_bits

VECTOR_PATHS = ["avx2", "avx512"]
"""Checked against "portable": the same C loop vectorized for AVX2, and AVX-512's intrinsics."""
HYPERS = [AdamWHyper(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1),
          AdamWHyper(lr=1e-3, beta1=0.3, beta2=0.5, eps=1e-6, weight_decay=0.0)]
"""With weight decay and lerp from the moment; without, lerp from the gradient (beta1 < 0.5)."""
EDGES = [(1, 0), (15, 0), (16, 0), (17, 1), (31, 0), (33, 3), (16 * 40 + 15, 1), (4096 + 7, 5)]
"""(elements, offset of the first from an aligned start): one; a vector less one; one vector
(aligned, so it is the first and the last); past a vector, misaligned; and longer runs whose
aligned vectors start inside, after a scalar head."""
PAIRS = [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
         (torch.float16, torch.float16), (torch.float32, torch.float16)]

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                                reason="the instruction sets named are x86-64's")


def runnable(isa: str) -> None:
    if not native.runs_here(isa):
        pytest.skip(f"this CPU cannot run the {isa} loop (bench/gpu_check.sh runs it on the box)")


@pytest.mark.parametrize("isa", ["portable", *VECTOR_PATHS])
def test_each_instruction_set_builds_on_any_cpu(isa):
    path = native.build(isa)
    assert os.path.getsize(path) > 0
    assert f"-{isa}-" in os.path.basename(path)


def one_pass(isa: str, grad_dtype, weights_dtype, numel: int, offset: int, hyper: AdamWHyper,
             divisor: float) -> list[torch.Tensor]:
    """Three steps of the one-pass kernel built for ``isa`` on seeded states (special values
    in the gradients); the master weights, moments and weights after."""
    step = native.native_step(grad_dtype, weights_dtype, isa)
    assert step is not None  # a compiler is here
    generator = torch.Generator().manual_seed(numel)

    def states(rand=torch.randn, dtype=torch.float32):
        return rand(numel + offset, generator=generator).to(dtype)[offset:]
    master, exp_avg, exp_avg_sq = states(), states(), states(torch.rand)
    weights = torch.empty(numel + offset, dtype=weights_dtype)[offset:]
    for number in range(1, 4):
        grad = states(dtype=grad_dtype)
        if number == 2:
            grad[:4] = torch.tensor([0.0, 1e-40, float("inf"), float("nan")])[:numel]
        step(master, grad, exp_avg, exp_avg_sq, weights, _one_pass_scalars(hyper, number,
                                                                          divisor))
    return [master, exp_avg, exp_avg_sq, weights]


@pytest.mark.parametrize("isa", VECTOR_PATHS)
@pytest.mark.parametrize("grad_dtype,weights_dtype", PAIRS, ids=lambda d: str(d)[6:])
def test_the_one_pass_kernel_gives_the_portable_loops_bits(isa, grad_dtype, weights_dtype):
    runnable(isa)
    for numel, offset in EDGES:
        for hyper in HYPERS:
            for divisor in (1.0, 3.0):
                vector = one_pass(isa, grad_dtype, weights_dtype, numel, offset, hyper, divisor)
                portable = one_pass("portable", grad_dtype, weights_dtype, numel, offset, hyper,
                                    divisor)
                for name, a, b in zip(("master", "exp_avg", "exp_avg_sq", "weights"), vector,
                                      portable):
                    assert same_bits(a, b), (isa, numel, offset, hyper, divisor, name)


def compact_steps(isa: str, grad_dtype, keeps_master: bool, moments: torch.dtype,
                  monkeypatch) -> list[torch.Tensor]:
    """Three steps of the compact kernel built for ``isa`` over runs of two groups and a frozen
    one, with edges inside blocks and vectors."""
    monkeypatch.setenv(native.ISA_ENV, isa)
    generator = torch.Generator().manual_seed(3)
    numel, first = 3 * QBLOCK * 4 + 45, QBLOCK
    master = torch.randn(numel, generator=generator)
    weights = master.bfloat16()
    size = stored_numel(PACKED, numel) if moments is torch.uint8 else numel
    exp_avg, exp_avg_sq = torch.zeros(size, dtype=moments), torch.zeros(size, dtype=moments)
    kept = master.clone() if keeps_master else None
    for number in range(1, 4):
        grad = torch.randn(numel, generator=generator).to(grad_dtype)
        runs = [Run(0, 17, _one_pass_scalars(HYPERS[0], number, 1.0)), Run(17, 100, None),
                Run(100, numel, _one_pass_scalars(HYPERS[1], number, 2.0))]
        assert native.native_compact_step(grad_dtype, torch.bfloat16, keeps_master,
                                          moments) is not None
        compact.compact_step(kept, weights, grad, exp_avg, exp_avg_sq, weights, first, runs,
                             compact.stream_key(7, 3, number))
    return [t for t in (kept, weights, exp_avg, exp_avg_sq) if t is not None]


@pytest.mark.parametrize("isa", VECTOR_PATHS)
@pytest.mark.parametrize("keeps_master,moments", [(True, torch.bfloat16), (True, torch.uint8),
                                                  (False, torch.float32),
                                                  (False, torch.uint8)],
                         ids=["master, bf16 moments", "master, int8 moments",
                              "bf16 weights alone, fp32 moments", "bf16 weights alone, int8"])
def test_the_compact_kernels_give_the_portable_loops_bits(isa, keeps_master, moments,
                                                          monkeypatch):
    runnable(isa)
    for grad_dtype in (torch.bfloat16, torch.float32):
        vector = compact_steps(isa, grad_dtype, keeps_master, moments, monkeypatch)
        portable = compact_steps("portable", grad_dtype, keeps_master, moments, monkeypatch)
        for a, b in zip(vector, portable):
            assert same_bits(a, b), (isa, grad_dtype)


def test_an_instruction_set_this_cpu_lacks_or_does_not_know_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(native.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="TIERED_KERNEL_ISA='sse9': the kernels build for "
                                         "native, portable, avx2, avx512"):
        native.native_step(torch.bfloat16, torch.bfloat16)
    monkeypatch.setattr(native, "_cpu_flags", lambda: frozenset({"sse2", "avx2"}))
    with pytest.raises(ValueError, match="'avx512': this CPU lacks avx512bw, avx512cd"):
        native.native_step(torch.bfloat16, torch.bfloat16, "avx512")


def test_two_ranks_train_as_pytorch_on_an_avx2_machine():
    """tests/engine/test_parity.py's two ranks under every policy, every process (ranks and the
    reference alike) on the AVX2 loop and on torch's AVX2 kernels: what an AVX2-only machine
    runs (the portable loop gives the same bits, as the tests above show)."""
    isa, torch_kernels = "avx2", "avx2"
    runnable(isa)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/engine/test_parity.py::test_two_ranks_every_policy"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env=clean_env(**{native.ISA_ENV: isa, "ATEN_CPU_CAPABILITY": torch_kernels}))
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "1 passed" in done.stdout
