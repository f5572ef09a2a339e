"""The AdamW update on one shard, on whichever device holds it.

It is torch's own fused AdamW kernel (``torch.optim.AdamW(fused=True)`` calls the same op, on CPU
since torch 2.4 and on CUDA), so the update is bit-for-bit what PyTorch computes (decoupled weight
decay, bias correction from the step count) whenever the gradient is used as it is. A gradient
divisor (loss scale, clipping) divides inside the kernel where PyTorch multiplies beforehand, so
those steps agree to rounding, not bit for bit. On the reference box the fused CPU kernel ran
4.47 G params/s against 0.92 for foreach and 0.72 for the single-tensor path.
"""
from __future__ import annotations

import math
import warnings
from typing import Callable
from dataclasses import dataclass
from functools import partial

import torch

from .native import native_step


@dataclass(frozen=True)
class AdamWHyper:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float

    @classmethod
    def from_group(cls, group: dict) -> "AdamWHyper":
        beta1, beta2 = group["betas"]
        return cls(float(group["lr"]), beta1, beta2, group["eps"], group["weight_decay"])


def adamw_step(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
               exp_avg_sq: torch.Tensor, step: torch.Tensor, hyper: AdamWHyper,
               grad_divisor: torch.Tensor | None = None) -> None:
    """One AdamW step in place on ``master``, ``exp_avg``, ``exp_avg_sq``; ``step`` (a float32
    scalar tensor on the same device) holds this step's number, already counted by the caller
    (once per unit, also when the unit is stepped in sub-groups), as torch counts before it steps.

    ``grad_divisor`` (a scalar tensor) divides the gradient inside the kernel: the loss scale
    and the clipping factor applied without a separate pass over the gradient.
    """
    _require_contiguous(master, grad, exp_avg, exp_avg_sq)
    torch._fused_adamw_(
        [master], [grad], [exp_avg], [exp_avg_sq], [], [step],
        lr=hyper.lr, beta1=hyper.beta1, beta2=hyper.beta2, weight_decay=hyper.weight_decay,
        eps=hyper.eps, amsgrad=False, maximize=False, grad_scale=grad_divisor, found_inf=None)


def _require_contiguous(*tensors: torch.Tensor) -> None:
    """Refuse strided views: torch's fused CPU kernel walks ``numel`` elements from a tensor's
    first one as if it were contiguous (torch 2.13), so on ``x[::2]`` it steps the wrong half
    and overwrites the elements between; ``_alone`` would cover the same wrong memory."""
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError("tiered: the AdamW kernels need contiguous tensors, got strides "
                         f"{[t.stride() for t in tensors]}")


def _adamw_one_pass(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                    exp_avg_sq: torch.Tensor, weights: torch.Tensor,
                    scalars: torch.Tensor) -> None:
    """AdamW as torch.optim.AdamW computes it, plus the cast of the result, in one pass.

    ``scalars`` comes from :func:`_one_pass_scalars`: each coefficient as torch's fused kernel
    uses it, computed in fp64 and rounded once to fp32."""
    decay, beta2, avg_weight, sq_weight, eps, step_size, bias2_sqrt, divisor = scalars.unbind()
    g = grad.float() / divisor
    master.mul_(decay)
    exp_avg.lerp_(g, avg_weight)
    exp_avg_sq.mul_(beta2).addcmul_(g, g * sq_weight)
    master.sub_(step_size * exp_avg / (exp_avg_sq.sqrt() / bias2_sqrt + eps))
    weights.copy_(master)


def _one_pass_scalars(hyper: AdamWHyper, step: float, grad_divisor: float) -> torch.Tensor:
    """The kernel's coefficients, as torch's fused AdamW computes them: in fp64 from the
    hyperparameters, then rounded to fp32. Forming ``1 - beta2`` in the kernel from the fp32
    ``beta2`` instead is off by 1.3e-5 relative for 0.999 (fp32(0.999) is not 0.999), which
    biased every second moment by that much, and ``1 - beta1`` and ``1 - lr * wd`` likewise."""
    return torch.tensor(
        [1 - hyper.lr * hyper.weight_decay, hyper.beta2, 1 - hyper.beta1, 1 - hyper.beta2,
         hyper.eps, hyper.lr / (1 - hyper.beta1 ** step), math.sqrt(1 - hyper.beta2 ** step),
         grad_divisor], dtype=torch.float64).float()


WARM_UP_NUMEL = 1 << 22
"""Elements the kernel is compiled on: the size of a small unit's shard (64 MiB of states)."""


def _alone(tensor: torch.Tensor) -> torch.Tensor:
    """The same memory as the contiguous ``tensor``, as a tensor with a storage of its own that
    starts where it does.

    The tiers hand out states as views into shared slabs, at offsets and in groupings that vary
    from unit to unit. Code compiled on such views is guarded on which inputs share a storage
    and on offsets of 0 (seen with torch 2.13), so each pattern could cost another compile, and
    past dynamo's limit of 8 the kernel would silently run uncompiled. Seen alone, every unit's
    states match the one variant the warm-up compiled, whatever a torch version guards on.
    """
    start = tensor.storage_offset() * tensor.element_size()
    storage = tensor.untyped_storage()[start:start + tensor.numel() * tensor.element_size()]
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
        storage, 0, tensor.shape, tensor.stride())


