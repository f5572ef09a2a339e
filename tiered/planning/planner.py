"""The planner of ``tier: auto``: which units the device keeps whole, stepped there.

[Note: placing units]
A step of an offloaded model is bounded by the CPU's AdamW pass over the states in DRAM (0.69 s
of the delayed update's 0.76 s for the 2.78 B GPT on the reference box), while the GPU computes
for 0.27 s of it and half its memory sits empty. A unit kept whole in HBM (weights, gradient,
master weights and moments) is stepped there by torch's fused kernel, some fifty times faster,
and its weights and gradient never cross the PCIe link; a unit on the host is placed as
``cpu.yaml`` places it, in DRAM, its states moving to NVMe where DRAM lacks room and a path
is set (``dram.spill: nvme``'s rule). So the planner keeps on the device as many trained units
as fit its budget, less ``hbm.reserve`` for what no plan counts (activations, the allocator's
cache). Before the first step nothing says how long the GPU computes, so "as many as fit" is
the choice that predicts the shortest step: every unit moved takes its update off the CPU,
the bound, for a fiftieth of that time on the GPU.

Units are taken in the order the forward needs them: the root unit (embeddings, head: gathered
through the whole forward) first, then the others as the module tree lists them. With updates
stepped as gradients arrive, the first units of the forward arrive last in backward and are
needed first by the next forward, so theirs is the CPU update the next step would wait for.
Frozen units are never stepped and stay on the host. A unit moved adds to the HBM tier and
takes from DRAM (and NVMe), so the HBM need only grows with the number k of units kept there:
the largest k whose plan fits HBM with the reserve is found by bisection. The other tiers only
gain as k grows, so if that plan does not fit them, no plan does, and initialize refuses it
with its numbers. After the first step, what it measured replaces the reserve's guess
([Note: re-plan] in engine/replan.py).
"""
from __future__ import annotations

from typing import Callable

from ..placement.plan import MemoryPlan, StateKind
from ..policy.config import Policy
from ..policy.kinds import Tier

RESERVE_SHARE = 4
"""With a null ``hbm.reserve``, a quarter of the HBM budget is left free."""


def hbm_reserve(policy: Policy, hbm_budget: int) -> int:
    """The HBM bytes ``tier: auto`` leaves free beside its plan (see [Note: placing units])."""
    if policy.hbm.reserve is not None:
        return policy.hbm.reserve
    return hbm_budget // RESERVE_SHARE


def place_units(order: list[int], plan_with: Callable[[frozenset[int]], MemoryPlan],
                hbm_room: Callable[[MemoryPlan], int], reserve: int) -> MemoryPlan:
    """The plan keeping the most of the trained units ``order`` lists on the device, taken in
    that order, with ``reserve`` bytes of HBM left free; ``plan_with(units)`` is the plan with
    ``units`` kept there, ``hbm_room(plan)`` the HBM bytes a plan may fill. When not even none
    fits, that plan: the caller refuses it with its numbers."""
    plans: dict[int, MemoryPlan] = {}

    def plan_of(count: int) -> MemoryPlan:
        if count not in plans:
            plans[count] = plan_with(frozenset(order[:count]))
        return plans[count]

    def fits(count: int) -> bool:
        plan = plan_of(count)
        return plan.needed(Tier.HBM) + reserve <= hbm_room(plan)

    return plan_of(largest_true(0, len(order), fits))


def largest_true(low: int, high: int, holds: Callable[[int], bool]) -> int:
    """The largest count in [low, high] for which ``holds``, which holds up to some count and
    not past it; ``low`` when none past it does (``holds(low)`` is not asked)."""
    while low < high:
        middle = (low + high + 1) // 2
        if holds(middle):
            low = middle
        else:
            high = middle - 1
    return low


MEASURED_MARGIN_SHARE = 16
"""The re-plan leaves free what the first step measured beyond the plan, and 1/16 of the HBM
budget more: the allocator's fragments, and what a backward allocates beside the activations
(see [Note: re-plan])."""

BALANCE_SLACK = 0.02
"""The re-plan keeps no more units on the device than bring the predicted step within 2% of the
shortest the memory allows: past the balance, a unit moved takes HBM a batch could use and
gains nothing (see [Note: re-plan])."""


def replanned_units(plan: MemoryPlan, order: list[int], hbm_budget: int, unplanned: int,
                    predicted_step: Callable[[MemoryPlan], float] | None = None) -> list[int]:
    """The units the re-plan after the first step moves to the device (see [Note: re-plan] in
    engine/replan.py), in the order ``order`` (the forward's trained units) lists them: those
    of ``plan`` off the device that fit its ``hbm_budget`` beside ``unplanned`` bytes measured
    beyond it and 1/16 of the budget, and, with ``predicted_step(plan)``, no more than bring
    it within BALANCE_SLACK of the shortest. ``plan.kept_on_device(units)`` is the plan after."""
    candidates = [unit for unit in order
                  if plan.shards[(unit, StateKind.EXP_AVG)].tier is not Tier.HBM]
    count = units_to_keep(
        len(candidates),
        lambda count: plan.kept_on_device(candidates[:count]).needed(Tier.HBM), hbm_budget,
        unplanned + hbm_budget // MEASURED_MARGIN_SHARE,
        None if predicted_step is None
        else lambda count: predicted_step(plan.kept_on_device(candidates[:count])))
    return candidates[:count]


def units_to_keep(most: int, hbm_needed: Callable[[int], int], hbm_room: int, reserve: int,
                  predicted_step: Callable[[int], float] | None) -> int:
    """How many of ``most`` units away from the device (in the forward's order) the re-plan
    moves there: with the first ``count``, the plan needs ``hbm_needed(count)`` of
    ``hbm_room``, ``reserve`` left free, and a step is predicted to take
    ``predicted_step(count)`` seconds (None: nothing predicted, memory decides alone). Units
    already there are no candidates: one the first step showed is not needed on the device
    stays there (its HBM was planned, and moving it would take DRAM the plan may no longer
    have)."""
    fit = largest_true(0, most, lambda count: hbm_needed(count) + reserve <= hbm_room)
    if predicted_step is None or fit == 0:
        return fit
    shortest = predicted_step(fit) * (1 + BALANCE_SLACK)
    # The predicted step only shortens as units move, so the first count within the slack is
    # the balance: the count past which it stays within.
    return fit - largest_true(0, fit, lambda fewer: predicted_step(fit - fewer) <= shortest)
