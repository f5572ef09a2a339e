"""The re-plan of ``tier: auto`` after the first step: more units kept on the device, once.

[Note: re-plan]
Before any step the planner cannot know what the forward keeps for backward, so it leaves a
quarter of the HBM budget free (``hbm.reserve: null``; planner.py). The first step measures it
(engine/probe.py): the bytes autograd kept for backward and, on a GPU, the device's peak beyond
what the HBM tier held. At the end of that step's ``optimizer.step()``, with the update before
it finished and before this step's is sent, the engine plans again with what was measured
left free, and 1/16 of the budget more (the allocator's fragments, a backward's own buffers):
units of the forward's order that now fit move to the device, whole (weights, gradient,
masters, moments, copied into HBM; their NVMe files removed, their DRAM blocks left pinned),
and are stepped there from this step on. With the node's rates (``tiered node``) on a GPU, no
more move than bring the predicted step within 2% of the shortest the memory allows: past the
balance, where the CPU's share of the update takes about as long as the GPU's forward and
backward, a unit moved only takes memory a larger batch could use. Ranks move the same units
(the fewest any rank's measurement allows). Units only move to the device: one the measurement
says is not needed there stays (moving it back would need DRAM the plan may no longer have).

It happens once, said in the log (logger "tiered", INFO, rank 0) and in ``plan_report()``; an
explicit ``hbm.reserve`` is the user's word and is kept as it is, with no re-plan. Exactness is
unchanged: a unit's states are copied bit for bit, its step count follows it, and the kernel
that steps it (torch's fused AdamW on the device, where the CPU's would be the one-pass one
under mixed precision; compact states' reference step, where the CPU's would be its kernel, to
the same bits) computes AdamW as every other does.
"""
from __future__ import annotations

import logging
import warnings

from ..core.sizes import format_size
from ..placement.plan import StateKind
from ..planning.node import cached_node_rates
from ..planning.planner import MEASURED_MARGIN_SHARE, replanned_units
from ..planning.report import StepMeasurement, step_terms
from ..policy.kinds import Tier
from .build import forward_order
from .context import EngineContext

_log = logging.getLogger("tiered")


class Replan:
    def __init__(self, context: EngineContext):
        self.manager = context.manager
        self.policy = context.policy
        self.group = context.group
        self.accelerator = context.streams.accelerator
        self.timeline = context.timeline
        self.order = forward_order(context.flats)
        self.names = [flat.name for flat in context.flats]
        self.due = True
        """Until the first step that ran a backward has been re-planned after."""
        self.outcome: str | None = None
        """What the re-plan did, in a line (None before it ran)."""

    def after_step(self, activations: int, measured: StepMeasurement | None) -> None:
        """``optimizer.step()`` ended the first step that ran a backward, found the update
        before it finished and has not sent its own: re-plan with ``activations`` (what its
        forwards kept for backward at most) and, where it was measured, ``measured``."""
        self.due = False
        manager = self.manager
        plan = manager.current_plan
        unplanned = activations
        peak = self.accelerator.max_memory_allocated()
        if peak is not None:  # also what autograd does not keep, the caching allocator's
            unplanned = max(unplanned, peak - manager.hbm.usage.peak)
        try:
            moved = replanned_units(plan, self.order, manager.hbm.usage.budget, unplanned,
                                    self._predicted_step(measured))
        except Exception as error:  # the ranks agree below: none may leave before it
            warnings.warn(f"tiered: the re-plan after the first step failed ({error}); the "
                          f"placement stays as it is")
            moved = []
        moved = moved[:self.group.smallest(len(moved))]  # the fewest any rank can move
        what = "no unit moved"
        if moved:
            try:
                with self.timeline.span(f"re-plan: {len(moved)} units to the device", "setup"):
                    manager.move_to_device(plan.kept_on_device(moved))
            except Exception as error:  # all or nothing: this rank's placement stays
                warnings.warn(f"tiered: moving {len(moved)} units to the device failed "
                              f"({error}); the placement stays as it is")
                moved = []
            else:
                what = (f"{len(moved)} more units kept on the device "
                        f"({', '.join(self.names[unit] for unit in moved)}); the DRAM they "
                        f"left, {format_size(manager.current_plan.left_pinned)}, stays pinned")
        kept = sum(manager.tier_of(unit, StateKind.EXP_AVG) is Tier.HBM for unit in self.order)
        step = f"step {measured.step}" if measured is not None else "the first step"
        free = unplanned + manager.hbm.usage.budget // MEASURED_MARGIN_SHARE
        self.outcome = (f"re-planned after {step}: {what}; {kept} of {len(self.order)} trained "
                        f"units there; measured beyond the plan {format_size(unplanned)}, "
                        f"{format_size(free)} left free")
        if self.group.rank == 0:
            _log.info("tiered: %s", self.outcome)

    def _predicted_step(self, measured: StepMeasurement | None):
        """The step a plan is predicted to take (the balance), from this node's rates and the
        measured forward and backward; None where memory decides alone: on the CPU (it steps
        every unit wherever it is), without rates, or with the step not measured."""
        rates = cached_node_rates(self.policy.nvme.path)
        if self.group.device.type != "cuda" or rates is None or measured is None:
            return None
        delayed = self.policy.optimizer.delayed_update.enabled

        def predicted(plan) -> float:
            terms = step_terms(plan, self.policy, self.group.world_size, rates, False,
                               measured.backwards)
            return terms.predicted_step(measured.compute_s, False, delayed)

        return predicted