class OnePassAdamW:
    """AdamW for mixed precision on the CPU: reads the gradient in the compute dtype and writes
    the new compute-dtype weights in the same pass over memory. Built from C for this machine
    where it can be (native.py: the same results, faster), else compiled by inductor, else
    torch's fused kernel and a cast.

    The fused kernel needs an fp32 gradient and leaves the cast to a second pass, so a step
    costs 2 + 28 + 6 bytes of DRAM traffic per parameter against this one's 28 (bf16 gradient
    in; master and moments in and out; bf16 weights out). On the reference box the same
    ``torch.compile``d function ran 2.78 B parameters in 0.630 s, against 1.04 s for fused AdamW
    with the casts done by ``copy_``. It is compiled on first use, on the thread that calls it
    (the compiled code takes that thread's intra-op thread count); if compiling fails (no C++
    compiler), the fused kernel and a separate cast do the same work, with a warning.
    """

    def __init__(self, native: bool = True):
        """``native``: use the kernel built from C where there is one (False: inductor's, as
        the benchmark compares them)."""
        self._native = native
        self._compiled: Callable[..., None] | None = None
        self._failed = False

    def warm_up(self, grad_dtype: torch.dtype, weights_dtype: torch.dtype) -> None:
        """Compile now, so that no step compiles: a compile on the worker costs seconds (a
        minute on a cold GPU box), and dynamo saves and restores the process's RNG state
        around it, which would replay random numbers the training thread drew meanwhile.

        On shard-sized inputs: inductor decides from the sizes it first sees whether the loop
        runs on the thread pool, and code compiled on 64 elements stayed serial for every later
        size (6x slower on the reference box's 15 threads). Then on one element, a variant of
        its own (dynamo specializes size 1): a parameter of one element in a param group of
        its own, or a shard or piece boundary one element into a run, steps one element.
        """
        if self._native and native_step(grad_dtype, weights_dtype) is not None:
            return  # built (or loaded from the cache) now, nothing to compile
        import torch._inductor.config as inductor_config

        # Trust the vector instruction sets the CPU lists. Otherwise inductor checks each one
        # by building a test library and loading it in a child process, which in torch 2.11
        # (not 2.13) imports torch: seconds per child with a CUDA build, in every process.
        # This skips 3 of the 6 children a cold compile starts on the development machine
        # (the checks of extensions such as AVX512-BF16 still run); the cold compile there
        # fell from 10 s to 5.5 s. Inductor caches some answers for the process (the
        # AVX512 family's), so later compiles may trust them too, as torch's own internal
        # builds always do. A compiler unable to build an instruction set the CPU lists fails
        # this compile, and step() falls back to fused AdamW for the run, where inductor would
        # have chosen a lesser instruction set.
        with inductor_config.patch({"cpp.vec_isa_ok": True}):
            for numel in (WARM_UP_NUMEL, 1):
                self.step(torch.zeros(numel), torch.zeros(numel, dtype=grad_dtype),
                          torch.zeros(numel), torch.zeros(numel),
                          torch.empty(numel, dtype=weights_dtype), torch.ones(()),
                          AdamWHyper(0.0, 0.9, 0.999, 1e-8, 0.0), 1.0)

    def step(self, master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
             exp_avg_sq: torch.Tensor, weights: torch.Tensor, step: torch.Tensor,
             hyper: AdamWHyper, grad_divisor: float) -> None:
        # Before the try: a caller's mistake must not disable the compiled kernel for the run.
        _require_contiguous(master, grad, exp_avg, exp_avg_sq, weights)
        scalars = _one_pass_scalars(hyper, float(step), grad_divisor)
        native = native_step(grad.dtype, weights.dtype) if self._native else None
        if native is not None:
            native(master, grad, exp_avg, exp_avg_sq, weights, scalars)
            return
        if not self._failed:
            try:
                if self._compiled is None:
                    # The C++ wrapper lets go of the GIL while the kernel runs; inductor's
                    # default Python bindings hold it, and the training thread then stalled
                    # for each 17 ms unit step, leaving the GPU idle (forward and backward
                    # took 0.6 s instead of 0.27 s beside the delayed update).
                    self._compiled = torch.compile(_adamw_one_pass, dynamic=True,
                                                   options={"cpp_wrapper": True})
                self._compiled(*(_alone(t) for t in (master, grad, exp_avg, exp_avg_sq,
                                                     weights)), scalars)
                return
            except Exception as error:  # no compiler, or an inductor failure: stay correct
                self._failed = True
                warnings.warn(f"tiered: compiling the one-pass AdamW failed ({error}); using "
                              f"fused AdamW and a separate cast instead")
        divisor = None if grad_divisor == 1.0 else torch.tensor(grad_divisor)
        adamw_step(master, grad.float(), exp_avg, exp_avg_sq, step, hyper, divisor)
        weights.copy_(master)


def one_pass_for(compute_dtype: torch.dtype, grad_dtypes: set[torch.dtype],
                 optimizer_device: torch.device, worker) -> OnePassAdamW | None:
    """The one-pass kernel for mixed precision with the optimizer on the CPU, built from C (or
    loaded from the cache) or else compiled now on ``worker`` (the thread that will run it:
    inductor bakes its intra-op thread count into the code, the native kernel reads it);
    ``None`` where torch's fused kernel serves (fp32 keeps it, bit for bit, as does a GPU).

    Returns once compiled, a variant per gradient dtype in ``grad_dtypes``: a cold compile took
    about a minute on the reference box, which the first step would otherwise pay. Before the DRAM
    tier pins its slabs: a ``fork()`` of a process holding 16 GiB pinned took 11 s there (Linux
    copies DMA-pinned pages into the child); the compiler's children measured no slower, since
    ``subprocess`` does not copy the parent's memory, but nothing depends on that.
    """
    if optimizer_device.type != "cpu" or compute_dtype is torch.float32:
        return None
    one_pass = OnePassAdamW()
    for grad_dtype in sorted(grad_dtypes, key=str):  # each is a compiled variant
        worker.submit(partial(one_pass.warm_up, grad_dtype, compute_dtype))
    worker.drain()
    return one_pass
