"""A unit's gradient, from the end of its backward to the grads tier where the optimizer reads it.

[Note: gradient states]
Each unit's fp32 grads-tier buffer holds one of:
- nothing (no gradient since ``zero_grad``);
- *pending*: the gradient of a single backward in the compute dtype, in the first half of the
  buffer's bytes. It is copied there straight from the device (a bf16 shard is never widened),
  and the one-pass AdamW reads it as it is;
- *sum*: an fp32 sum, once a second backward adds to it (or when gradients are fp32 anyway).
A first gradient goes from the offload stream straight into the buffer; a later one lands in a
pinned landing buffer and the CPU worker widens the pending one and adds. The states change only
on the CPU worker, in the order of its queue.

[Note: buffer hand-off]
With the delayed update, step t+1's backward produces a unit's gradient while step t's update
may not yet have read the previous one from the same buffer. Each unit's buffer is therefore
free or taken: the copy into it waits until the worker has freed it (the update stepped that
unit, or ``zero_grad`` dropped the gradient). Updates step units in the order their gradients
arrived, so backward waits only when it catches up with the CPU.
"""
from __future__ import annotations

import threading
from functools import partial

import torch

from ..manager import TierManager
from ..optim.workers import CpuWorker
from ..plan import GRAD_LANDING_SLOTS, reduce_dtype
from ..policy import Policy
from ..timeline import Timeline
from .collectives import ProcessGroup
from .flat import FlatParam
from .streams import Streams, wait_for


class GradientPath:
    def __init__(self, flats: list[FlatParam], manager: TierManager, group: ProcessGroup,
                 policy: Policy, worker: CpuWorker, streams: Streams, timeline: Timeline):
        self.flats = flats
        self.manager = manager
        self.group = group
        self.worker = worker
        self.streams = streams
        self.timeline = timeline
        self.reduce_dtype = reduce_dtype(policy, group.world_size)
        self.has_grad = [False] * len(flats)
        """Whether unit i has a gradient since ``zero_grad`` (as the training thread sees it)."""
        self.dtype: list[torch.dtype | None] = [None] * len(flats)
        """What unit i's buffer holds (see [Note: gradient states]); the worker's view."""
        self.arrival_order: list[int] = []
        """Units in the order their first gradient since ``zero_grad`` arrived (worker's view):
        the order an update steps them in, see [Note: buffer hand-off]."""
        self._free = [threading.Event() for _ in flats]
        for event in self._free:
            event.set()
        self._in_flight = threading.Semaphore(GRAD_LANDING_SLOTS)
        """Backward waits for the worker once this many gradients are on their way to it."""
        self.on_added = None
        """Called on the worker with a unit whose gradient of the step's last backward is in,
        when stepping on arrival (set by the optimizer)."""

    @property
    def usage(self):
        return self.manager.hbm.usage

    def reduce(self, flat: FlatParam, step_now: bool) -> None:
        """Average the unit's full gradient over ranks into this rank's shard and send it to the
        grads tier; the caller then releases the gathered weights. See [Note: offload stream]."""
        grad = flat.full.grad
        flat.full.grad = None
        index = flat.spec.index
        first = not self.has_grad[index]
        self.has_grad[index] = True
        self._in_flight.acquire()
        transient = grad.numel() * grad.element_size()
        self.usage.acquire(transient, f"gradient of unit {flat.name}")
        landing = None
        if first:
            self._free[index].wait()  # [Note: buffer hand-off]
            self._free[index].clear()
        with self.streams.on_offload():
            begin = self.timeline.mark()
            if self.group.world_size > 1:
                full32 = grad.to(self.reduce_dtype)
                shard = torch.empty(flat.shard_numel, dtype=self.reduce_dtype, device=grad.device)
                extra = (full32.numel() * 4 if full32 is not grad else 0) + shard.numel() * 4
                self.usage.acquire(extra, f"fp32 gradient reduction of unit {flat.name}")
                transient += extra
                self.group.reduce_scatter_mean(shard, full32)
                del full32
            else:
                shard = grad
            if first:
                target = self.manager.grad_buffer(index, shard.dtype)
                target.copy_(shard, non_blocking=True)
                shard = target
            elif shard.device.type != "cpu" and self.manager.grad_device().type == "cpu":
                landing, shard = self.manager.land_grad(shard)
            ready = self.streams.record()
            self.timeline.between(f"reduce+offload {flat.name}", "d2h", "offload stream", begin,
                                  self.timeline.mark())
        self.streams.keep_for_offload(grad)
        del grad
        task = self._arrived if first else self._add
        self.worker.submit(partial(task, index, shard, ready, landing, transient, step_now))

    def _arrived(self, index: int, shard: torch.Tensor, ready, landing, transient: int,
                 step_now: bool) -> None:
        """Worker: a first gradient is in its buffer (pending, or an fp32 sum)."""
        wait_for(ready, shard)
        self.dtype[index] = shard.dtype
        self.arrival_order.append(index)
        self._done(transient, index, step_now)

    def _add(self, index: int, shard: torch.Tensor, ready, landing: str | None, transient: int,
             step_now: bool) -> None:
        """Worker: add a later gradient into the fp32 sum (widening a pending one first)."""
        wait_for(ready, shard)
        with self.timeline.span(f"add grad {self.flats[index].name}", "cpu"):
            if self.dtype[index] is not torch.float32:
                pending = self.manager.grad_buffer(index, self.dtype[index]).clone()
                self.manager.grad_buffer(index, torch.float32).copy_(pending)
            self.manager.grad_buffer(index, torch.float32).add_(shard)
            self.dtype[index] = torch.float32
        if landing is not None:
            self.manager.return_landing(landing)
        del shard
        self._done(transient, index, step_now)

    def _done(self, transient: int, index: int, step_now: bool) -> None:
        self.usage.release(transient)
        self._in_flight.release()
        if step_now:
            self.on_added(index)

    def read(self, index: int) -> torch.Tensor:
        """Worker: unit ``index``'s gradient as it is held (pending dtype, or fp32)."""
        return self.manager.grad_buffer(index, self.dtype[index])

    def consumed(self, index: int) -> None:
        """Worker: the update has read unit ``index``'s gradient; its buffer may be refilled."""
        self._free[index].set()

    def zero_grad(self, set_to_none: bool) -> None:
        """``set_to_none`` forgets the gradients (the next backward starts new ones); otherwise
        they become fp32 zeros, counted as gradients, as in PyTorch. Done by the worker, after
        whatever update may still read them."""
        self.worker.submit(partial(self._zero, set_to_none))
        self.has_grad = [not set_to_none] * len(self.flats)

    def in_arrival_order(self, units: list[int]) -> list[int]:
        """Worker: ``units`` ordered as their gradients arrived (any others last)."""
        wanted = set(units)
        ordered = [i for i in self.arrival_order if i in wanted]
        return ordered + [i for i in units if i not in set(ordered)]

    def _zero(self, set_to_none: bool) -> None:
        self.arrival_order = []
        for index in range(len(self.flats)):
            if set_to_none:
                self.dtype[index] = None
            else:
                self.manager.grad_buffer(index, torch.float32).zero_()
                self.dtype[index] = torch.float32
            self._free[index].set()
