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
under mixed precision) computes AdamW as every other does.
"""
from __future__ import annotations

import logging

from ..node import cached_node_rates
from ..plan import StateKind
from ..plan_report import StepMeasurement, step_terms
from ..planner import MEASURED_MARGIN_SHARE, units_to_keep
from ..policy import Tier
from ..sizes import format_size
from .build import forward_order
from .context import EngineContext

_log = logging.getLogger("tiered")


class Replan:
    def __init__(self, context: EngineContext):
        self.manager = context.manager
        self.policy = context.policy
        self.group = context.group
        self.timeline = context.timeline
        self.order = forward_order(context.flats)
        self.names = [flat.name for flat in context.flats]
        self.due = True
        """Until the first measured step has been re-planned after."""
        self.outcome: str | None = None
        """What the re-plan did, in a line (None before it ran)."""

    def after_step(self, measured: StepMeasurement | None) -> None:
        """``optimizer.step()`` found the previous update finished and has not sent its own:
        re-plan after the step ``measured`` (None: it ran no backward, so wait for one)."""
        if measured is None:
            return
        self.due = False
        manager = self.manager
        plan = manager.plan
        candidates = [unit for unit in self.order
                      if manager.tier_of(unit, StateKind.MASTER) is not Tier.HBM]
        budget = manager.hbm.usage.budget
        unplanned = measured.activations
        if measured.device_peak is not None:
            unplanned = max(unplanned, measured.device_peak - manager.hbm.usage.peak)
        reserve = unplanned + budget // MEASURED_MARGIN_SHARE
        rates = cached_node_rates(self.policy.nvme.path)
        delayed = self.policy.optimizer.delayed_update.enabled

        def predicted(count: int) -> float:
            terms = step_terms(plan.kept_on_device(candidates[:count]), self.policy,
                               self.group.world_size, rates, False, measured.backwards)
            return terms.predicted_step(measured.compute_s, False, delayed)

        # On the CPU it steps every unit wherever it is: only memory decides there.
        balanced = self.group.device.type == "cuda" and rates is not None
        count = units_to_keep(
            0, len(candidates),
            lambda count: plan.kept_on_device(candidates[:count]).needed(Tier.HBM),
            budget, reserve, predicted if balanced else None)
        count = self.group.smallest(count)
        moved = candidates[:count]
        if moved:
            with self.timeline.span(f"re-plan: {len(moved)} units to the device", "setup"):
                manager.move_to_device(plan.kept_on_device(moved))
        kept = len(self.order) - len(candidates) + len(moved)
        what = (f"{len(moved)} more units kept on the device "
                f"({', '.join(self.names[unit] for unit in moved)})" if moved
                else "no unit moved")
        self.outcome = (f"re-planned after step {measured.step}: {what}, {kept} of "
                        f"{len(self.order)} trained units there; measured beyond the plan "
                        f"{format_size(unplanned)}, {format_size(reserve)} left free")
        if self.group.rank == 0:
            _log.info("tiered: %s", self.outcome)
