"""One unit's life in a step: gathered when needed (or ahead, along the trace), released, its
gradient reduced and sent to the host (optim/host.py).

Units arrive on the gather stream (gather.py, [Note: gather stream]), ahead of need when the
prefetcher says so ([Note: trace] in prefetch.py); gradients leave on the offload stream
([Note: offload stream] in streams.py) and are taken into the grads tier by the host.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import torch

from ..core.errors import TieredError
from ..optim.adamw import AdamWHyper
from ..optim.arrival import LastBackward
from ..placement.plan import StateKind, activation_slots, prefetch_limit
from ..placement.units import module_groups
from ..planning.planner import MEASURED_MARGIN_SHARE
from ..policy.kinds import ComputeDtype, Tier
from .context import EngineContext
from .flat import FlatParam
from .gather import Gatherer
from .activations_nvme import NvmeSpill
from .gradients import GradientPath
from .offloaded_activations import SavedActivations
from .prefetch import Prefetcher
from .probe import StepProbe
from .readahead import ReadAhead
from .replan import Replan

_log = logging.getLogger("tiered")


class UnitRuntime:
    def __init__(self, context: EngineContext):
        flats, manager, policy, timeline = (context.flats, context.manager, context.policy,
                                            context.timeline)
        self.flats = flats
        self.timeline = timeline
        self.manager = manager
        self.group = context.group
        self.worker = context.worker
        self.host = context.host
        self.streams = context.streams
        self.step_state = context.step_state
        # Stepping a unit as its gradient arrives needs the step's last backward to be known
        # (accumulation_steps) and no global norm first (clipping, fp16 overflow checks).
        # The delayed update steps at optimizer.step() by design. A host that keeps step
        # records (the service's) steps only committed steps (see [Note: reattach] in
        # service/commits.py), and a step is committed at optimizer.step().
        self.arrival_allowed = (policy.optimizer.accumulation_steps is not None
                                and policy.optimizer.max_grad_norm is None
                                and policy.compute_dtype is not ComputeDtype.FP16
                                and not policy.optimizer.delayed_update.enabled
                                and not context.host.records_steps)
        self.stepped_on_arrival: set[int] = set()
        """Units whose gradient came in the backward that steps them on arrival: the worker
        steps each (the view of the thread running backward, complete once backward returns).
        Per-unit bookkeeping of the step's last backward (step_state.last_backward), not a
        phase."""
        self.grads = GradientPath(context)
        self.probe = StepProbe(context.group.device, len(flats))
        """What each step measured (engine.plan_report() shows the last)."""
        staging = manager.current_plan.staging
        spill = None
        if manager.activations_file is not None:  # see [Note: activations on NVMe]
            spill = NvmeSpill(manager.activations_file, manager.staging_block("activations_io"),
                              activation_slots(policy)[1], context.streams,
                              context.group.device)
        self.activations = SavedActivations(
            policy.activations, context.group.device, context.streams,
            manager.staging_block("activations") if "activations" in staging else None,
            self.probe.saved, self.probe.saved_in_dram, spill, self.probe.saved_on_nvme)
        """What the forwards save for backward (see [Note: activations in DRAM])."""
        self.replan = (Replan(context) if policy.placed_by_planner and policy.hbm.reserve is None
                       else None)
        """``tier: auto``'s re-plan after the first step (see [Note: re-plan])."""
        self.pending_weights = context.pending
        self.readahead = (ReadAhead(manager, manager.staging_names("param_in"),
                                    self.pending_weights, timeline)
                          if manager.staging_names("param_in") else None)
        self.gatherer = Gatherer(context, self.readahead, self.pending_weights)
        self.groups = module_groups([f.spec for f in flats])
        """Per unit, its module's first unit: the halves of a split module share one."""
        self.prefetcher = Prefetcher([f.gathered_bytes for f in flats], policy.prefetch,
                                     prefetch_limit(policy, [f.padded_numel for f in flats],
                                                    self.groups), self.groups)

    def use(self, flat: FlatParam) -> None:
        """``flat`` is needed now (its forward, or its first use in a backward): gather it if it
        is not, and start gathering what the trace says comes next (see [Note: trace])."""
        self.prefetcher.need(flat.spec.index)
        self.gatherer.finish(flat)
        for index in self.prefetcher.to_fetch(self.gatherer.is_gathered):
            self.gatherer.start(self.flats[index])
        if self.readahead is not None:
            for index in self.prefetcher.upcoming(self.gatherer.is_gathered):
                if self.manager.tier_of(index, StateKind.PARAM) is not Tier.NVME:
                    continue  # weights that live in DRAM need no reading ahead
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

    def forward_order(self, units: list[int]) -> list[int]:
        """``units`` in the order the last iteration first needed them (the next forward's
        order, when its control flow repeats); units it did not need come last."""
        rank = _first_needs(self.prefetcher.trace)
        return sorted(units, key=lambda unit: rank.get(unit, len(rank)))

    def owner_of(self, tensor: torch.Tensor) -> FlatParam | None:
        return self.gatherer.owner_of(tensor)

    def reduce_grad(self, flat: FlatParam) -> None:
        """The unit's gradient is complete: send it to the grads tier, release the weights."""
        last = self.step_state.last_backward
        step_on_arrival = last is not None and last.step_units
        if step_on_arrival:
            if flat.spec.index in self.stepped_on_arrival:
                raise TieredError(
                    f"unit {flat.name} received a second gradient in the backward that steps "
                    f"units as their gradients arrive (optimizer.accumulation_steps), after its "
                    f"update had started: its weights were used again in a separate backward "
                    f"pass, as reentrant activation checkpointing (use_reentrant=True) does "
                    f"around a shared module. Use use_reentrant=False, or accumulation_steps: "
                    f"null; this step's update of {flat.name} is incomplete")
            self.stepped_on_arrival.add(flat.spec.index)
            # The worker steps the unit once its gradient is in: until it has written the new
            # weights, a read of them (the next forward, before or after optimizer.step())
            # waits.
            self.pending_weights.expect([flat.spec.index])
        try:
            self.grads.reduce(flat, last)
        except BaseException:
            if step_on_arrival:  # it will not be stepped now
                self.stepped_on_arrival.discard(flat.spec.index)
                self.pending_weights.written([flat.spec.index])
            raise
        self.gatherer.release(flat)

    def backward_done(self, flat: FlatParam) -> None:
        """A unit without a gradient (only frozen parameters) is through its backward."""
        self.gatherer.release(flat)

    def start_backward(self, hypers: Callable[[], tuple[AdamWHyper, ...]]) -> None:
        """Count a backward towards the next step (the step state may refuse it); the last one
        before it steps on arrival, with ``hypers()`` (the optimizer's, as they are now)."""
        self.step_state.count_backward(partial(self._last_backward, hypers))
        self.stepped_on_arrival.clear()

    def _last_backward(self, hypers: Callable[[], tuple[AdamWHyper, ...]]) -> LastBackward:
        # The next forward runs as this iteration's did (or as the last complete one, when a
        # forward without grad closed this one).
        return LastBackward(
            step_units=self.arrival_allowed,
            forward_rank=_first_needs(self.prefetcher.recorded or self.prefetcher.trace),
            hypers=hypers() if self.arrival_allowed else None)

    def step_taken(self, measured: bool = False) -> None:
        """``optimizer.step()`` (``measured``: the step just run ends there, see probe.py) or a
        checkpoint's optimizer state restored: the next backward counts towards the next step,
        and the weights are about to change."""
        if measured:
            self.probe.step_taken()
        self.step_state.step_taken()
        self.stepped_on_arrival.clear()
        self.drop_gathered()
        if not measured or self.probe.last_activations is None:
            return
        on_device = self.probe.last_activations
        if self.activations.deciding:
            on_device += self._settle_activations()
        if self.replan_due:
            assert self.replan is not None  # replan_due says there is one
            self.replan.after_step(on_device, self.probe.last())

    def _settle_activations(self) -> int:
        """tier: auto's activations after the first measured step (see [Note: activations in
        DRAM]): the bytes they will add on the device from the next step (0: they stay in
        DRAM). Every rank decides alike: on the device only where they fit on every rank."""
        measured = self.probe.last()
        in_dram = 0 if measured is None else measured.activations_in_dram
        usage = self.manager.hbm.usage
        room = (usage.budget - usage.peak - usage.budget // MEASURED_MARGIN_SHARE
                - (self.probe.last_activations or 0))
        fits = self.group.smallest(room - in_dram) >= 0  # a collective, on every rank
        moved = self.activations.settle(in_dram, room, fits)
        if self.group.rank == 0 and self.activations.outcome is not None:
            _log.info("tiered: %s", self.activations.outcome)
        return in_dram if moved else 0

    @property
    def replan_due(self) -> bool:
        """Whether the next ``optimizer.step()`` re-plans (see [Note: re-plan]): it finishes
        the update before it, whatever the mode, so that no unit is being stepped."""
        return self.replan is not None and self.replan.due

    def drop_gathered(self) -> None:
        """Release every gathered unit and drop the NVMe shards read ahead: they hold the
        weights as they were. Units are normally released when an iteration ends, but a forward
        with grad enabled whose backward never comes (a metric computed after the backward, a
        forward that raised) leaves the ones the trace kept or prefetched for that backward
        gathered; the next forward would compute on them, not on the new weights."""
        self.step_state.weights_changed()
        self.prefetcher.drop_ahead()
        if self.readahead is not None:
            self.readahead.discard()
        self.gatherer.release_all()


def _first_needs(needs: list[int]) -> dict[int, int]:
    """Unit -> its place among the units of ``needs`` (an iteration's needs), by first need."""
    rank: dict[int, int] = {}
    for unit in needs:
        rank.setdefault(unit, len(rank))
    return rank
