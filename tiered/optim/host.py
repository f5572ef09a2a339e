"""The CPU side of one rank's step: the commands of commands.py, run in order on one thread.

Gradients are taken into the grads tier (see [Note: gradient states] in engine/gradients.py),
updates stepped unit by unit where the optimizer states live (stepper.py), the global gradient
norm taken first where clipping or fp16 needs it, and units stepped as their last gradient
arrives (``optimizer.accumulation_steps``). What became of a command goes back through
HostEvents. The host runs on the CPU worker of this process (``LocalHost``); the node's service
will run the same host on its own pool.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from enum import Enum
from functools import partial
from typing import Callable, Protocol

import torch

from ..core.timeline import SpanTimer
from ..device import Accelerator, StreamLike, wait_for
from ..placement.manager import TierManager, typed
from ..policy.config import OptimizerPolicy
from .adamw import OnePassAdamW
from .arrival import LastBackward
from .commands import Command, GradientIn, HostEvents, Update, UpdateMode, ZeroGrad
from .groups import GroupRange
from .norm import squared_norm
from .stepper import UnitStepper
from .workers import CpuWorker


class HostGroup(Protocol):
    """The data-parallel group as the host takes the global norm over it: the engine's
    ProcessGroup.on_host() in the trainer, a rank's seat in the node's service."""

    @property
    def device(self) -> torch.device: ...

    def all_reduce_sum(self, tensor: torch.Tensor) -> None: ...


class HostWorker(Protocol):
    """What the training side asks of the worker that runs its host: this process's CpuWorker
    (workers.py), or service/remote.py's RemoteWorker for a host in the node's service. It
    waits for the host and learns of its failure; it never hands it a task (``submit``: the
    service takes commands, not Python callables), which only LocalHost does, on a CpuWorker."""

    failure_reported: bool
    """Whether the failure was raised to a caller (at exit, one not raised is printed)."""

    @property
    def failed(self) -> bool: ...

    @property
    def error(self) -> BaseException | str | None: ...

    def on_failure(self, callback: Callable[[], None]) -> None: ...

    def raise_if_failed(self) -> None: ...

    def drain(self) -> None: ...

    def close(self) -> None: ...


class HostLink(Protocol):
    """Where the training side sends the CPU side of a step, as commands: ``LocalHost`` here,
    or service/remote.py's RemoteHost for a host in the node's service."""

    @property
    def lands_every_gradient(self) -> bool:
        """Whether every gradient after a step's first must come in a landing buffer."""

    @property
    def records_steps(self) -> bool:
        """Whether each ``step()`` sends its record (``step_record``) for a relaunch."""

    @property
    def device_stream(self) -> StreamLike | None:
        """The stream the host queues its device work on, waited for once it is drained."""

    def send(self, command: Command) -> None: ...

    def unit_steps(self) -> list[float]: ...

    def set_unit_steps(self, steps: list[float]) -> None: ...

    def restored(self) -> None: ...

    def params_swapped(self, units: list[int]) -> None: ...

    def step_record(self, step: int, optimizer: dict) -> None: ...


@dataclass(frozen=True)
class HostSetup:
    """What a rank's host is given once, at ``initialize``."""

    manager: TierManager
    names: list[str]
    """Per unit, its name (for the timeline)."""
    trainable: list[bool]
    """Per unit, whether it has parameters to train (a frozen unit has no gradient buffer)."""
    buffer_dtype: torch.dtype
    """What the grads tier holds a sum in: fp32, or the compute dtype when compact."""
    ranges: list[tuple[GroupRange, ...]]
    """Per unit, its shard's runs of one param group (groups.shard_ranges)."""
    one_pass: OnePassAdamW | None
    optimizer: OptimizerPolicy
    """The policy's optimizer section: how states are stored, streamed and rounded."""
    norm_group: HostGroup
    """The data-parallel group on the host (ProcessGroup.on_host), for the global norm."""
    max_grad_norm: float | None
    fp16: bool
    """A loss scaler checks each update's gradients for infs and nans."""
    timeline: SpanTimer
    """Where its work is timed: the trainer's Timeline, or the service's sender of spans to it."""
    accelerator: Accelerator
    """The compute device's (the plain CPU's in the node's service, which never touches it)."""


