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
Frozen units are never stepped and stay on the host. A unit moved adds to the HBM tier and takes from DRAM (and NVMe), so the HBM
need only grows with the number k of units kept there: the largest k whose plan fits HBM with
the reserve is found by bisection. The other tiers only gain as k grows, so if that plan does
not fit them, no plan does, and initialize refuses it with its numbers.
"""
from __future__ import annotations

from typing import Callable

from .plan import MemoryPlan
from .policy import Policy, Tier

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

    def fits(plan: MemoryPlan) -> bool:
        return plan.needed(Tier.HBM) + reserve <= hbm_room(plan)

    best = plan_with(frozenset())
    low, high = 0, len(order)  # the first `low` fit; more than `high` do not
    while low < high:
        middle = (low + high + 1) // 2
        plan = plan_with(frozenset(order[:middle]))
        if fits(plan):
            low, best = middle, plan
        else:
            high = middle - 1
    return best
