"""One rank's parts put together, in the order they need each other: the training side's
mailboxes (the gradient buffers, the weights still being written, the optimizer's updates), the
host that fills them through its events (optim/host.py), the units' runtime and the optimizer.
Nothing is wired in after it is made: each part is given what it reports to when it is made."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..core.timeline import Timeline
from ..device import accelerator_for
from ..optim.adamw import OnePassAdamW
from ..optim.groups import GroupRange
from ..optim.host import HostLink, HostSetup, HostWorker, LocalHost, RankHost
from ..optim.workers import CpuWorker
from ..placement.manager import TierManager
from ..placement.plan import BlockKey, MemoryPlan, StateKind, state_dtype
from ..policy.config import Policy
from ..policy.kinds import ComputeDtype, Tier
from ..service.client import ServiceSlabSource
from ..service.hostwire import HostRequest
from ..service.remote import RemoteHost
from .buffers import GradientBuffers
from .collectives import ProcessGroup
from .context import EngineContext, TrainerEvents
from .flat import FlatParam
from .loss_scale import LossScaler
from .optimizer import TieredAdamW
from .pending import PendingWeights
from .runtime import UnitRuntime
from .step_state import StepState
from .streams import Streams
from .update_book import UpdateBook


@dataclass(frozen=True)
class InService:
    """Where the node's service runs this rank's host (service/hosting.py)."""

    source: ServiceSlabSource
    """The rank's DRAM from the service: its job, and its segments in order."""
    threads: int
    """The CPU update's threads there."""
    model_state: Callable[[], dict]
    """The model's part of each step's record (reattach.StepRecorder)."""


def assemble(flats: list[FlatParam], manager: TierManager, group: ProcessGroup,
             policy: Policy, worker: CpuWorker | None, timeline: Timeline,
             ranges: list[tuple[GroupRange, ...]], one_pass: OnePassAdamW | None,
             in_service: InService | None = None
             ) -> tuple[UnitRuntime, TieredAdamW, LossScaler | None]:
    """The runtime, the optimizer and the loss scaler (fp16 only) of an engine whose units are
    built and whose tiers hold their states; its host runs on ``worker`` here, or, with
    ``in_service``, in the node's service."""
    accelerator = accelerator_for(group.device)
    streams = Streams(accelerator)
    scaler = LossScaler(policy.loss_scale) if policy.compute_dtype is ComputeDtype.FP16 else None
    link: HostLink
    host_worker: HostWorker
    if in_service is not None:
        remote = RemoteHost(in_service.source.client.paths.folder, timeline,
                            in_service.model_state)
        events = _mailboxes(flats, manager, policy, remote.worker, timeline)
        try:
            remote.start(in_service.source.job, group.rank, host_request(
                policy, manager.current_plan, flats, ranges,
                manager.descriptors(in_service.source.locate), in_service.threads,
                timeline.enabled), events)
        except BaseException:
            remote.close()
            raise
        link, host_worker = remote, remote.worker
    else:
        assert worker is not None, "a host in this process runs on this process's CPU worker"
        events = _mailboxes(flats, manager, policy, worker, timeline)
        link, host_worker = LocalHost(worker, RankHost(HostSetup(
            manager=manager, names=[flat.name for flat in flats],
            trainable=[flat.has_trainable for flat in flats],
            buffer_dtype=state_dtype(policy, StateKind.GRAD), ranges=ranges,
            one_pass=one_pass,
            optimizer=policy.optimizer, norm_group=group.on_host(),
            max_grad_norm=policy.optimizer.max_grad_norm, fp16=scaler is not None,
            timeline=timeline, accelerator=accelerator), events)), worker
    step_state = StepState(policy.optimizer.accumulation_steps, loss_scaled=scaler is not None)
    runtime = UnitRuntime(EngineContext(flats, manager, group, policy, host_worker, streams,
                                        timeline, link, events.buffers, events.pending,
                                        step_state))
    return runtime, TieredAdamW(runtime, policy, scaler, events.book), scaler


def _mailboxes(flats: list[FlatParam], manager: TierManager, policy: Policy,
               worker: HostWorker, timeline: Timeline) -> TrainerEvents:
    """The training side's mailboxes, which the host's events fill; a failure of ``worker``
    wakes whoever waits on them."""
    return TrainerEvents(
        GradientBuffers(len(flats), manager.staging_names("grad"), manager.hbm.usage, worker,
                        policy.grads.landing_slots),
        PendingWeights(worker, timeline), UpdateBook(worker))


def host_request(policy: Policy, plan: MemoryPlan, flats: list[FlatParam],
                 ranges: list[tuple[GroupRange, ...]],
                 blocks: dict[BlockKey, tuple[int, int, int]], threads: int,
                 traced: bool) -> HostRequest:
    """What this rank asks of the service to run its host there."""
    return HostRequest(policy, plan, blocks, [flat.name for flat in flats],
                       [flat.has_trainable for flat in flats], ranges, threads, traced)


def hostable_in_service(policy: Policy, local_world: int, world: int) -> bool:
    """Whether the node's service can run this rank's host (see [Note: hosted ranks]): no
    state in HBM (the service never touches CUDA; it holds the rank's NVMe files), and every
    rank of the job on this node (the service sums the gradient norm over the ranks it
    hosts)."""
    tiers = (policy.params.tier, policy.grads.tier, policy.optimizer.tier)
    # Under tier: auto the planner may keep units on the device.
    return all(tier not in (Tier.HBM, Tier.AUTO) for tier in tiers) and local_world == world