class GradState(Enum):
    """What a unit's grads-tier buffer holds (see [Note: gradient states] in
    engine/gradients.py); only the host changes it, in the order of its commands."""

    NONE = "none"
    """No gradient since ``zero_grad``."""
    PENDING = "pending"
    """One backward's gradient as it came off the device, narrower than the buffer (the
    compute dtype in an fp32 buffer): widened before a later one is added."""
    SUM = "sum"
    """Gradients in the buffer's own dtype (an fp32 sum, a first gradient already in it,
    ``zero_grad``'s zeros, a compact buffer's): a later one is added in place."""


class RankHost:
    def __init__(self, setup: HostSetup, events: HostEvents):
        self.setup = setup
        self.manager = setup.manager
        self.events = events
        count = len(setup.names)
        self.held = [GradState.NONE] * count
        """What unit i's grads-tier buffer holds."""
        self._pending_dtype: dict[int, torch.dtype] = {}
        """The dtype of each PENDING unit's gradient (the buffer's bytes are read as it)."""
        self.arrival_order: list[int] = []
        """Units in the order their first gradient since ``zero_grad`` arrived: the order an
        update steps them in (see [Note: buffer hand-off])."""
        self.stepper = UnitStepper(setup.manager, self, setup.names, setup.ranges,
                                   setup.one_pass, setup.optimizer, setup.timeline,
                                   setup.accelerator)
        self._squares: dict[int, torch.Tensor] = {}
        """Squared norms of complete gradients, taken as they arrived."""
        self._ready: list[int] = []
        """Units whose gradient of the last backward is in but which are not yet stepped, in
        arrival order (see _last_gradient_in)."""
        self._wants_norm = setup.max_grad_norm is not None or setup.fp16
        self._last_queued = 0
        """Gradients of a step's last backward sent and not yet taken in."""
        self._queued_lock = threading.Lock()
        self._next = 0
        """The number of the next command to run: they run in the order sent."""
        self.last_step = 0
        """The last ``optimizer.step()`` call whose update this host finished."""
        self.last_update: dict | None = None
        """The outcome of the last update it ran (its step, norm, overflow and the units it
        wrote), for a relaunch that takes over the rank's state (final_state)."""

    # -- the commands ------------------------------------------------------------------------

    def run(self, number: int, command: Command) -> None:
        """Run command ``number`` (commands are numbered from 0 as they are sent)."""
        assert number == self._next, f"command {number} run out of order (next: {self._next})"
        self._next += 1
        if isinstance(command, GradientIn):
            self._gradient_in(command)
        elif isinstance(command, ZeroGrad):
            self._zero_grad(command.set_to_none)
        elif isinstance(command, Update):
            self._update(command)
            self.last_step = command.step
        else:
            self._step_ready(command.last, until_more_arrive=False)
            self.last_step = command.step

    def queued(self, command: Command, change: int) -> None:
        """The sender counts a last backward's gradient as queued (+1) before it sends it, or
        takes it back (-1) when the send failed: an arrival step steps on only while no more
        of them wait (see _last_gradient_in)."""
        if isinstance(command, GradientIn) and command.last is not None:
            with self._queued_lock:
                self._last_queued += change

    def _gradient_in(self, command: GradientIn) -> None:
        unit = command.unit
        shard = self._shard(command)
        wait_for(self.setup.accelerator, command.ready, shard,
                 on_device=command.tensor is not None or self.stepper.on_device(unit))
        if command.first:
            if shard.dtype is self.setup.buffer_dtype:
                self.held[unit] = GradState.SUM
            else:
                self.held[unit] = GradState.PENDING
                self._pending_dtype[unit] = shard.dtype
            self.arrival_order.append(unit)
        else:
            self._add(unit, shard)
        self.events.gradient_taken(unit, command.ticket, command.landing)
        if command.last is not None:
            self.queued(command, -1)
            self._last_gradient_in(unit, command.last)

    def _shard(self, command: GradientIn) -> torch.Tensor:
        """Where the gradient of ``command`` is: in the unit's grads-tier buffer (a first
        gradient, in its own dtype: see [Note: gradient states]), in a landing buffer, or in
        the tensor it came with."""
        if command.tensor is not None:
            return command.tensor
        if command.first:
            return self.manager.grad_buffer(command.unit, command.dtype)[:command.numel]
        assert command.landing is not None, "a later gradient comes in a landing buffer"
        return typed(self.manager.staging_block(command.landing), command.numel, command.dtype)

    def _add(self, unit: int, shard: torch.Tensor) -> None:
        """Add a later gradient into the buffer in its dtype: the fp32 sum (widening a pending
        one first), or a compact buffer as it is (see [Note: gradient states])."""
        buffer_dtype = self.setup.buffer_dtype
        with self.setup.timeline.span(f"add grad {self.setup.names[unit]}", "cpu"):
            held = self.held[unit]
            assert held is not GradState.NONE, f"unit {unit}: a later gradient before any first"
            if held is GradState.PENDING:
                pending_dtype = self._pending_dtype.pop(unit)
                pending = self.manager.grad_buffer(unit, pending_dtype).clone()
                self.manager.grad_buffer(unit, torch.float32).copy_(pending)
            self.manager.grad_buffer(unit, buffer_dtype).add_(shard)
            self.held[unit] = GradState.SUM

    def _zero_grad(self, set_to_none: bool) -> None:
        """``set_to_none`` forgets the gradients; otherwise they become zeros in the buffer's
        dtype, counted as gradients, as in PyTorch. A unit without a gradient keeps none either
        way (see GradientPath.zero_grad). A unit whose next first gradient is already on its way
        (backward took its buffer after this zero_grad) is untouched by either: forgetting
        writes only what the host knows of it, and zeros are written only into units that held
        a gradient, whose next one is added, not copied in."""
        self._squares.clear()
        self.arrival_order = []
        units = [i for i, trainable in enumerate(self.setup.trainable)
                 if trainable and (set_to_none or self.held[i] is not GradState.NONE)]
        for unit in units:
            self._pending_dtype.pop(unit, None)
            if set_to_none:
                self.held[unit] = GradState.NONE
            else:
                self.manager.grad_buffer(unit, self.setup.buffer_dtype).zero_()
                self.held[unit] = GradState.SUM
        if set_to_none:
            self.events.buffers_read(units)
        else:  # zeros are gradients the next update reads: held until it has
            self.events.buffers_held(units)

    # -- what the stepper reads ----------------------------------------------------------------

    def read(self, unit: int) -> torch.Tensor:
        """Unit ``unit``'s gradient as it is held (pending or compact in the compute dtype, or
        fp32)."""
        held = self.held[unit]
        assert held is not GradState.NONE, f"unit {unit} holds no gradient to read"
        dtype = (self._pending_dtype[unit] if held is GradState.PENDING
                 else self.setup.buffer_dtype)
        return self.manager.grad_buffer(unit, dtype)

    def consumed(self, unit: int) -> None:
        """An update has read unit ``unit``'s gradient; its buffer may be refilled."""
        self.events.buffers_read([unit])

    def in_arrival_order(self, units: list[int]) -> list[int]:
        """``units`` ordered as their gradients arrived (any others last)."""
        wanted = set(units)
        ordered = [i for i in self.arrival_order if i in wanted]
        seen = set(ordered)
        return ordered + [i for i in units if i not in seen]

    # -- updates -------------------------------------------------------------------------------

    def _last_gradient_in(self, unit: int, last: LastBackward) -> None:
        """Unit ``unit``'s gradient of the step's last backward is in. Step a unit now where
        the policy allows (``last.step_units``), else take its norm now if the step will need
        it.

        Of the units whose gradient is in, the one the next forward needs first is stepped
        first. Backward delivers the embedding last and the next forward needs it first:
        stepped in arrival order, that forward would wait for the whole update, while this way
        it follows the update unit by unit once backward is over (``step()`` does not wait for
        these steps). The host lags backward (a unit's step takes longer than its backward),
        so arrivals queue up behind a step: they are taken in (quick) before the next unit is
        chosen, and the last one queued steps whatever is left, so every unit is stepped before
        the host goes idle."""
        if last.step_units:
            self._ready.append(unit)
            self._step_ready(last, until_more_arrive=True)
        elif self._wants_norm:
            with self.setup.timeline.span(f"grad norm {self.setup.names[unit]}", "cpu"):
                self._squares[unit] = squared_norm(self.read(unit))

    def _step_ready(self, last: LastBackward, until_more_arrive: bool) -> None:
        """Step the units whose gradient of ``last`` is in, the next forward's first first;
        with ``until_more_arrive``, only while no more gradients are queued."""
        rank = last.forward_rank
        while self._ready and not (until_more_arrive and self._last_queued):
            unit = min(self._ready, key=lambda i: rank.get(i, len(rank)))  # ties: arrival
            self._ready.remove(unit)
            assert last.hypers is not None  # a backward that steps units carries their hypers
            self.stepper.step([unit], last.hypers, 1.0, False)  # run, also on a GPU
            self.events.weights_written([unit])

    def _update(self, update: Update) -> None:
        """One optimizer step over ``update.units``: in their order when the next forward waits
        for them, else in the order their gradients arrived (the next backward waits for their
        buffers: see [Note: buffer hand-off] in engine/gradients.py)."""
        # Waiters are woken by what the update writes, or on a failure by the worker's error,
        # never by a half-done update.
        divisor, norm = self._grad_divisor(update)
        self.events.update_norm(update.number, norm)
        overlapped = update.mode is UpdateMode.OVERLAPPED
        written: set[int] = set()
        if divisor is not None:
            delayed = update.mode is UpdateMode.DELAYED
            order = self.in_arrival_order(list(update.units)) if delayed else list(update.units)

            def wrote(unit: int) -> None:
                written.add(unit)
                self.events.update_wrote(update.number, unit)
                if overlapped:
                    self.events.weights_written([unit])

            self.stepper.step(order, update.hypers, divisor, delayed, on_unit=wrote)
        if overlapped:  # those an overflow skipped: their readers read the old weights
            self.events.weights_written([unit for unit in update.units if unit not in written])
        self.last_update = {"step": update.step, "norm": norm, "overflowed": divisor is None,
                            "written": sorted(written)}
        self.events.update_done(update.number, overflowed=divisor is None)

    def _grad_divisor(self, update: Update) -> tuple[float | None, float | None]:
        """What the accumulated gradients are divided by (loss scale over clip factor), or None
        when fp16 gradients overflowed and the step must be skipped; and the norm taken."""
        if not self._wants_norm:
            return 1.0, None
        norm = self._global_norm(list(update.units))
        if self.setup.fp16:
            if not math.isfinite(norm):
                return None, norm
            norm /= update.loss_scale
        max_norm = self.setup.max_grad_norm
        if max_norm is not None:
            clip = max_norm / (norm + 1e-6)
            if math.isnan(clip):  # clip_grad_norm_ clamps nan to nan: every gradient is nan
                return math.nan, norm
            if clip < 1.0:
                # An infinite norm clips to zero, as clip_grad_norm_ multiplies by 0 then.
                return (update.loss_scale / clip if clip > 0.0 else math.inf), norm
        return update.loss_scale, norm

    def _global_norm(self, units: list[int]) -> float:
        # Summed where the gradients are (one copy to the host per device in the end, not one
        # per unit: under tier: auto some are on the device, some on the host), then over ranks
        # on the host group.
        sums: dict[torch.device, torch.Tensor] = {}
        for unit in units:
            square = self._squares.pop(unit, None)
            if square is None:
                square = squared_norm(self.read(unit))
            device = square.device  # where it was taken, if a re-plan moved it since
            if device not in sums:
                sums[device] = torch.zeros((), dtype=torch.float64, device=device)
            sums[device] += square
        square_sum = torch.zeros((), dtype=torch.float64, device=self.setup.norm_group.device)
        for part in sums.values():
            square_sum += part.to(square_sum.device)
        self.setup.norm_group.all_reduce_sum(square_sum)
        return math.sqrt(square_sum.item())

    def final_state(self) -> dict:
        """What a relaunch taking this rank's state over needs of the host, with it idle: each
        unit's AdamW step count and the last update's outcome (see [Note: reattach] in
        service/commits.py)."""
        return {"unit_steps": [float(step) for step in self.stepper.steps],
                "last_update": self.last_update}

    def restore(self) -> None:
        """A checkpoint's state was loaded: no gradient or arrival is held any more."""
        self._ready = []
        self._squares.clear()


