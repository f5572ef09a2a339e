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

With ``accumulation_steps: 1`` under bf16 or fp16 the buffer is *compact*, allocated in the
compute dtype (plan.state_dtype): a second backward per step is refused, so no sum ever needs
fp32. It holds nothing or the gradient in its own dtype (a reduced fp32 shard of several ranks
is narrowed on its way in). A later gradient still comes after ``zero_grad(set_to_none=False)``,
whose zeros count as gradients; the worker adds it in the compute dtype, which is exact on zeros.

[Note: buffer hand-off]
With the delayed update, step t+1's backward produces a unit's gradient while step t's update
may not yet have read the previous one from the same buffer. So each buffer is FREE (may be
filled), TAKEN (the training thread is filling it; the worker has not seen it yet) or HELD (the
worker has it; an update will read it). Backward waits for FREE before a first gradient; the
worker makes a buffer HELD when the gradient arrives and FREE when an update has read it or
``zero_grad`` drops it. ``zero_grad`` never frees a TAKEN buffer: that gradient belongs to a
backward after it. Updates step units in the order their gradients arrived, so backward waits
only when it catches up with the CPU. (Units stepped as their gradients arrive, without the
delayed update, are stepped in the next forward's order instead: see LastBackward.) Every wait
here also ends, with an error, if the worker fails: a task it skipped would otherwise never free
what backward waits for.

[Note: gradients in flight]
Up to GRAD_LANDING_SLOTS gradients may hold device bytes (the unit's full gradient, and with
several ranks its fp32 reduction) on their way to the grads tier: the working set plan.py budgets.
Those bytes are free once the copy off the device has run (the allocator knows it through
``record_stream``), so the thread running backward releases them when the copy's event has
completed (checked at each gradient), and at the limit it waits for the oldest copy on the GPU,
not for the CPU worker, whose queue may hold a whole update ahead of the gradient (the delayed
update's, or units stepped on arrival). The worker releases one if it takes it in first: a host
shard once it has waited for the copy, a device shard once its own stream is ordered after the
copy (the bytes are then freed as that stream reaches them, so the count may run one gradient
ahead of the allocator). Two kinds of gradient do wait for the worker: one it adds on the device
itself (grads kept in HBM), and a later gradient of a step, which needs a landing buffer that
only the worker gives back once it has added the gradient in; so the second backward of a step
with accumulation does wait behind a delayed update still running.
"""
from __future__ import annotations

import enum
import threading
from collections import deque
from functools import partial

import torch

from ..optim.arrival import LastBackward
from ..plan import GRAD_LANDING_SLOTS, StateKind, reduce_dtype, state_dtype
from .context import EngineContext
from .flat import FlatParam
from .streams import wait_for


class BufferState(enum.Enum):
    FREE = "free"
    TAKEN = "taken"
    HELD = "held"


class _InFlight:
    """One gradient's device bytes on their way to the grads tier (see [Note: gradients in
    flight]): released once, by whichever thread sees its copy complete first."""

    __slots__ = ("event", "nbytes", "released")

    def __init__(self, event, nbytes: int):
        self.event = event
        self.nbytes = nbytes
        self.released = False

    def copied(self) -> bool:
        return self.event is None or self.event.query()


class GradientPath:
    def __init__(self, context: EngineContext):
        flats, manager, worker, policy = (context.flats, context.manager, context.worker,
                                          context.policy)
        self.flats = flats
        self.manager = manager
        self.group = context.group
        self.worker = worker
        self.streams = context.streams
        self.timeline = context.timeline
        self.reduce_dtype = reduce_dtype(policy, self.group.world_size)
        self.buffer_dtype = state_dtype(policy, StateKind.GRAD)
        """fp32, or the compute dtype for compact buffers (see [Note: gradient states])."""
        self.has_grad = [False] * len(flats)
        """Whether unit i has a gradient since ``zero_grad`` (as the training thread sees it)."""
        self.dtype: list[torch.dtype | None] = [None] * len(flats)
        """What unit i's buffer holds (see [Note: gradient states]); the worker's view."""
        self.arrival_order: list[int] = []
        """Units in the order their first gradient since ``zero_grad`` arrived (worker's view):
        the order an update steps them in, see [Note: buffer hand-off]."""
        self._changed = threading.Condition()
        """Guards the three below; notified whenever one changes or the worker fails."""
        self._buffers = [BufferState.FREE] * len(flats)
        self._in_flight = 0
        """Gradients holding device bytes; backward waits at GRAD_LANDING_SLOTS."""
        self.last_backward_queued = 0
        """Gradients of the step's last backward submitted to the worker and not yet taken in
        (changed under _changed; the worker reads it, a plain int, to see whether more come)."""
        self._copies: deque[_InFlight] = deque()
        """The thread running backward's: gradients the copy off the device frees, oldest
        first."""
        self._grads_on_host = manager.grad_device().type == "cpu"
        self._landing = manager.staging_names("grad")
        """Free pinned landing buffers (for gradients after a step's first)."""
        worker.on_failure(self._wake)
        self.on_last = None
        """Called on the worker with a unit whose gradient of the step's last backward is in,
        and that backward's LastBackward: complete until the step (set by the optimizer)."""

    @property
    def usage(self):
        return self.manager.hbm.usage

    def reduce(self, flat: FlatParam, last: LastBackward | None) -> None:
        """Average the unit's full gradient over ranks into this rank's shard and send it to the
        grads tier; the caller then releases the gathered weights. See [Note: offload stream]."""
        index = flat.spec.index
        first = not self.has_grad[index]
        needs_landing = not first and flat.full.device.type != "cpu" and self._grads_on_host
        landing = self._reserve(index, first, needs_landing)
        transient = 0
        try:
            grad = flat.full.grad
            flat.full.grad = None
            nbytes = grad.numel() * grad.element_size()
            self.usage.acquire(nbytes, f"gradient of unit {flat.name}")
            transient = nbytes  # only once counted: a refusal leaves nothing to give back
            with self.streams.on_offload():
                begin = self.timeline.mark()
                shard, extra = self._reduce(flat, grad)
                transient += extra
                if first:
                    target = self.manager.grad_buffer(index, self._first_dtype(shard.dtype))
                    target.copy_(shard, non_blocking=True)
                    shard = target
                elif landing is not None:
                    shard = self.manager.land_grad(landing, shard)
                ready = self.streams.record()
                self.timeline.between(f"reduce+offload {flat.name}", "d2h", "offload stream",
                                      begin, self.timeline.mark())
            self.streams.keep_for_offload(grad)
            del grad
            in_flight = _InFlight(ready, transient)
            task = self._arrived if first else self._add
            self._count_last(last, 1)  # before the worker can see the task
            try:
                self.worker.submit(partial(task, index, shard, ready, landing, in_flight, last))
            except BaseException:
                self._count_last(last, -1)
                raise
        except BaseException:
            self.usage.release(transient)
            self._unreserve(index, first, landing)
            raise
        self.has_grad[index] = True
        if first or landing is not None:  # what the worker reads is in the grads tier or DRAM
            self._copies.append(in_flight)
            self._retire_copies(wait=False)

    def _first_dtype(self, shard_dtype: torch.dtype) -> torch.dtype:
        """What a first gradient is kept as: the shard's own dtype in an fp32 buffer (pending or
        sum), else the compact buffer's dtype."""
        return shard_dtype if self.buffer_dtype is torch.float32 else self.buffer_dtype

    def _reduce(self, flat: FlatParam, grad: torch.Tensor) -> tuple[torch.Tensor, int]:
        """This rank's shard of the rank-averaged gradient, and the extra device bytes held."""
        if self.group.world_size == 1:
            return grad, 0
        full32 = grad.to(self.reduce_dtype)
        shard = torch.empty(flat.shard_numel, dtype=self.reduce_dtype, device=grad.device)
        extra = (full32.numel() * 4 if full32 is not grad else 0) + shard.numel() * 4
        self.usage.acquire(extra, f"fp32 gradient reduction of unit {flat.name}")
        try:
            self.group.reduce_scatter_mean(shard, full32)
        except BaseException:
            self.usage.release(extra)
            raise
        return shard, extra

    def _reserve(self, index: int, first: bool, needs_landing: bool) -> str | None:
        """The thread running backward: wait for room on the way to the grads tier (and, for a
        first gradient, for the unit's buffer to be FREE); returns a landing buffer when one is
        needed."""
        self._retire_copies(wait=True)
        with self._changed:
            self._changed.wait_for(lambda: self.worker.failed or (
                self._in_flight < GRAD_LANDING_SLOTS
                and (not first or self._buffers[index] is BufferState.FREE)
                and (not needs_landing or self._landing)))
            self.worker.raise_if_failed()
            self._in_flight += 1
            if first:
                self._buffers[index] = BufferState.TAKEN
            return self._landing.pop() if needs_landing else None

    def _retire_copies(self, wait: bool) -> None:
        """The thread running backward: release the gradients whose copy off the device has
        run; with ``wait``, while at the limit, wait on the GPU for the oldest copy (see [Note:
        gradients in flight])."""
        while self._copies:
            oldest = self._copies[0]
            if not oldest.released and not oldest.copied():
                if not wait or self._in_flight < GRAD_LANDING_SLOTS:
                    return
                oldest.event.synchronize()
            self._copies.popleft()
            self._release(oldest)

    def _release(self, in_flight: _InFlight) -> None:
        with self._changed:
            if in_flight.released:
                return
            in_flight.released = True
            self._in_flight -= 1
            self._changed.notify_all()
        self.usage.release(in_flight.nbytes)

    def _unreserve(self, index: int, first: bool, landing: str | None) -> None:
        with self._changed:
            self._in_flight -= 1
            if first:
                self._buffers[index] = BufferState.FREE
            if landing is not None:
                self._landing.append(landing)
            self._changed.notify_all()

    def _arrived(self, index: int, shard: torch.Tensor, ready, landing,
                 in_flight: _InFlight, last: LastBackward | None) -> None:
        """Worker: a first gradient is in its buffer (pending, an fp32 sum, or compact)."""
        wait_for(ready, shard)
        self.dtype[index] = shard.dtype
        self.arrival_order.append(index)
        with self._changed:
            self._buffers[index] = BufferState.HELD
        self._done(in_flight, index, last, landing)

    def _add(self, index: int, shard: torch.Tensor, ready, landing: str | None,
             in_flight: _InFlight, last: LastBackward | None) -> None:
        """Worker: add a later gradient into the buffer in its dtype: the fp32 sum (widening a
        pending one first), or a compact buffer as it is (see [Note: gradient states])."""
        wait_for(ready, shard)
        with self.timeline.span(f"add grad {self.flats[index].name}", "cpu"):
            if self.dtype[index] is not self.buffer_dtype:
                pending = self.manager.grad_buffer(index, self.dtype[index]).clone()
                self.manager.grad_buffer(index, torch.float32).copy_(pending)
            self.manager.grad_buffer(index, self.buffer_dtype).add_(shard)
            self.dtype[index] = self.buffer_dtype
        del shard
        with self._changed:
            # An update has read the buffer since it was filled (a step without zero_grad in
            # between): the next one reads this sum, so backward must not fill it until then.
            self._buffers[index] = BufferState.HELD
        self._done(in_flight, index, last, landing)

    def _count_last(self, last: LastBackward | None, change: int) -> None:
        if last is not None:
            with self._changed:
                self.last_backward_queued += change

    def _done(self, in_flight: _InFlight, index: int, last: LastBackward | None,
              landing: str | None) -> None:
        self._release(in_flight)
        if landing is not None:
            with self._changed:
                self._landing.append(landing)
                self._changed.notify_all()
        self._count_last(last, -1)
        if last is not None:
            self.on_last(index, last)

    def read(self, index: int) -> torch.Tensor:
        """Worker: unit ``index``'s gradient as it is held (pending or compact in the compute
        dtype, or fp32)."""
        return self.manager.grad_buffer(index, self.dtype[index])

    def consumed(self, index: int) -> None:
        """Worker: the update has read unit ``index``'s gradient; its buffer may be refilled."""
        self._set_free(lambda i: i == index)

    def in_arrival_order(self, units: list[int]) -> list[int]:
        """Worker: ``units`` ordered as their gradients arrived (any others last)."""
        wanted = set(units)
        ordered = [i for i in self.arrival_order if i in wanted]
        seen = set(ordered)
        return ordered + [i for i in units if i not in seen]

    def zero_grad(self, set_to_none: bool) -> None:
        """``set_to_none`` forgets the gradients (the next backward starts new ones); otherwise
        they become zeros in the buffer's dtype, counted as gradients, as in PyTorch. A unit
        without a gradient keeps none either way, as ``torch.optim`` zeroes only the ``.grad``
        that exist: counted as a zero gradient it would be stepped (weight decay, moments) where
        PyTorch skips it. Done by the worker, after whatever update may still read them."""
        self.worker.submit(partial(self._zero, set_to_none))
        self.has_grad = [had and not set_to_none for had in self.has_grad]

    def _zero(self, set_to_none: bool) -> None:
        self.arrival_order = []
        with self._changed:
            # A TAKEN buffer is a backward's after this zero_grad: leave it alone. A frozen unit
            # has no buffer (plan.unit_state_kinds); one holding nothing stays so (zero_grad).
            units = [i for i, state in enumerate(self._buffers)
                     if state is not BufferState.TAKEN and self.flats[i].has_trainable
                     and (set_to_none or self.dtype[i] is not None)]
        for index in units:
            if set_to_none:
                self.dtype[index] = None
            else:
                self.manager.grad_buffer(index, self.buffer_dtype).zero_()
                self.dtype[index] = self.buffer_dtype
        if set_to_none:
            chosen = set(units)
            self._set_free(lambda i: i in chosen)
            return
        with self._changed:  # zeros are gradients the next update reads: HELD until it has
            for index in units:
                self._buffers[index] = BufferState.HELD

    def _set_free(self, which) -> None:
        with self._changed:
            for index, state in enumerate(self._buffers):
                if state is BufferState.HELD and which(index):
                    self._buffers[index] = BufferState.FREE
            self._changed.notify_all()

    def _wake(self) -> None:
        with self._changed:
            self._changed.notify_all()
