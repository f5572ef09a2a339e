"""A training rank's host run by the node's service: the same RankHost (optim/host.py) a trainer
runs in a thread of its own, here on the rank's DRAM segments, on a CPU worker of the service.

[Note: hosted ranks]
A rank whose states all live in DRAM or on NVMe (the service never touches CUDA) asks the service
to run its host: it sends its plan and its setup. The service builds a TierManager that adopts
that plan over the same memory: the trainer names where each of its DRAM states and staging
buffers lies, by descriptor (segment, byte offset, bytes), which the service wraps as tensors
over its own mapping of the segment, and its NVMe states are the rank's files here (files.py).
It compiles the one-pass AdamW once, and from then on runs the rank's commands in the order
they come, each answered with events on the same connection. The global gradient norm of a step is summed here over the job's
ranks, in rank order (JobNorm). An update runs only once its step is committed on every rank
(see [Note: reattach] in commits.py). A rank whose connection drops stops its host: commands
already queued finish (an update not committed by then is not run, nor anything after it),
nothing more is taken, and what the host leaves is the rank's kept state.
"""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterator

import torch

from ..core.errors import RankWent, TieredError
from ..core.timeline import timed
from ..device import CpuAccelerator
from ..optim.adamw import one_pass_for
from ..optim.commands import StepArrived, Update
from ..optim.host import HostSetup, RankHost
from ..optim.workers import CpuWorker
from ..placement.manager import TierManager
from ..placement.plan import StateKind, grad_dtypes, state_dtype
from ..policy.kinds import ComputeDtype
from .commits import NotCommitted, StepCommits
from .cores import CorePool
from .files import RankFiles
from .hostwire import EventSender, HostRequest, Span, span_to_wire
from .records import Segment
from .segments import SegmentViews

CPU = torch.device("cpu")


class JobNorm:
    """A job's global gradient norm, summed over its ranks hosted here: the k-th sum a rank
    asks for waits for every rank's k-th share, added in rank order."""

    def __init__(self, world: int):
        self.world = world
        self._changed = threading.Condition()
        self._shares: dict[int, dict[int, float]] = {}
        self._taken: dict[int, int] = {}
        self._broken: str | None = None

    def sum(self, round_: int, rank: int, share: float) -> float:
        with self._changed:
            self._shares.setdefault(round_, {})[rank] = share
            self._changed.notify_all()
            self._changed.wait_for(lambda: self._broken is not None
                                   or len(self._shares[round_]) == self.world)
            if self._broken is not None:
                raise RankWent(f"the job's gradient norm cannot be summed: {self._broken}")
            shares = self._shares[round_]
            total = 0.0
            for r in sorted(shares):
                total += shares[r]
            self._taken[round_] = self._taken.get(round_, 0) + 1
            if self._taken[round_] == self.world:
                del self._shares[round_], self._taken[round_]
            return total

    def broken(self, why: str) -> None:
        with self._changed:
            self._broken = why
            self._changed.notify_all()


@dataclass(frozen=True)
class HostSeat:
    """What the service gives a rank's host: the rank's memory and files, and what it shares
    with the job's other ranks and the node's."""

    rank: int
    world: int
    segments: list[Segment]
    """The rank's segments that its blocks' descriptors name."""
    files: RankFiles | None
    """Its NVMe files, where its plan has shards there."""
    norm: JobNorm
    commits: StepCommits
    round: int
    """The round of the job's commits this host belongs to."""
    cores: CorePool
    threads: int
    """Its worker's threads: its share of the cores."""

    @property
    def nvme_files(self) -> RankFiles:
        """``files``, where its plan has shards on NVMe (Registry.host_started refuses such a
        plan for a rank without files)."""
        assert self.files is not None, f"rank {self.rank}'s plan has NVMe shards but no files"
        return self.files


class _RankNorm:
    """What RankHost takes as its norm group: one rank's view of its job's JobNorm."""

    device = CPU

    def __init__(self, seat: HostSeat):
        self._seat = seat
        self._round = 0

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        seat = self._seat
        with seat.cores.given_back(seat.threads):  # the other ranks' shares need cores too
            total = seat.norm.sum(self._round, seat.rank, float(tensor))
        self._round += 1
        tensor.fill_(total)


class _SpanSender:
    """What RankHost takes as its timeline (a SpanTimer) in the service: each span it times is
    sent to the trainer, whose timeline places it on the host's shared monotonic clock
    (Timeline.record); disabled when the trainer keeps none."""

    def __init__(self, send: Callable[[dict], None], enabled: bool):
        self._send = send
        self.enabled = enabled

    @contextlib.contextmanager
    def span(self, name: str, category: str, args: dict | None = None) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        with timed(self._forward, name, category, args):
            yield

    def _forward(self, name: str, category: str, track: str, start_ns: int, duration_ns: int,
                 args: dict | None) -> None:
        self._send(span_to_wire(Span(name, category, f"service {track}", start_ns, duration_ns,
                                     args)))