class LocalHost:
    """The host in this process: commands run on its CPU worker, in the order sent."""

    lands_every_gradient = False
    """On a CPU device a later gradient reaches the host as the reduced shard itself (the
    service's host, in another process, needs every one in a landing buffer)."""
    records_steps = False
    """Its state dies with this process: no step record is kept (see RemoteHost)."""

    def __init__(self, worker: CpuWorker, rank_host: RankHost):
        self.worker = worker
        self.rank_host = rank_host
        self._sent = 0
        self._lock = threading.Lock()  # backward's threads and the training thread both send
        accelerator = rank_host.setup.accelerator
        self.device_stream = (accelerator.Stream("the CPU worker's stream")
                              if accelerator.has_streams else None)
        """The stream the worker queues its device work on (see _own_stream); None on the
        CPU, where that work is done when its task is."""
        if self.device_stream is not None:
            worker.submit(partial(_own_stream, accelerator, self.device_stream))
            worker.drain()

    def send(self, command: Command) -> None:
        self.rank_host.queued(command, +1)  # before the host can take it in
        with self._lock:
            try:
                self.worker.submit(partial(self.rank_host.run, self._sent, command))
            except BaseException:
                self.rank_host.queued(command, -1)
                raise
            self._sent += 1

    def unit_steps(self) -> list[float]:
        """Each unit's AdamW step count (the host idle: a checkpoint drains it first)."""
        return [float(step) for step in self.rank_host.stepper.steps]

    def set_unit_steps(self, steps: list[float]) -> None:
        for step, value in zip(self.rank_host.stepper.steps, steps):
            step.fill_(value)

    def restored(self) -> None:
        """A checkpoint's state was loaded (the host idle)."""
        self.rank_host.restore()

    def params_swapped(self, units: list[int]) -> None:
        """The training side made these units' delayed-update weights current: the host shares
        its tier manager, so it sees the swap already."""

    def step_record(self, step: int, optimizer: dict) -> None:
        """Nothing is kept (``records_steps`` is False): the state dies with this process."""


def _own_stream(accelerator: Accelerator, stream: StreamLike) -> None:
    """Make ``stream`` the worker thread's (whose current device and stream are its own): its
    device work (taking gradients in, their norms, the AdamW of units stepped on the GPU) then
    runs beside the training thread's forward and backward. On the default stream, the
    training thread's, it queued behind them, and each unit's synchronize waited for them too.
    Whoever reads what it wrote waits for that stream (the optimizer's ``synchronize``, once
    the worker is drained: LocalHost.device_stream) or for its events (``wait_for``)."""
    accelerator.set_stream(stream)
