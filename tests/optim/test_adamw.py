"""The AdamW kernels against torch.optim.AdamW."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch

from tiered.optim import adamw, native
from tiered.optim.adamw import AdamWHyper, OnePassAdamW, adamw_step
from tiered.optim.norm import squared_norm

from helpers import REPO

HYPER = AdamWHyper(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def torch_adamw(master, grads, divisor):
    param = torch.nn.Parameter(master.clone())
    optimizer = torch.optim.AdamW([param], lr=HYPER.lr, betas=(HYPER.beta1, HYPER.beta2),
                                  eps=HYPER.eps, weight_decay=HYPER.weight_decay)
    for grad in grads:
        param.grad = grad.float() / divisor
        optimizer.step()
    return param.detach()


def test_fused_step_is_torch_adamw_bit_for_bit():
    torch.manual_seed(0)
    master = torch.randn(4099)
    grads = [torch.randn(4099) for _ in range(3)]
    ours, exp_avg, exp_avg_sq, step = master.clone(), torch.zeros(4099), torch.zeros(4099), \
        torch.zeros(())
    for grad in grads:
        step += 1
        adamw_step(ours, grad.clone(), exp_avg, exp_avg_sq, step, HYPER)
    reference = torch.nn.Parameter(master.clone())
    optimizer = torch.optim.AdamW([reference], lr=HYPER.lr, betas=(HYPER.beta1, HYPER.beta2),
                                  eps=HYPER.eps, weight_decay=HYPER.weight_decay, fused=True)
    for grad in grads:
        reference.grad = grad.clone()
        optimizer.step()
    assert torch.equal(ours, reference.detach())


@pytest.mark.parametrize("grad_dtype,weights_dtype", [(torch.bfloat16, torch.bfloat16),
                                                     (torch.float16, torch.float16),
                                                     (torch.float32, torch.bfloat16)])
def test_one_pass_matches_torch_adamw_and_writes_the_cast(grad_dtype, weights_dtype):
    torch.manual_seed(0)
    master = torch.randn(10_001)
    grads = [torch.randn(10_001).to(grad_dtype) for _ in range(3)]
    kernel = OnePassAdamW()
    ours, exp_avg, exp_avg_sq, step = master.clone(), torch.zeros(10_001), \
        torch.zeros(10_001), torch.zeros(())
    weights = torch.full((10_001,), float("nan"), dtype=weights_dtype)
    for grad in grads:
        step += 1
        kernel.step(ours, grad, exp_avg, exp_avg_sq, weights, step, HYPER, grad_divisor=4.0)
    assert not kernel._failed
    assert step.item() == 3
    torch.testing.assert_close(ours, torch_adamw(master, grads, 4.0), rtol=1e-6, atol=1e-6)
    assert torch.equal(weights, ours.to(weights_dtype))


def test_one_pass_falls_back_to_fused_when_compiling_fails(monkeypatch):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(adamw.torch, "compile", no_compiler)
    torch.manual_seed(0)
    master = torch.randn(1000)
    grads = [torch.randn(1000).bfloat16() for _ in range(2)]
    kernel = OnePassAdamW(native=False)  # as where no C compiler is either
    ours, exp_avg, exp_avg_sq, step = master.clone(), torch.zeros(1000), torch.zeros(1000), \
        torch.zeros(())
    weights = torch.empty(1000, dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match="no C.. compiler"):
        for grad in grads:
            step += 1
            kernel.step(ours, grad, exp_avg, exp_avg_sq, weights, step, HYPER, grad_divisor=2.0)
    assert kernel._failed and step.item() == 2
    torch.testing.assert_close(ours, torch_adamw(master, grads, 2.0), rtol=1e-6, atol=1e-6)
    assert torch.equal(weights, ours.bfloat16())


def step_state(kernel: OnePassAdamW, state: dict, grads: list[torch.Tensor], hyper: AdamWHyper,
               divisor: float) -> dict:
    state = {name: value.clone() for name, value in state.items()}
    step = torch.zeros(())
    for grad in grads:
        step += 1
        kernel.step(state["master"], grad, state["exp_avg"], state["exp_avg_sq"],
                    state["weights"], step, hyper, divisor)
    return state


@pytest.mark.parametrize("grad_dtype,weights_dtype", [(torch.bfloat16, torch.bfloat16),
                                                     (torch.float32, torch.bfloat16),
                                                     (torch.float16, torch.float16),
                                                     (torch.float32, torch.float16)])
def test_the_native_kernel_gives_the_compiled_kernels_bits(grad_dtype, weights_dtype):
    """Built from C (native.py), bit for bit what inductor's compilation of the same step gives:
    at sizes off its block and its vector width, on views whose weights are not aligned for
    its streaming stores, with a divisor or none, betas on either side of lerp's switch, and
    gradients holding zeros, denormals, infinities and NaN."""
    assert adamw.native_step(grad_dtype, weights_dtype) is not None  # a compiler is here
    torch.manual_seed(0)
    for numel, offset in ((1, 0), (4095, 0), (3 * 4096 + 17, 1)):
        grads = [torch.randn(numel + offset)[offset:].to(grad_dtype) for _ in range(3)]
        grads[1][:4] = torch.tensor([0.0, 1e-40, float("inf"), float("nan")])[:numel]
        state = {name: torch.randn(numel + offset)[offset:] for name in ("master", "exp_avg")}
        state["exp_avg_sq"] = torch.rand(numel + offset)[offset:]
        state["weights"] = torch.empty(numel + offset, dtype=weights_dtype)[offset:]
        for hyper in (HYPER, AdamWHyper(lr=1e-3, beta1=0.3, beta2=0.5, eps=1e-6,
                                        weight_decay=0.0)):
            for divisor in (1.0, 3.0):
                native = step_state(OnePassAdamW(), state, grads, hyper, divisor)
                compiled_kernel = OnePassAdamW(native=False)
                compiled = step_state(compiled_kernel, state, grads, hyper, divisor)
                assert not compiled_kernel._failed
                for name in state:  # exactly, a NaN where the other has one
                    torch.testing.assert_close(native[name], compiled[name], rtol=0, atol=0,
                                               equal_nan=True,
                                               msg=lambda m: f"{numel} {hyper} {name}: {m}")


NATIVE_STEP_SCRIPT = """
import sys
import torch
from tiered.optim.adamw import AdamWHyper, native_step, _one_pass_scalars
torch.set_num_threads(2)
torch.manual_seed(0)
state = [torch.randn(4099), torch.randn(4099).bfloat16(), torch.randn(4099), torch.rand(4099),
         torch.empty(4099, dtype=torch.bfloat16)]