class HostedRank:
    """One rank's host in the service (see [Note: hosted ranks])."""

    def __init__(self, request: HostRequest, seat: HostSeat, send: Callable[[dict], None]):
        policy = request.policy
        self.seat = seat
        self.rank = seat.rank
        self.commits = seat.commits
        self._started = time.monotonic()
        self._busy = 0.0
        """Seconds its worker spent running the rank's commands (not waiting for a commit)."""

        def tell(message: dict) -> None:  # a trainer that is gone is told nothing
            try:
                send(message)
            except OSError:
                pass

        self._send = tell
        segments = {segment.id: segment for segment in seat.segments}
        self.memory = SegmentViews(lambda i: (segments[i].fd, segments[i].nbytes))
        """The rank's segments, as the trainer's descriptors name them."""
        self.manager = TierManager(policy, CPU, seat.rank,
                                   nvme_tier=lambda *_: seat.nvme_files.adopted())
        self._worker: CpuWorker | None = None
        """Made once the plan is adopted; None only while built, or when building failed."""
        try:
            self.manager.adopt(request.plan, {key: self.memory.view(*where)
                                              for key, where in request.blocks.items()})
            self._worker = CpuWorker(seat.threads)
            compute = policy.compute_dtype.torch_dtype
            one_pass = one_pass_for(compute, grad_dtypes(policy, seat.world), CPU, self.worker)
            self.host = RankHost(HostSetup(
                manager=self.manager, names=request.names, trainable=request.trainable,
                buffer_dtype=state_dtype(policy, StateKind.GRAD), ranges=request.ranges,
                one_pass=one_pass, optimizer=policy.optimizer,
                norm_group=_RankNorm(seat),
                max_grad_norm=policy.optimizer.max_grad_norm,
                fp16=policy.compute_dtype is ComputeDtype.FP16,
                timeline=_SpanSender(tell, request.traced), accelerator=CpuAccelerator()),
                EventSender(tell))
        except BaseException:
            self.close()
            raise
        self.worker.on_failure(self._failed)

    @property
    def worker(self) -> CpuWorker:
        """The worker that runs the rank's commands: there once the host is built."""
        assert self._worker is not None, f"rank {self.rank}'s host was not built"
        return self._worker

    def run(self, number: int, command) -> None:
        if isinstance(command, (Update, StepArrived)):  # it changes the kept state: committed
            self.worker.submit(partial(self._run_committed, number, command))
        else:
            self.worker.submit(partial(self._run, number, command))

    def _run_committed(self, number: int, command: Update | StepArrived) -> None:
        self.commits.wait(self.seat.round, command.step)
        self._run(number, command)

    def _run(self, number: int, command) -> None:
        with self.seat.cores.held(self.seat.threads):
            start = time.monotonic()
            try:
                self.host.run(number, command)
            finally:
                self._busy += time.monotonic() - start

    @property
    def busy(self) -> float:
        """The share of the time since the host started that its worker ran the rank's
        commands (``tiered daemon status``)."""
        return min(1.0, self._busy / max(time.monotonic() - self._started, 1e-9))

    def step_record(self, step: int, record: dict) -> None:
        """The trainer's record of ``step()`` call ``step``; what the host runs after it waits
        for the step's commit, so that a host that ran what it was sent has its step settled
        (see [Note: reattach])."""
        self.commits.arrived(self.seat.round, self.rank, step, record)
        self.worker.submit(partial(self.commits.wait, self.seat.round, step))

    def final_state(self) -> dict | None:
        """What the host leaves for a relaunch to take over, once its worker is closed: each
        unit's AdamW step count and the last update's outcome; None when a task failed (an
        update may have stopped half-way), other than a step not committed, which ran none."""
        if self._worker is None or (self._worker.failed
                                    and not isinstance(self._worker.error, NotCommitted)):
            return None
        return self.host.final_state()

    def run_queued(self) -> None:
        """Wait until the worker ran every command sent so far (an update waits for its
        commit); a failure among them is the trainer's to hear of, told already."""
        with contextlib.suppress(TieredError):
            self.worker.drain()

    def after_queued(self, answer: Callable[[], None]) -> None:
        """Call ``answer`` (a reply to the trainer) once every command sent before it has run:
        a drain's, or one that reads what they wrote."""
        self.worker.submit(answer)

    def unit_steps(self) -> list[float]:
        """Each unit's AdamW step count (on the worker: after what was sent before)."""
        return [float(step) for step in self.host.stepper.steps]

    def set_unit_steps(self, steps: list[float]) -> None:
        def fill() -> None:
            for step, value in zip(self.host.stepper.steps, steps):
                step.fill_(value)
        self.worker.submit(fill)

    def restored(self) -> None:
        self.worker.submit(self.host.restore)

    def params_swapped(self, units: list[int]) -> None:
        """The trainer made these units' delayed-update weights current (see
        TierManager.swap_params): so does this manager, in the commands' order."""
        def swap() -> None:
            for unit in units:
                self.manager.swap_params(unit)
        self.worker.submit(swap)

    def _failed(self) -> None:
        # The job's other ranks must not wait in a norm for this one's share (a step not
        # committed is run by no rank, so none waits for it).
        self.seat.norm.broken(f"rank {self.rank}'s host failed: {self.worker.error}")
        error = self.worker.error
        self._send({"op": "failed", "error": f"{type(error).__name__}: {error}",
                    "rank_went": isinstance(error, RankWent)})

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
        self.manager.close()
        self.memory.close()


