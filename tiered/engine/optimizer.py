"""TieredAdamW: ``torch.optim.AdamW`` over the engine's partitioned, tiered shards."""
from __future__ import annotations

import warnings

import torch

from ..core.errors import TieredError
from ..optim.adamw import AdamWHyper
from ..optim.arrival import LastBackward
from ..optim.commands import StepArrived, Update, UpdateMode
from ..policy.config import Policy
from .loss_scale import LossScaler
from .released import ReleasedWeight
from .step_state import UpdatePhase
from .update_book import SentUpdate, UpdateBook


class TieredAdamW(torch.optim.Optimizer):
    """AdamW with ``torch.optim.AdamW``'s semantics, stepped where the optimizer states live.

    ``param_groups[0]["params"]`` stand for the units' flat parameters (one per unit, as FSDP's
    flat parameters): shape and dtype only, since the values live in the tiers. Each of the
    policy's ``optimizer.param_groups`` is one more group, whose ``match`` says which
    parameters it steps, inside those flat parameters (its ``params`` is empty); the rest are
    group 0's. Which parameters a group holds is fixed at ``initialize``
    (editing ``match`` later changes nothing). Each group's ``lr``, ``betas``, ``eps`` and
    ``weight_decay`` are read when a step is taken, so assigning ``param_groups[g]["lr"]`` or
    using a torch LR scheduler works as in PyTorch.

    A step clips by the global gradient norm when the policy sets ``max_grad_norm``
    (``clip_grad_norm_``'s rule), and under fp16 compute unscales the gradients, or skips the step
    and lowers the loss scale when any rank's gradients hold an inf or nan. Both factors are
    applied inside the AdamW kernel as one divisor, not as a separate pass over the gradients.
    The norm comes first (exact, never a speculative step undone; see bench/RESULTS.md for why):
    with ``optimizer.accumulation_steps`` each unit's share is taken as its gradient of the
    step's last backward arrives, on the otherwise idle host, so the step itself only adds
    them up; units without one (undeclared accumulation, a unit skipped by the last backward)
    are read at the step.

    The work runs on the rank's host (host.py), as commands (commands.py) in the order sent;
    what it found comes back as events into the UpdateBook. An ordinary update on the CPU (not
    fp16, whose next backward needs the loss scale this update decides) also returns from
    ``step()`` at once: it steps units in the order the next forward needs them, and that
    forward reads each unit only once it is written (runtime.PendingWeights), so it overlaps the
    update and computes exactly what it would after a blocking step. ``last_grad_norm`` waits
    for the norm only. With ``optimizer.accumulation_steps``, units stepped as their gradients
    arrive use the hyperparameters ``param_groups`` holds when the step's last backward starts
    (schedulers stepped after ``optimizer.step()`` set them in time), and ``step()`` returns
    without waiting for those steps. With ``optimizer.delayed_update`` the step
    after warm-up returns at once and its update overlaps the next forward and backward;
    :meth:`synchronize` (also run by ``engine.full_state_dict()``, ``engine.eval()`` and
    ``engine.close()``) finishes it. ``last_grad_norm`` and ``skipped_steps`` describe the
    updates finished so far.

    A unit that received no gradient since ``zero_grad()`` is not stepped, as parameters with
    ``grad=None`` are not in PyTorch; nor is a frozen parameter (``requires_grad=False`` when
    ``initialize`` ran). Within a unit that did, a parameter the forward never used has a zero
    gradient and is stepped (weight decay and momentum act on it), where PyTorch would leave it
    alone; put such parameters in a unit of their own (``units.classes``) if it matters.
    """

    def __init__(self, runtime, policy: Policy, scaler: LossScaler | None, book: UpdateBook):
        """``runtime``: the engine's units (engine/runtime.py), whose host (optim/host.py) runs
        the updates; ``book``: the records of the updates the host has not finished, which its
        events fill in."""
        opt = policy.optimizer
        defaults = dict(lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay)
        # Placeholders of the units' flat parameters, not ``flat.full``: its storage is zero
        # bytes while the unit is released, and printing it read freed memory (SIGSEGV).
        super().__init__([ReleasedWeight(flat.full.shape, flat.full.dtype,
                                         f"optimizer.param_groups[0]['params'][{i}]", flat.name)
                          for i, flat in enumerate(runtime.flats)], defaults)
        for group in opt.param_groups:
            given = {key: getattr(group, key) for key in defaults
                     if getattr(group, key) is not None}
            self.add_param_group({"params": [], "match": list(group.match), **given})
        self.group_count = len(self.param_groups)
        """Param groups the shards are stepped with: group 0 and the policy's."""
        self._runtime = runtime
        self._manager = runtime.manager
        self._worker = runtime.worker
        self._host = runtime.host
        self._book = book
        self._max_grad_norm = opt.max_grad_norm
        self.scaler = scaler
        self._delayed = opt.delayed_update
        self._steps_called = 0
        self._grads = runtime.grads
        self._state = runtime.step_state
        on_host = (not runtime.streams.accelerator.has_streams
                   or self._manager.plan.steps_on_host())
        self._ordinary_mode = (UpdateMode.OVERLAPPED if on_host and scaler is None
                               else UpdateMode.BLOCKING)
        """The mode of updates that are not delayed (see [Note: update modes]): overlapped
        where the CPU steps units (under ``tier: auto`` perhaps some of them)."""
        self._last_grad_norm: float | None = None
        self.skipped_steps = 0
        """Updates skipped because fp16 gradients overflowed."""

    @property
    def max_grad_norm(self) -> float | None:
        """The policy's ``optimizer.max_grad_norm``, fixed for the run."""
        return self._max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value) -> None:
        if value == self._max_grad_norm:
            return
        raise TieredError(
            f"optimizer.max_grad_norm cannot change during a run (asked: {value!r}): it decides "
            f"whether units are stepped as their gradients arrive, and an update that is still "
            f"running reads it; set optimizer.max_grad_norm in the policy")

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm (unscaled) of the last step's update, when it takes one;
        under the delayed update, of the last finished update."""
        update = self._state.update
        if update is not None and update.mode is not UpdateMode.DELAYED:
            # A worker that failed before this update was pending never wakes a waiter for it.
            self._worker.raise_if_failed()
            update.norm_known.wait()
            self._worker.raise_if_failed()
            return update.norm
        return self._last_grad_norm

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last finished update was skipped because fp16 gradients overflowed (a
        scheduler then does not step: accelerate's name for it). Under the delayed update,
        the update finished by this step is the previous step's."""
        return self._state.last_update_skipped

    @property
    def steps_taken(self) -> int:
        """``step()`` calls so far (restored by ``engine.load_checkpoint``): the training loop's
        position, as a global step count is in other trainers, which a resume uses to skip
        the data already seen and a save names its default tag by.

        Every call counts, also one that steps nothing: no backward since ``zero_grad()`` (as
        ``torch.optim.AdamW`` skips parameters without a gradient), or an fp16 overflow
        (``skipped_steps``). AdamW's bias correction counts each unit's own updates instead,
        which such a call leaves as they were, as torch leaves ``state["step"]``. With
        ``optimizer.accumulation_steps`` a call is one step of several backwards; the delayed
        update's ``warmup_steps`` counts calls too."""
        return self._steps_called

    @property
    def update_mode(self) -> UpdateMode:
        """The mode the next ``step()`` runs its update in (see [Note: update modes]): DELAYED
        once the delayed update's warm-up calls are done, else the run's ordinary mode."""
        if self._delayed.enabled and self._steps_called >= self._delayed.warmup_steps:
            return UpdateMode.DELAYED
        return self._ordinary_mode

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._grads.zero_grad(set_to_none)  # after any update that reads them
        self._state.gradients_dropped()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._manager.shards:
            raise TieredError("the engine of this optimizer is closed")
        if len(self.param_groups) != self.group_count:
            raise TieredError(
                f"TieredAdamW steps group 0 and the policy's optimizer.param_groups, "
                f"{self.group_count} in all; it has {len(self.param_groups)}: add groups in the "
                f"policy, not with add_param_group")
        self._state.start_step()  # ends a backward that raised before its end callback
        try:
            self._take_step()
        finally:
            self._state.end_step()
        return loss

    def _take_step(self) -> None:
        # The loss scale this step's backwards used: finishing the previous update may change it.
        loss_scale = self._loss_scale_of_grads()
        units = [i for i, has in enumerate(self._grads.has_grad) if has]
        mode = self.update_mode
        self._steps_called += 1
        arrived = set(self._runtime.stepped_on_arrival)
        last = self._state.last_backward
        if arrived:
            self._check_hyper_unchanged(last)
            # An arrival stops stepping once a later backward's gradients queue up behind it
            # (see _last_gradient_in); what it left is stepped here, with the hyperparameters
            # of the last backward's start (last.hypers), before any zero_grad() or later
            # gradient in the worker's queue.
            self._host.send(StepArrived(last, self._steps_called))
        if arrived and mode is UpdateMode.OVERLAPPED and not self._runtime.replan_due:
            # The worker is still stepping these (their readers wait in PendingWeights), and
            # ran the previous update before them; where units step on arrival (no clipping,
            # fp16 or delayed update) an update leaves nothing to settle, so nothing waits here.
            self._state.update_let_go()
        else:
            self.synchronize()  # the previous update, and this step's gradients, are all in
        self._runtime.step_taken(measured=True)  # this step takes the gradients
        rest = [i for i in units if i not in arrived]
        sent = None
        if rest:
            overlapped = mode is UpdateMode.OVERLAPPED
            update = self._book.open(self._runtime.forward_order(rest) if overlapped else rest,
                                     loss_scale, mode)
            self._state.update_sent(update)
            if overlapped:
                self._runtime.pending_weights.expect(update.units)
            try:
                self._host.send(Update(update.number, self._steps_called, tuple(update.units),
                                       self.hypers(), loss_scale, mode))
            except BaseException:
                self._state.update_let_go()  # never sent
                self._book.close(update)
                raise
            sent = update
        if self._host.records_steps:  # before a blocking update: it runs once this is in
            self._host.step_record(self._steps_called, self._step_record(sent))
        if sent is not None and mode is UpdateMode.BLOCKING:
            self.synchronize()

    def synchronize(self) -> None:
        """Finish the queued update; its weights become the ones the next forward gathers."""
        self._worker.drain()
        # Weights the host wrote on the device are ready after the work it queued on its stream,
        # all of it queued once the drain returns. The order is the training thread's to make:
        # a host in the service takes commands, not callables, and never touches the device.
        self._runtime.streams.gather_after(self._host.device_stream)
        update = self._state.update
        if update is None:
            return
        self._state.update_finished(update.overflowed if self.scaler is not None else None)
        self._book.close(update)
        if update.mode is UpdateMode.DELAYED:
            for i in update.written:
                self._manager.swap_params(i)
            self._host.params_swapped(update.written)
        if update.norm is not None:
            self._last_grad_norm = update.norm
        if self.scaler is not None:
            self.scaler.update(found_inf=update.overflowed)
            self.skipped_steps += update.overflowed

    def _loss_scale_of_grads(self) -> float:
        """What the gradients held now are divided by to unscale them (1 without fp16; see
        StepState.loss_scale_noted)."""
        if self.scaler is None:
            return 1.0
        scale = self._state.grads_loss_scale
        return scale if scale is not None else self.scaler.scale

    def checkpoint_state(self) -> dict:
        """The optimizer's state for a checkpoint, with the worker idle. A queued delayed update
        is finished but not made current: what it wrote and found is recorded instead, so a
        resumed run swaps to it at its next step exactly as this one will. An ordinary update
        is finished and made current."""
        if self._state.update_phase is UpdatePhase.RUNNING:
            self.synchronize()
        self._worker.drain()
        pending = self._state.update
        return {
            **self._counters(),
            "unit_steps": self._host.unit_steps(),
            "pending": None if pending is None else {
                "written": list(pending.written), "norm": pending.norm,
                "overflowed": pending.overflowed, "loss_scale": pending.loss_scale},
        }

    def _step_record(self, sent: SentUpdate | None) -> dict:
        """This ``step()`` call's record for a host that keeps one (see [Note: reattach] in
        service/commits.py): what :meth:`checkpoint_state` would say once ``sent`` (the update
        this call sent, if any) is done, but for what only the host knows then (each unit's
        step count, the update's outcome), and which units' delayed-update weights are
        swapped."""
        return {**self._counters(),
                "update": None if sent is None else {"mode": sent.mode.value,
                                                      "loss_scale": sent.loss_scale},
                "swapped": self._manager.swapped_units(),
                # A torch LR scheduler's base: one made after a reattach (which restores these
                # inside tiered.initialize, before the script can make it) starts from them.
                "initial_lrs": [group.get("initial_lr") for group in self.param_groups]}

    def _counters(self) -> dict:
        hypers = [{"lr": float(group["lr"]), "betas": list(group["betas"]), "eps": group["eps"],
                   "weight_decay": group["weight_decay"]} for group in self.param_groups]
        return {
            "steps_called": self._steps_called,
            "skipped_steps": self.skipped_steps,
            "last_grad_norm": self._last_grad_norm,
            "hyper": hypers[0],
            "group_hypers": hypers[1:],
            "loss_scale": self.scaler.state() if self.scaler is not None else None,
        }

    def restore_step_record(self, record: dict, host: dict) -> None:
        """Take over a rank whose trainer died (engine/reattach.py): its ``record`` of the last
        committed ``step()`` call, and what its host left (RankHost.final_state), whose last
        update is that call's where it sent one. The state is then :meth:`checkpoint_state`'s
        after that call: an ordinary update finished and made current, a delayed one pending."""
        state = {key: value for key, value in record.items()
                 if key not in ("update", "swapped", "initial_lrs")}
        for group, initial in zip(self.param_groups, record["initial_lrs"]):
            if initial is not None:
                group["initial_lr"] = initial
        state.update(unit_steps=host["unit_steps"], pending=None)
        sent, outcome = record["update"], host["last_update"]
        if sent is not None:
            if outcome is None or outcome["step"] != record["steps_called"]:
                raise TieredError(f"the kept state is inconsistent: step "
                                  f"{record['steps_called']} sent an update its host did not "
                                  f"finish")
            if UpdateMode(sent["mode"]) is UpdateMode.DELAYED:
                state["pending"] = {**outcome, "loss_scale": sent["loss_scale"]}
        self.restore_state(state)
        if sent is not None and UpdateMode(sent["mode"]) is not UpdateMode.DELAYED:
            # What synchronize() would have made of it by the next step.
            if outcome["norm"] is not None:
                self._last_grad_norm = outcome["norm"]
            if self.scaler is not None:
                self.scaler.update(found_inf=outcome["overflowed"])
                self.skipped_steps += outcome["overflowed"]

    def restore_state(self, state: dict) -> None:
        """Undo :meth:`checkpoint_state` (the engine has restored the shards)."""
        self._worker.drain()
        self._steps_called = state["steps_called"]
        self.skipped_steps = state["skipped_steps"]
        self._last_grad_norm = state["last_grad_norm"]
        saved = [state["hyper"], *state.get("group_hypers", [])]  # format 1 had group 0 only
        for group, hyper in zip(self.param_groups, saved):
            group.update(lr=hyper["lr"], betas=tuple(hyper["betas"]), eps=hyper["eps"],
                         weight_decay=hyper["weight_decay"])
        self._host.set_unit_steps(state["unit_steps"])
        if self.scaler is not None and state["loss_scale"] is not None:
            self.scaler.load_state(state["loss_scale"])
        pending = state["pending"]
        self._state.update_restored(None if pending is None else self._book.restored(
            pending["written"], pending["norm"], pending["overflowed"], pending["loss_scale"]))
        self._host.restored()
        self._runtime.step_taken()  # the load dropped the gradients

    def hypers(self) -> tuple[AdamWHyper, ...]:
        """Each param group's hyperparameters as they are now."""
        return tuple(AdamWHyper.from_group(group) for group in self.param_groups)

    def _check_hyper_unchanged(self, last: LastBackward) -> None:
        if self.hypers() != last.hypers:
            warnings.warn(
                "tiered: param_groups changed after the step's last backward started; the units "
                "stepped as their gradients arrived (optimizer.accumulation_steps) used the "
                "values from its start. Set hyperparameters before the last backward (step a "
                "scheduler after optimizer.step(), as PyTorch expects)", stacklevel=3)

    def state_dict(self):
        raise TieredError("optimizer.state_dict() is not supported: TieredAdamW's state (fp32 "
                          "master weights, Adam moments) lives in tiers across ranks, not here")

    def load_state_dict(self, state_dict):
        raise TieredError("optimizer.load_state_dict() is not supported: TieredAdamW's state "
                          "lives in tiers across ranks, not here")
