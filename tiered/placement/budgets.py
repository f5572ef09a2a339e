"""What one rank may hold of the node: its share of the RAM and of the drive's free space, the
budgets a policy sets past them (refused: past the memory the OOM killer ends a process without
a word), how two tiers split a CPU device's RAM, and what a policy comes to on this machine
(``tiered check-policy``). Nothing here allocates.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..core.errors import BudgetError
from ..core.limits import memory_bound
from ..core.sizes import format_size
from ..policy.config import Policy
from ..policy.kinds import Device
from ..tiers.dram import default_budget
from ..tiers.nvme import free_bytes


def split_shared_ram(ram: int, hbm_budget: int | None, dram_budget: int | None,
                     dram_needed: int) -> tuple[int, int]:
    """The HBM and DRAM budgets on a CPU device, where both tiers are ``ram`` (see
    TierManager.budgets_for): a budget the policy sets stays, a null one is what the other
    leaves, and with both null DRAM's is what the plan pins there, ``dram_needed``."""
    if dram_budget is None:
        dram_budget = dram_needed if hbm_budget is None else max(0, ram - hbm_budget)
    if hbm_budget is None:
        hbm_budget = max(0, ram - dram_budget)
    return hbm_budget, dram_budget


def dram_beside_hbm(room: int, ram: int, hbm_budget: int | None, hbm_needed: int) -> int:
    """The DRAM a plan may fill on a CPU device, where both tiers are ``ram``: no more than
    ``room`` (DRAM's own budget) nor than the HBM tier's budget leaves or, when null, its
    plan's needs ``hbm_needed``."""
    return max(0, min(room, ram - (hbm_budget if hbm_budget is not None else hbm_needed)))


PastTheNode = dict[str, tuple[str, tuple[int, int]]]
"""Per tier: a line naming a budget, its value and this rank's share; (budget, share)."""


def budgets_past_the_node(policy: Policy, on_cpu: bool, ranks: int = 1,
                          agree: Callable[[int], int] = int) -> PastTheNode:
    """The budgets ``policy`` sets larger than this rank's share (one of ``ranks``, agreed as
    null budgets are) of what the node has: its memory for ``dram.budget`` (and for
    ``hbm.budget`` on a CPU device, whose memory is the same RAM: both together too), the free
    space of ``nvme.path`` for ``nvme.budget``. A budget is a limit, but past the memory the
    OOM killer ends the process without a word, and past the free space an extent's fallocate
    fails midway; so such a budget is refused, whether or not the plan stays under it.
    Returns, per tier: (a line naming key, value and share, (budget, share))."""
    ranks = max(1, ranks)
    of_node = f"1/{ranks} (ranks on this node) of " if ranks > 1 else ""
    shares: dict[str, tuple[str, int, int, str]] = {}  # tier: key, budget, share, what sets it
    memory_share, memory_bound_by = 0, ""
    if policy.dram.budget is not None or (on_cpu and policy.hbm.budget is not None):
        available, bound = memory_bound()  # once, as ``agree`` is a collective
        memory_share, memory_bound_by = agree(available // ranks), of_node + bound
    if policy.dram.budget is not None:
        shares["dram"] = ("dram.budget", policy.dram.budget, memory_share, memory_bound_by)
    if on_cpu and policy.hbm.budget is not None:
        shares["hbm"] = ("hbm.budget", policy.hbm.budget, memory_share, memory_bound_by)
        if policy.dram.budget is not None:
            shares["hbm+dram"] = ("hbm.budget + dram.budget (on the CPU device both are its RAM)",
                                  policy.hbm.budget + policy.dram.budget, memory_share,
                                  memory_bound_by)
    if policy.uses_nvme and policy.nvme.budget is not None:
        path = policy.nvme.path
        assert path is not None  # a policy that uses NVMe names its path
        shares["nvme"] = ("nvme.budget", policy.nvme.budget, agree(free_bytes(path) // ranks),
                          f"{of_node}the free space of the file system of {path}")
    return {tier: (f"{key} {format_size(budget)} is more than this rank may use, "
                   f"{format_size(share)} ({bound})", (budget, share))
            for tier, (key, budget, share, bound) in shares.items() if budget > share}


def refusal(past: PastTheNode, hint: str) -> BudgetError:
    """The one-line BudgetError for the budgets of ``past`` (budgets_past_the_node)."""
    them = "it" if len(past) == 1 else "them"
    return BudgetError("; ".join(line for line, _ in past.values()) + hint
                       + f"; lower {them} or leave {them} null",
                       {tier: shortfall for tier, (_, shortfall) in past.items()})


def this_machine(policy: Policy) -> tuple[list[str], list[str]]:
    """What ``policy`` comes to on this machine, for ``tiered check-policy``: notes (the
    device the engine will compute on, what one rank may hold) and refusals (what
    ``initialize`` would refuse here). Touches no device: nothing is allocated."""
    cuda = torch.cuda.is_available()
    ram = default_budget(1)
    bound = memory_bound()[1]
    notes, refusals = [], []
    if policy.device is Device.CUDA and not cuda:
        refusals.append("device is cuda but torch sees no CUDA device here: initialize "
                        "refuses this policy on this machine")
    if policy.device is Device.CPU or not cuda:
        why = "device: cpu" if policy.device is Device.CPU else "torch sees no CUDA device"
        notes.append(f"device on this machine: cpu ({why}); its memory is the RAM, so the "
                     f"hbm tier and the dram tier share it")
        notes.append(f"one rank may hold here {format_size(ram)} of RAM in hbm and dram "
                     f"together (7/8 of {bound}; ranks on one node share it)")
    else:
        properties = torch.cuda.get_device_properties(torch.cuda.current_device())
        notes.append(f"device on this machine: cuda ({properties.name}, "
                     f"{format_size(properties.total_memory)} per GPU, one GPU per rank)")
        notes.append(f"one rank may hold here {format_size(ram)} of DRAM (7/8 of {bound}; "
                     f"ranks on one node share it)")
    on_cpu = policy.device is Device.CPU or not cuda
    refusals += [f"{line}: initialize refuses it on this machine"
                 for line, _ in budgets_past_the_node(policy, on_cpu).values()]
    return notes, refusals
