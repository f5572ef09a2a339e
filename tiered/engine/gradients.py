"""A unit's gradient, from the end of its backward to the grads tier where the optimizer reads it.

[Note: gradient states]
Each unit's fp32 grads-tier buffer holds one of (the host's GradState, optim/host.py):
- nothing (no gradient since ``zero_grad``);
- *pending*: the gradient of a single backward in the compute dtype, in the first half of the
  buffer's bytes. It is copied there straight from the device (a bf16 shard is never widened),
  and the one-pass AdamW reads it as it is;
- *sum*: an fp32 sum, once a second backward adds to it (or when gradients are fp32 anyway).
A first gradient goes from the offload stream straight into the buffer; a later one lands in a
pinned landing buffer and the host (optim/host.py) widens the pending one and adds. The states
change only on the host, in the order of its commands.

With ``accumulation_steps: 1`` under bf16 or fp16 the buffer is *compact*, allocated in the
compute dtype (plan.state_dtype): a second backward per step is refused, so no sum ever needs
fp32. It holds nothing or the gradient in its own dtype (a reduced fp32 shard of several ranks
is narrowed on its way in), which is the buffer's: a *sum* in the host's terms. A later gradient still comes after ``zero_grad(set_to_none=False)``,
whose zeros count as gradients; the host adds it in the compute dtype, which is exact on zeros.

[Note: buffer hand-off]
With the delayed update, step t+1's backward produces a unit's gradient while step t's update
may not yet have read the previous one from the same buffer. So each buffer is FREE (may be
filled), TAKEN (the training thread is filling it; the host has not seen it yet) or HELD (the
host has it; an update will read it), as the training side knows it (buffers.py). Backward waits
for FREE before a first gradient; the host's events make a buffer HELD when the gradient (or
``zero_grad``'s zeros) is in and FREE when an update has read it or ``zero_grad`` drops it. A
TAKEN buffer is never freed that way: that gradient belongs to a backward after the command.
Updates step units in the order their gradients arrived, so backward waits only when it catches
up with the CPU. (Units stepped as their gradients arrive, without the delayed update, are
stepped in the next forward's order instead: see LastBackward.) Every wait here also ends, with
an error, if the host fails: a command it skipped would otherwise never free what backward
waits for.

[Note: gradients in flight]
Up to ``grads.landing_slots`` gradients may hold device bytes (the unit's full gradient, and with
several ranks its fp32 reduction) on their way to the grads tier: the working set plan.py budgets.
Those bytes are free once the copy off the device has run (the allocator knows it through
``record_stream``), so the thread running backward releases them when the copy's event has
completed (checked at each gradient), and at the limit it waits for the oldest copy on the GPU,
not for the host, whose commands may hold a whole update ahead of the gradient (the delayed
update's, or units stepped on arrival). The host releases one if it takes it in first
(HostEvents.gradient_taken, naming it by its ticket): a host shard once it has waited for the
copy, a device shard once its own stream is ordered after the copy (the bytes are then freed as
that stream reaches them, so the count may run one gradient ahead of the allocator). Two kinds
of gradient do wait for the host: one it adds on the device itself (grads kept in HBM), and a
later gradient of a step, which needs a landing buffer that only the host gives back once it
has added the gradient in; so the second backward of a step with accumulation does wait behind
a delayed update still running.
"""
from __future__ import annotations

from collections import deque

import torch

from ..optim.arrival import LastBackward
from ..optim.commands import GradientIn, ZeroGrad
from ..placement.plan import StateKind, reduce_dtype, state_dtype
from .buffers import InFlight
from .context import EngineContext
from .flat import FlatParam


class GradientPath:
    """The thread running backward's half of a gradient's way: reduce, copy off the device,
    send to the host (optim/host.py), which takes it into the grads tier."""

    def __init__(self, context: EngineContext):
        flats, manager, policy = context.flats, context.manager, context.policy
        self.flats = flats
        self.manager = manager
        self.group = context.group
        self.host = context.host
        self.buffers = context.buffers
        self.streams = context.streams
        self.timeline = context.timeline
        self.reduce_dtype = reduce_dtype(policy, self.group.world_size)
        self.buffer_dtype = state_dtype(policy, StateKind.GRAD)
        """fp32, or the compute dtype for compact buffers (see [Note: gradient states])."""
        self.has_grad = [False] * len(flats)
        """Whether unit i has a gradient since ``zero_grad`` (as the training thread sees it)."""
        self._copies: deque[InFlight] = deque()
        """The thread running backward's: gradients the copy off the device frees, oldest
        first."""

    @property
    def usage(self):
        return self.manager.hbm.usage

    def reduce(self, flat: FlatParam, last: LastBackward | None) -> None:
        """Average the unit's full gradient over ranks into this rank's shard and send it to the
        grads tier; the caller then releases the gathered weights. See [Note: offload stream]."""
        index = flat.spec.index
        first = not self.has_grad[index]
        # Not in HBM: under tier: auto's units kept on the device, or with every gradient there.
        on_host = self.manager.grad_device(index).type == "cpu"
        needs_landing = not first and on_host and (
            flat.full.device.type != "cpu" or self.host.lands_every_gradient)
        self._retire_copies(wait=True)
        landing = self.buffers.reserve(index, first, needs_landing)
        transient = 0
        try:
            grad = flat.full.grad
            assert grad is not None, f"unit {flat.name} reduced before its gradient was complete"
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
            ticket, in_flight = self.buffers.sent(ready, transient)
            named = first or landing is not None  # in a buffer the host knows by name
            try:
                self.host.send(GradientIn(index, shard.dtype, shard.numel(), first, landing, last,
                                          ticket, ready, None if named else shard))
            except BaseException:
                self.buffers.forget(ticket)
                raise
        except BaseException:
            self.usage.release(transient)
            self.buffers.unreserve(index, first, landing)
            raise
        self.has_grad[index] = True
        if named:  # what the host reads is in the grads tier or DRAM
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

    def _retire_copies(self, wait: bool) -> None:
        """The thread running backward: release the gradients whose copy off the device has
        run; with ``wait``, while at the limit, wait on the GPU for the oldest copy (see [Note:
        gradients in flight])."""
        while self._copies:
            oldest = self._copies[0]
            if not oldest.released and not oldest.copied():
                if not wait or not self.buffers.waiting_for_copies():
                    return
                oldest.event.synchronize()
            self._copies.popleft()
            self.buffers.release(oldest)

    def zero_grad(self, set_to_none: bool) -> None:
        """``set_to_none`` forgets the gradients (the next backward starts new ones); otherwise
        they become zeros in the buffer's dtype, counted as gradients, as in PyTorch. A unit
        without a gradient keeps none either way, as ``torch.optim`` zeroes only the ``.grad``
        that exist: counted as a zero gradient it would be stepped (weight decay, moments) where
        PyTorch skips it. Done by the host, after whatever update may still read them."""
        self.host.send(ZeroGrad(set_to_none))
        self.has_grad = [had and not set_to_none for had in self.has_grad]
