"""What ``tiered.initialize`` settles before it builds anything: the compute device, the ranks on
this node, this rank's timeline, the node's service's DRAM, and the warning for weights that did
not match the model."""
from __future__ import annotations

import os
import warnings

import torch

from ..checkpoint import pretrained
from ..core.errors import PolicyError
from ..core.timeline import Timeline
from ..device import accelerator_for
from ..policy.config import Policy
from ..policy.kinds import Device
from ..service.client import slab_source_from_env
from ..tiers import SlabSource
from .collectives import ProcessGroup


def warn_unmatched(result: pretrained.LoadResult, where: str) -> None:
    missing, unexpected = result
    if missing:
        warnings.warn(f"tiered: {len(missing)} parameters, buffers or extra states are not in "
                      f"{where}; they start as the model initializes them: "
                      f"{pretrained.listing(missing)}", stacklevel=3)
    if unexpected:
        warnings.warn(f"tiered: {len(unexpected)} tensors of {where} are not in the model and "
                      f"were not read: {pretrained.listing(unexpected)}", stacklevel=3)


def service_source(policy: Policy, device: torch.device,
                    group: ProcessGroup) -> SlabSource | None:
    """The node's service's DRAM, when the environment names one (service/client.py)."""
    source = slab_source_from_env(group.rank, group.world_size, accelerator_for(device))
    if source is not None:
        if source.note:
            warnings.warn(f"tiered: {source.note}", stacklevel=3)
        if policy.dram.huge_pages:
            warnings.warn("tiered: dram.huge_pages applies to memory a trainer pins itself; "
                          "the service's segments use the pages the service got", stacklevel=3)
    return source


def compute_device(policy: Policy) -> torch.device:
    """CUDA device LOCAL_RANK, or the CPU, which then plays the device ("hbm" is its memory)."""
    if policy.device is Device.CPU or (policy.device is Device.AUTO
                                       and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise PolicyError("device is 'cuda' but torch sees no CUDA device; use device: auto or cpu")
    # torchrun says which GPU is this rank's; otherwise respect torch.cuda.set_device.
    local_rank = os.environ.get("LOCAL_RANK")
    device = torch.device("cuda", int(local_rank) if local_rank is not None
                          else torch.cuda.current_device())
    torch.cuda.set_device(device)
    return device


def ranks_on_this_node(group: ProcessGroup) -> int:
    """The ranks sharing this node's memory and drives: torchrun's LOCAL_WORLD_SIZE, else every
    rank of the group (processes started another way on one node)."""
    return min(int(os.environ.get("LOCAL_WORLD_SIZE", group.world_size)), group.world_size)


def rank_timeline(policy: Policy, device: torch.device, group: ProcessGroup) -> Timeline:
    """This rank's timeline, checked first: a trace folder that is missing must not cost a
    whole run before it is noticed. Every rank refuses if one does, so none waits in a
    collective for it."""
    try:
        timeline, refused = Timeline.for_rank(policy.trace.path, device, group.rank,
                                              group.world_size), None
    except PolicyError as error:
        timeline, refused = None, error
    if not group.agree(refused is None):
        raise refused or PolicyError("another rank cannot write its timeline (trace.path or "
                                     "TIERED_TRACE): see that rank's error")
    assert timeline is not None  # every rank agreed that it made its own
    return timeline
