"""``tier: auto`` as its tests drive it: budgets that give a mixed placement, and where each unit
landed."""
from __future__ import annotations

import os

import torch

from tiered.engine.build import flat_units, forward_order, memory_plan
from tiered.placement.plan import OPTIMIZER_STATES, StateKind
from tiered.policy.config import Policy
from tiered.policy.kinds import Tier

from helpers import REPO
from helpers_models import make_model

AUTO = os.path.join(REPO, "configs", "auto.yaml")
CPU = torch.device("cpu")
SUB_GROUP = 1024
"""Small NVMe sub-groups: the staging stays small beside these tiny shards."""


def auto_policy(**overrides) -> Policy:
    return Policy.from_yaml(AUTO, dict(dict(device="cpu", compute_dtype="fp32"), **overrides))


def mixed_budgets(world: int, compute_dtype: str = "fp32") -> dict:
    """Budgets under which the planner keeps the first unit of the forward (the root) on the
    device and of the two blocks left on the host, one's optimizer states fit DRAM and the
    other's move to NVMe: every kind of placement at once."""
    policy = auto_policy(compute_dtype=compute_dtype, optimizer={"sub_group_size": SUB_GROUP})
    flats = flat_units(make_model(), policy, 0, world, CPU)
    order = forward_order(flats)
    one, two = (memory_plan(policy, CPU, flats, on_device=frozenset(order[:k])) for k in (1, 2))
    block = order[1]
    states = sum(one.shards[(block, kind)].nbytes for kind in OPTIMIZER_STATES)
    return {"hbm": {"budget": (one.needed(Tier.HBM) + two.needed(Tier.HBM)) // 2, "reserve": 0},
            "dram": {"budget": one.needed(Tier.DRAM) - states // 2}}


def replan_budgets() -> dict:
    """mixed_budgets' DRAM, and an HBM budget under which the default reserve (a quarter of it)
    leaves the device only the root, while the first two units of the forward fit beside a
    sixteenth of it and a small step's activations: the re-plan after step 1 moves the second
    (whose optimizer states are on NVMe) to the device, and no more."""
    policy = auto_policy(optimizer={"sub_group_size": SUB_GROUP})
    flats = flat_units(make_model(), policy, 0, 1, CPU)
    two = memory_plan(policy, CPU, flats, on_device=frozenset(forward_order(flats)[:2]))
    return {"hbm": {"budget": two.needed(Tier.HBM) * 4 // 3 - 8, "reserve": None},
            "dram": mixed_budgets(1)["dram"]}


def placed(engine, kind: StateKind) -> list[str]:
    """Each unit's tier for ``kind``, in the forward's order (root first)."""
    return [engine.manager.tier_of(unit, kind).value
            for unit in forward_order(engine.runtime.flats)]


def units_per_tier(engine, kind: StateKind) -> dict[str, int]:
    """How many units hold ``kind`` in each tier, by the tier's name (engine.placement())."""
    counted: dict[str, int] = {}
    for states in engine.placement().values():
        if kind.value in states:  # a frozen unit has weights alone
            counted[states[kind.value]] = counted.get(states[kind.value], 0) + 1
    return counted
