"""One unit's life in a step: gathered when needed (or ahead, along the trace), released, its
gradient reduced and handed to the CPU worker.

Units arrive on the gather stream (gather.py, [Note: gather stream]), ahead of need when the
prefetcher says so ([Note: trace] in prefetch.py); gradients leave on the offload stream
([Note: offload stream] in streams.py) and are added into the grads tier by the CPU worker.
"""
from __future__ import annotations

import threading
from functools import partial

import torch

from ..errors import TieredError
from ..manager import TierManager
from ..optim.workers import CpuWorker
from ..plan import GRAD_LANDING_SLOTS, prefetch_limit, reduce_dtype
from ..policy import ComputeDtype, Policy, Tier
from ..prefetch import Prefetcher
from .collectives import ProcessGroup
from .flat import FlatParam
from .gather import Gatherer
from .readahead import ReadAhead
from .streams import Streams, wait_for
from ..timeline import Timeline


class UnitRuntime:
    def __init__(self, flats: list[FlatParam], manager: TierManager, group: ProcessGroup,
                 policy: Policy, worker: CpuWorker, timeline: Timeline):
        self.flats = flats
        self.timeline = timeline
        self.manager = manager
        self.group = group
        self.worker = worker
        self.streams = Streams(group.device)
        self.reduce_dtype = reduce_dtype(policy, group.world_size)
        self.grad_device = manager.grad_device()
        self.accumulation_steps = policy.optimizer.accumulation_steps
        self.backwards_since_step = 0
        # Stepping a unit as its gradient arrives needs the step's last backward to be known
        # (accumulation_steps) and no global norm first (clipping, fp16 overflow checks).
        # The delayed update steps at optimizer.step() by design.
        self.arrival_allowed = (self.accumulation_steps is not None
                                and policy.optimizer.max_grad_norm is None
                                and policy.compute_dtype is not ComputeDtype.FP16
                                and not policy.optimizer.delayed_update.enabled)
        self.step_on_arrival = False
        self._grads_in_flight = threading.Semaphore(GRAD_LANDING_SLOTS)
        """Backward waits for the worker once this many gradients are on their way to it."""
        self.on_grad_added = None
        """Set by the optimizer: called on the CPU worker with a unit whose gradient of the
        step's last backward has just been added, when stepping on arrival."""
        self.has_grad = [False] * len(flats)
        """Whether unit i's gradient shard holds a sum since the last ``zero_grad``."""
        self.readahead = (ReadAhead(manager, manager.staging_names("param_in"), timeline)
                          if policy.params.tier is Tier.NVME else None)
        self.gatherer = Gatherer(flats, manager, group, self.streams, self.readahead, timeline)
        self.prefetcher = Prefetcher([f.gathered_bytes for f in flats], policy.prefetch,
                                     prefetch_limit(policy, [f.padded_numel for f in flats]))

    @property
    def hbm_usage(self):
        return self.manager.hbm.usage

    def use(self, flat: FlatParam) -> None:
        """``flat`` is needed now (its forward, or its first use in a backward): gather it if it
        is not, and start gathering what the trace says comes next (see [Note: trace])."""
        self.prefetcher.need(flat.spec.index)
        self.gatherer.finish(flat)
        for index in self.prefetcher.to_fetch(self.gatherer.is_gathered):
            self.gatherer.start(self.flats[index])
        if self.readahead is not None:
            for index in self.prefetcher.upcoming(self.gatherer.is_gathered):
                if not self.readahead.read_ahead(index):
                    break

    def gather(self, flat: FlatParam) -> None:
        """Make sure ``flat`` is gathered and usable (a later use within the same need)."""
        self.gatherer.finish(flat)

    def done(self, flat: FlatParam) -> None:
        """``flat``'s forward is over: release it, unless the trace needs it again soon."""
        if not self.prefetcher.keep(flat.spec.index):
            self.gatherer.release(flat)

    def end_iteration(self) -> None:
        """A forward-backward (or a forward without grad) is over: nothing stays gathered."""
        self.prefetcher.end_iteration()
        if self.readahead is not None:
            self.readahead.discard()
        self.gatherer.release_all()
        self.timeline.flush()

    def owner_of(self, tensor: torch.Tensor) -> FlatParam | None:
        return self.gatherer.owner_of(tensor)

    def reduce_grad(self, flat: FlatParam) -> None:
        """Average the unit's full gradient over ranks into this rank's shard, send the shard on
        its way to the grads tier (the CPU worker adds it in), and drop the full gradient and the
        gathered weights. See [Note: offload stream] in streams.py."""
        grad = flat.full.grad
        flat.full.grad = None
        index = flat.spec.index
        overwrite = not self.has_grad[index]
        self.has_grad[index] = True
        self._grads_in_flight.acquire()
        transient = grad.numel() * grad.element_size()
        self.hbm_usage.acquire(transient, f"gradient of unit {flat.name}")
        landing = None
        with self.streams.on_offload():
            begin = self.timeline.mark()
            if self.group.world_size > 1:
                full32 = grad.to(self.reduce_dtype)
                shard = torch.empty(flat.shard_numel, dtype=self.reduce_dtype, device=grad.device)
                extra = (full32.numel() * 4 if full32 is not grad else 0) + shard.numel() * 4
                self.hbm_usage.acquire(extra, f"fp32 gradient reduction of unit {flat.name}")
                transient += extra
                self.group.reduce_scatter_mean(shard, full32)
                del full32
            else:
                shard = grad
            if shard.device != self.grad_device:
                landing, shard = self.manager.land_grad(shard)
            ready = self.streams.record()
            self.timeline.between(f"reduce+offload {flat.name}", "d2h", "offload stream", begin,
                                  self.timeline.mark())
        self.streams.keep_for_offload(grad)
        del grad
        self.gatherer.release(flat)
        self.worker.submit(partial(self._add_grad, index, shard, ready, landing, overwrite,
                                   transient, self.step_on_arrival))

    def _add_grad(self, index: int, shard: torch.Tensor, ready, landing: str | None,
                  overwrite: bool, transient: int, step_now: bool) -> None:
        """CPU worker: add one landed gradient shard into the grads tier."""
        wait_for(ready, shard)
        with self.timeline.span(f"add grad {self.flats[index].name}", "cpu"):
            self.manager.accumulate_grad(index, shard, overwrite)
        if landing is not None:
            self.manager.return_landing(landing)
        del shard
        self.hbm_usage.release(transient)
        self._grads_in_flight.release()
        if step_now:
            self.on_grad_added(index)

    def zero_grad(self, set_to_none: bool) -> None:
        """``set_to_none`` only forgets the sums (the next backward overwrites); otherwise the
        shards are zeroed (by the worker, after whatever update may still read them) and count as
        gradients of zero, as in PyTorch."""
        for i in range(len(self.flats)):
            if not set_to_none:
                self.worker.submit(partial(self.manager.zero_grad, i))
            self.has_grad[i] = not set_to_none

    def start_backward(self) -> None:
        """Count a backward towards the next step; the last one before it steps on arrival."""
        limit = self.accumulation_steps
        self.backwards_since_step += 1
        if limit is not None and self.backwards_since_step > limit:
            raise TieredError(
                f"backward number {self.backwards_since_step} since the last optimizer.step(), "
                f"but optimizer.accumulation_steps is {limit}: units were already stepped with "
                f"the gradients of backward {limit}; set accumulation_steps to the number of "
                f"backward calls per step (or null)")
        self.step_on_arrival = self.arrival_allowed and self.backwards_since_step == limit