native_step(torch.bfloat16, torch.bfloat16)(*state, _one_pass_scalars(
    AdamWHyper(1e-2, 0.9, 0.95, 1e-8, 0.1), 1.0, 1.0))
torch.save(state, sys.argv[1])
"""


def test_the_native_kernel_steps_every_element_with_fewer_threads_than_asked(tmp_path):
    """OpenMP may give a team smaller than the threads asked for (here OMP_THREAD_LIMIT=1
    against 2): the ranges follow the team, and every element is stepped as with two."""
    results = []
    for limit in ("2", "1"):
        out = tmp_path / f"team{limit}.pt"
        subprocess.run([sys.executable, "-c", NATIVE_STEP_SCRIPT, str(out)], check=True,
                       cwd=REPO, env=dict(os.environ, OMP_THREAD_LIMIT=limit, PYTHONPATH=str(REPO)),
                       timeout=120)
        results.append(torch.load(out, weights_only=True))
    for two, one in zip(*results):  # master, gradient, moments, weights
        assert torch.equal(two, one)


def test_a_native_kernel_that_cannot_be_built_leaves_the_compiled_one(monkeypatch, tmp_path):
    broken = tmp_path / "adamw_one_pass.c"
    broken.write_text("this is not C\n")
    monkeypatch.setenv("TIERED_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "SOURCES", (str(broken),))
    native._library.cache_clear()
    native._native_step.cache_clear()
    try:
        with pytest.warns(UserWarning, match="the native AdamW kernel could not be built"):
            assert native.native_step(torch.bfloat16, torch.bfloat16) is None
        kernel = OnePassAdamW()
        state = {"master": torch.randn(100), "exp_avg": torch.zeros(100),
                 "exp_avg_sq": torch.zeros(100), "weights": torch.empty(100).bfloat16()}
        stepped = step_state(kernel, state, [torch.randn(100).bfloat16()], HYPER, 1.0)
        assert not kernel._failed and kernel._compiled is not None  # inductor's served
        assert torch.equal(stepped["weights"], stepped["master"].bfloat16())
    finally:  # the next use builds (or loads) the real one
        native._library.cache_clear()
        native._native_step.cache_clear()


def test_one_pass_lets_other_threads_run_while_it_steps():
    """The worker steps while the training thread drives the GPU: the kernel must let go of
    the GIL. The main thread records the longest it went without running while a single-
    threaded kernel stepped a large shard on another thread; holding the GIL, that gap is a
    whole step."""
    numel = 1 << 26  # about 0.1 s a step on one core: far longer than any scheduling hiccup
    kernel = OnePassAdamW()
    tensors = dict(master=torch.randn(numel), grad=torch.randn(numel).bfloat16(),
                   exp_avg=torch.zeros(numel), exp_avg_sq=torch.zeros(numel),
                   weights=torch.empty(numel, dtype=torch.bfloat16))
    compiled = threading.Event()
    run_seconds: list[float] = []

    def steps():
        torch.set_num_threads(1)  # one core for the kernel, one left for the main thread
        kernel.warm_up(torch.bfloat16, torch.bfloat16)
        compiled.set()
        for _ in range(3):
            start = time.perf_counter()
            kernel.step(**tensors, step=torch.ones(()), hyper=HYPER, grad_divisor=1.0)
            run_seconds.append(time.perf_counter() - start)

    threads = torch.get_num_threads()
    worker = threading.Thread(target=steps)
    worker.start()
    compiled.wait()
    longest_gap, last = 0.0, time.perf_counter()
    while worker.is_alive():
        now = time.perf_counter()
        longest_gap, last = max(longest_gap, now - last), now
    worker.join()
    torch.set_num_threads(threads)  # the count is process-wide in torch
    assert not kernel._failed and len(run_seconds) == 3
    assert longest_gap < 0.5 * min(run_seconds), (longest_gap, run_seconds)


@pytest.mark.parametrize("accumulation_steps", [None, 1])
def test_initialize_compiles_every_variant_the_steps_need(accumulation_steps):
    """A compile takes about a minute on a cold GPU box (and replays the training thread's
    random numbers): every variant of the kernel the steps use must be compiled in
    initialize(), none in a step. Two backwards per step and zero_grad(set_to_none=False) make
    fp32 gradient sums, the first backward of a step a bf16 gradient; units are views at many
    offsets of a few slabs; a one-element parameter in a param group of its own is stepped as
    a one-element run."""
    import tiered

    from gpt import GPT, next_token_loss

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(64, 16, 6, 2)
    model.register_parameter("gate", torch.nn.Parameter(torch.ones(1)))
    engine, optimizer = tiered.initialize(
        model, "configs/cpu.yaml", device="cpu", compute_dtype="bf16",
        optimizer={"accumulation_steps": accumulation_steps,
                   "param_groups": [{"match": "gate", "weight_decay": 0.0}]})
    kernel = engine.runtime.host.rank_host.stepper.one_pass
    idx = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    backwards = 1 if accumulation_steps == 1 else 2
    compiled = dict(torch._dynamo.utils.counters["stats"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a failed compile warns and falls back
        for set_to_none in (True, False, True):
            for _ in range(backwards):
                engine.backward(next_token_loss(engine(idx), idx))
            optimizer.step()
            optimizer.zero_grad(set_to_none)
        optimizer.synchronize()
    assert kernel is not None and not kernel._failed
    # Nothing more was traced or compiled: the counters are process-wide (dynamo's config is
    # per thread, so error_on_recompile would not reach the worker).
    assert dict(torch._dynamo.utils.counters["stats"]) == compiled
    engine.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("numel", [0, 1, 4095, 4097 + (1 << 22)])
def test_squared_norm_is_exact_to_a_millionth_at_any_size(dtype, numel):
    g = torch.Generator().manual_seed(numel)
    shard = torch.randn(numel, generator=g).to(dtype)
    exact = shard.double().square().sum()
    assert abs(squared_norm(shard) - exact) <= 1e-6 * exact


def test_squared_norm_of_a_large_unit_stays_exact():
    """A whole 2**27-element unit of equal magnitudes: one fp32 sum per thread (vector_norm's
    way) is off by about 1% here; rows summed in fp64 are not."""
    shard = torch.full((1 << 27,), 0.1, dtype=torch.bfloat16)
    exact = shard.double().square().sum()
    assert abs(squared_norm(shard) - exact) <= 1e-6 * exact


def test_squared_norm_keeps_an_overflow_visible():
    shard = torch.ones(1 << 13, dtype=torch.float16)
    shard[5000] = float("inf")
    assert squared_norm(shard) == float("inf")
    shard[5000] = float("nan")
    assert squared_norm(shard).isnan()
