"""Where a step stands, owned in one place: the hooks, the runtime, the optimizer and the loss
scaling ask this instead of keeping flags of their own.

[Note: step phases]
The training thread is in one phase at a time; each move is checked against ``LEGAL``, and an
illegal one raises PhaseError naming both phases (FSDP2 keeps a ``TrainingState`` per group for
the same reason; this one is per engine, since units are gathered and released by the one
trace of the whole step). The phases, as a step moves through them:

    IDLE --> FORWARD --> AWAITING_BACKWARD --> BACKWARD --> BACKWARD_COUNTED --> IDLE
      |         |                                 |  ^          |  ^
      |         +--> IDLE (nothing to backward)   v  |          v  |
      |                                          RECOMPUTE     RECOMPUTE
      +--> NO_GRAD_FORWARD --> IDLE
      +--> STEPPING --> IDLE          (also from AWAITING_BACKWARD: a forward without backward)
      +--> BACKWARD                   (a retained graph's next backward)

- FORWARD / NO_GRAD_FORWARD: the model's outermost forward, with or without grad (eval,
  generation). A no-grad forward has no backward to wait for, so it ends the iteration; so
  does a forward whose output cannot start one. A forward that calls the model again nests
  inside the phase (``forward_depth``), as does the inner entry's ([Note: entering the model
  below its root] in hooks.py).
- AWAITING_BACKWARD: a forward with grad returned; what the trace keeps stays gathered for its
  backward. The backward may never come (a metric computed with grad enabled): another forward
  (also a no-grad one) or ``optimizer.step()`` may follow, and the step drops what that forward
  kept. A backward inside the model's forward is refused: the pass's end would release the
  units the forward still reads.
- BACKWARD: an autograd pass has reached the units' weights; it gives no unit a gradient yet,
  and may never (``torch.autograd.grad`` over the inputs), so it does not count towards the
  step. BACKWARD_COUNTED: it has given one a gradient, and is a backward of the step (gradient
  accumulation counts these, ``backwards``). The pass ends, in either, at autograd's end
  callback, or, where it raised and never reached it, at the next forward or step.
- RECOMPUTE: activation checkpointing runs a unit's forward again inside the backward; it
  returns to the backward phase it interrupted (nested units count in ``recompute_depth``).
- STEPPING: inside ``optimizer.step()`` (its closure's forward and backward come before); a
  backward that raised is ended first, as the next forward would.

The update a step sends runs beside the training thread, so it is a second, concurrent line
(``update_phase``): NONE, RUNNING (an ordinary update; its readers wait per unit), DELAYED
(the delayed update: it overlaps the next forward and backward, and the next step makes its
weights current). An update is sent only once the one before it finished (or was let go:
units stepped on arrival leave nothing to settle). Whether the last finished update was
skipped, its fp16 gradients having overflowed (the loss scale backs off), is kept with it
(``last_update_skipped``, the optimizer's ``step_was_skipped``).

What is bookkeeping per unit, not a phase, stays with its owner: which units a backward has
used (hooks), which were stepped as their gradients arrived (runtime), a buffer's hand-off
state (buffers.py).
"""
from __future__ import annotations

from collections.abc import Callable
from enum import Enum

import torch

from ..core.errors import TieredError
from ..optim.arrival import LastBackward
from ..optim.commands import UpdateMode
from .update_book import SentUpdate


class Phase(Enum):
    IDLE = "idle"
    FORWARD = "forward"
    NO_GRAD_FORWARD = "no-grad forward"
    AWAITING_BACKWARD = "awaiting backward"
    BACKWARD = "backward"
    BACKWARD_COUNTED = "counted backward"
    RECOMPUTE = "recompute"
    STEPPING = "stepping"


BACKWARD_PHASES = frozenset({Phase.BACKWARD, Phase.BACKWARD_COUNTED, Phase.RECOMPUTE})

LEGAL: dict[Phase, frozenset[Phase]] = {
    Phase.IDLE: frozenset({Phase.FORWARD, Phase.NO_GRAD_FORWARD, Phase.BACKWARD,
                           Phase.STEPPING}),  # BACKWARD: a retained graph's next backward
    Phase.FORWARD: frozenset({Phase.AWAITING_BACKWARD, Phase.IDLE}),
    Phase.NO_GRAD_FORWARD: frozenset({Phase.IDLE}),
    Phase.AWAITING_BACKWARD: frozenset({Phase.FORWARD, Phase.NO_GRAD_FORWARD, Phase.BACKWARD,
                                        Phase.STEPPING}),
    Phase.BACKWARD: frozenset({Phase.BACKWARD_COUNTED, Phase.RECOMPUTE, Phase.IDLE}),
    Phase.BACKWARD_COUNTED: frozenset({Phase.RECOMPUTE, Phase.IDLE}),
    Phase.RECOMPUTE: frozenset({Phase.BACKWARD, Phase.BACKWARD_COUNTED, Phase.IDLE}),
    Phase.STEPPING: frozenset({Phase.IDLE}),
}
"""Each phase's legal next phases (see [Note: step phases])."""


