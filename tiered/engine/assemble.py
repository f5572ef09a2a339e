"""One rank's parts put together, in the order they need each other: the training side's
mailboxes (the gradient buffers, the weights still being written, the optimizer's updates), the
host that fills them through its events (optim/host.py), the units' runtime and the optimizer.
Nothing is wired in after it is made: each part is given what it reports to when it is made."""
from __future__ import annotations


from ..manager import TierManager
from ..optim import TieredAdamW
from ..optim.adamw import OnePassAdamW
from ..optim.groups import GroupRange
from ..optim.host import HostSetup, LocalHost, RankHost
from ..optim.loss_scale import LossScaler
from ..optim.optimizer import UpdateBook
from ..optim.workers import CpuWorker
from ..plan import StateKind, optimizer_device, state_dtype
from ..policy import ComputeDtype, Policy
from ..timeline import Timeline
from .buffers import GradientBuffers
from .collectives import ProcessGroup
from .context import EngineContext, TrainerEvents
from .flat import FlatParam
from .pending import PendingWeights
from .runtime import UnitRuntime
from .streams import Streams


def assemble(flats: list[FlatParam], manager: TierManager, group: ProcessGroup,
             policy: Policy, worker: CpuWorker, timeline: Timeline,
             ranges: list[tuple[GroupRange, ...]], one_pass: OnePassAdamW | None
             ) -> tuple[UnitRuntime, TieredAdamW, LossScaler | None]:
    """The runtime, the optimizer and the loss scaler (fp16 only) of an engine whose units are
    built and whose tiers hold their states."""
    device = group.device
    scaler = LossScaler(policy.loss_scale) if policy.compute_dtype is ComputeDtype.FP16 else None
    buffers = GradientBuffers(len(flats), manager.staging_names("grad"), manager.hbm.usage,
                              worker)
    pending = PendingWeights(worker, timeline)
    book = UpdateBook(worker)
    host = RankHost(HostSetup(
        manager=manager, names=[flat.name for flat in flats],
        trainable=[flat.has_trainable for flat in flats],
        buffer_dtype=state_dtype(policy, StateKind.GRAD), ranges=ranges,
        device=optimizer_device(policy, device), one_pass=one_pass,
        sub_group_size=policy.optimizer.sub_group_size, norm_group=group.on_host(),
        max_grad_norm=policy.optimizer.max_grad_norm, fp16=scaler is not None,
        timeline=timeline), TrainerEvents(buffers, pending, book))
    runtime = UnitRuntime(EngineContext(flats, manager, group, policy, worker, Streams(device),
                                        timeline, LocalHost(worker, host), buffers, pending))
    return runtime, TieredAdamW(runtime, policy, scaler, book), scaler