class UpdatePhase(Enum):
    NONE = "none"
    RUNNING = "running"
    DELAYED = "delayed"


class PhaseError(TieredError):
    """A step moved in an order the engine does not follow (see [Note: step phases])."""


Watcher = Callable[[Phase, Phase], None]
"""Called with (from, to) after each move of the training thread's phase."""


class StepState:
    """The phase of the training thread and the step's ledger: backwards counted towards the
    next ``optimizer.step()``, the step's last backward, the weights' epoch, the loss scale of
    the gradients held, and the update sent but not finished."""

    def __init__(self, accumulation_steps: int | None, loss_scaled: bool):
        self.phase = Phase.IDLE
        self.accumulation_steps = accumulation_steps
        self.loss_scaled = loss_scaled
        """fp16 compute: each backward's loss must be scaled (engine.backward)."""
        self.forward_depth = 0
        """Model forwards running (see FORWARD in [Note: step phases])."""
        self.recompute_depth = 0
        self._resume = Phase.BACKWARD
        """The backward phase a recomputation interrupted."""
        self._watchers: list[Watcher] = []
        self.backwards = 0
        """Backwards counted since the last ``optimizer.step()`` (or a restored state)."""
        self.last_backward: LastBackward | None = None
        """Set while the backward running (or the last one) is the step's last, as
        ``accumulation_steps`` declares it (the runtime says what it is: count_backward)."""
        self.weights_epoch = 0
        """Counts the times the weights may have changed (``optimizer.step()``, a checkpoint's
        optimizer state or a load restored): a backward refuses weights saved in an earlier
        epoch."""
        self._next_backward_scaled = False
        self.grads_loss_scale: float | None = None
        """The loss scale the gradients held now were made with (see loss_scale_noted)."""
        self.update: SentUpdate | None = None
        """The optimizer's update sent and not yet finished, or None: its mode says the update
        phase."""
        self.last_update_skipped = False
        """Whether the last finished update was skipped for an fp16 overflow."""

    def watch(self, watcher: Watcher) -> None:
        self._watchers.append(watcher)

    @staticmethod
    def autograd_running() -> bool:
        """Whether this thread runs inside an autograd pass (torch's private graph-task id: the
        one reliable way a module hook can tell a recomputation from a forward)."""
        return torch._C._current_graph_task_id() != -1

    def _move(self, to: Phase) -> None:
        before = self.phase
        if to not in LEGAL[before]:
            raise PhaseError(f"a step cannot go from {before.value} to {to.value}; legal after "
                             f"{before.value}: "
                             f"{', '.join(sorted(p.value for p in LEGAL[before]))}")
        self.phase = to
        for watcher in self._watchers:
            watcher(before, to)

    # The training thread's phase.

    def start_forward(self) -> bool:
        """The model's forward starts (outside backward); True for the outermost one."""
        self.recover()
        self.forward_depth += 1
        if self.forward_depth > 1:
            return False
        self._move(Phase.FORWARD if torch.is_grad_enabled() else Phase.NO_GRAD_FORWARD)
        return True

    def end_forward(self, backward_may_follow: bool) -> bool:
        """The model's forward returned; True for the outermost one, which ends the phase."""
        self.forward_depth -= 1
        if self.forward_depth > 0:
            return False
        awaits = self.phase is Phase.FORWARD and backward_may_follow
        self._move(Phase.AWAITING_BACKWARD if awaits else Phase.IDLE)
        return True

    def abandon_forward(self) -> None:
        """A forward interrupted past its hooks (a KeyboardInterrupt skips torch's always_call
        hooks): nothing awaits its backward."""
        self.forward_depth = 0
        if self.phase in (Phase.FORWARD, Phase.NO_GRAD_FORWARD):
            self._move(Phase.IDLE)

    def enter_backward(self) -> None:
        """A hook inside an autograd pass reached the units: the first queues the pass's end."""
        if self.phase in BACKWARD_PHASES or not self.autograd_running():
            return
        self._move(Phase.BACKWARD)
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    @property
    def counted(self) -> bool:
        """Whether the backward running has given a unit a gradient."""
        return (self.phase is Phase.BACKWARD_COUNTED
                or (self.phase is Phase.RECOMPUTE and self._resume is Phase.BACKWARD_COUNTED))

    def count_backward(self, last_backward: Callable[[], LastBackward]) -> None:
        """The first gradient of this pass: it is a backward of the step. Refused under fp16
        when its loss was not scaled, and past ``accumulation_steps``; the step's last one, as
        ``accumulation_steps`` declares it, is described by ``last_backward()``."""
        scaled, self._next_backward_scaled = self._next_backward_scaled, False  # one backward's
        if self.loss_scaled and not scaled:
            raise TieredError("compute_dtype fp16 needs engine.backward(loss) instead of "
                              "loss.backward(), so that the loss is scaled")
        limit = self.accumulation_steps
        self.backwards += 1
        if limit is not None and self.backwards > limit:
            raise TieredError(
                f"backward number {self.backwards} since the last optimizer.step(), but "
                f"optimizer.accumulation_steps is {limit}: units were already stepped with the "
                f"gradients of backward {limit}; set accumulation_steps to the number of "
                f"backward calls per step (or null)")
        self.last_backward = last_backward() if self.backwards == limit else None
        self._move(Phase.BACKWARD_COUNTED)

    def start_recompute(self) -> None:
        """A unit's forward runs again inside backward (activation checkpointing)."""
        self.enter_backward()
        self.recompute_depth += 1
        if self.recompute_depth == 1:
            self._resume = self.phase
            self._move(Phase.RECOMPUTE)

    def end_recompute(self) -> None:
        self.recompute_depth -= 1
        if self.recompute_depth == 0:
            self._move(self._resume)

    def _end_backward(self) -> None:
        """Autograd's end callback, or a recovery from a backward that raised before it."""
        self.recompute_depth = 0
        self._move(Phase.IDLE)

    def recover(self) -> None:
        """A backward that raised never reached its end callback: end it now."""
        if self.phase in BACKWARD_PHASES and not self.autograd_running():
            self._end_backward()

    def start_step(self) -> None:
        self.recover()
        self._move(Phase.STEPPING)

    def end_step(self) -> None:
        self._move(Phase.IDLE)

    # The step's ledger.

    def step_taken(self) -> None:
        """``optimizer.step()`` or a restored optimizer state: the next backward counts towards
        the next step, which takes new gradients."""
        self.backwards = 0
        self.last_backward = None
        self.grads_loss_scale = None

    def weights_changed(self) -> None:
        self.weights_epoch += 1

    def loss_scale_noted(self, scale: float) -> None:
        """``engine.scaled_loss`` under fp16: the next backward counts as scaled by ``scale``.
        The step unscales by the scale the gradients were made with: under the delayed update,
        step t+1's backward runs before update t decides the scale, and ``synchronize()`` (or
        ``engine.eval()``, ``full_state_dict()``) between that backward and ``step()`` changes
        the scaler's. (A later backward into the same gradients at another scale: the step can
        unscale by one of the two only, as GradScaler could.)"""
        self._next_backward_scaled = True
        if self.grads_loss_scale is None:
            self.grads_loss_scale = scale

    def scaled_backward_over(self) -> None:
        """``engine.backward`` returned: a scaled loss that reached no unit's gradient does not
        carry over to the next backward."""
        self._next_backward_scaled = False

    def gradients_dropped(self) -> None:
        """``zero_grad``: backwards from here on make the gradients, at the scaler's scale."""
        self.grads_loss_scale = None

    # The update beside the training thread.

    @property
    def update_phase(self) -> UpdatePhase:
        if self.update is None:
            return UpdatePhase.NONE
        return (UpdatePhase.DELAYED if self.update.mode is UpdateMode.DELAYED
                else UpdatePhase.RUNNING)

    def update_sent(self, update: SentUpdate) -> None:
        """``update`` is with the host; the last one was finished or let go."""
        if self.update is not None:
            raise PhaseError(f"an update was sent while the one before it is "
                             f"{self.update_phase.value}; it must finish first")
        self.update = update

    def update_let_go(self) -> None:
        """The update running is not waited for (its readers wait per unit, in the runtime's
        PendingWeights, and it leaves nothing to settle), or its sending failed."""
        self.update = None

    def update_finished(self, skipped: bool | None) -> None:
        """The host is done with the update sent (``skipped``: its fp16 gradients overflowed;
        None: no loss scaling)."""
        self.update = None
        if skipped is not None:
            self.last_update_skipped = skipped

    def update_restored(self, update: SentUpdate | None) -> None:
        """A checkpoint's (or a reattached rank's) state: its delayed update still to be made
        current, or None; no update finished since."""
        self.update = update
        self.last_update_skipped = False
