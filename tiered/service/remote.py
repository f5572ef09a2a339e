"""The trainer's end of a host run by the node's service (service/hosting.py): commands go out in
the order sent, events come back on the channel's reader into the training side's mailboxes,
exactly as a LocalHost's do in-process.

A gradient's command leaves only once its copy off the device is done (the service cannot wait
on a CUDA event): a sender thread waits for each command's event in turn, so backward never
waits for it, and sends every message in the order queued. ``RemoteWorker`` stands where the CPU
worker stands in-process, for the parts that wait for the host (``drain``) or learn of its
failure, which is the host's or the loss of the channel (channel.py): either wakes every
waiter at once. Closures never cross to the service.
"""
from __future__ import annotations

import itertools
import queue
import threading
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Callable

from ..core.errors import RankWent, TieredError
from ..core.timeline import Timeline
from ..optim.commands import Command, GradientIn, HostEvents
from .channel import Channel
from .hostwire import HostRequest, command_to_wire, deliver, span_from_wire
from .paths import ServiceError


class RemoteWorker:
    """The CPU worker's face for a host in the service: ``drain`` waits until the service ran
    every command sent so far; ``failed``, ``raise_if_failed`` and ``on_failure`` say, as the
    in-process worker does, that the host failed, or that the service is gone."""

    def __init__(self, link: "RemoteHost"):
        self._link = link
        self._error: TieredError | None = None
        self.failure_reported = False
        self.failure: Future = Future()
        """Done once the host failed or the channel was lost (what a round trip waits on
        beside its answer)."""
        self._callbacks: list[Callable[[], None]] = []
        self._failing = threading.Lock()

    @property
    def failed(self) -> bool:
        return self._error is not None

    @property
    def error(self) -> str | None:
        return None if self._error is None else str(self._error)

    def on_failure(self, callback: Callable[[], None]) -> None:
        self._callbacks.append(callback)

    def raise_if_failed(self) -> None:
        if self._error is not None:
            self.failure_reported = True
            # The same kind: a rank whose service is gone says so in one line (rank_entry.py).
            raise type(self._error)(f"the CPU worker failed: {self._error}")

    def drain(self) -> None:
        self._link.round_trip("drain")
        self.raise_if_failed()

    def submit(self, task) -> None:
        raise TieredError("this rank's CPU work runs in the node's service, which takes "
                          "commands, not Python callables")

    def close(self) -> None:
        self._link.close()

    def fail(self, error: TieredError) -> None:
        """The host failed, or its channel was lost: every waiter wakes with ``error``."""
        with self._failing:
            if self._error is not None:
                return
            self._error = error
        for callback in self._callbacks:
            callback()
        self.failure.set_result(None)


@dataclass(frozen=True)
class _Outgoing:
    """A message for the sender thread: sent once ``ready`` (a gradient copy's event) is done;
    with ``answer``, as a call whose reply settles it."""

    message: dict
    ready: object = None
    answer: Future | None = None


class RemoteHost:
    """The link to a rank's host in the service; see the module's doc."""

    lands_every_gradient = True
    """Every gradient after a step's first goes through a landing buffer the service can see,
    on a CPU device too (in-process the host adds the reduced shard as it is)."""
    records_steps = True
    """Each ``step()`` call sends its record: the service keeps the job's state to reattach to
    (see [Note: reattach] in commits.py)."""
    device_stream = None
    """The host queues no device work (the service never touches CUDA): what it writes is in
    DRAM or on NVMe, done once a ``drain`` returns."""

    def __init__(self, folder: str, timeline: Timeline, model_state: Callable[[], dict]):
        """A channel to the service in ``folder``, for a host :meth:`start` asks it to run;
        the spans the host times there go to ``timeline``; ``model_state`` makes the model's
        part of each step's record (engine/reattach.py's StepRecorder). Its ``worker`` exists
        from here on, for the mailboxes the host's events will fill."""
        self._channel = Channel.connect(folder)
        self._timeline = timeline
        self._model_state = model_state
        self.worker = RemoteWorker(self)
        self._events: HostEvents | None = None
        self._sequence = itertools.count()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._ended: Future | None = None
        """The answer to ``end_host``, once asked: the host stopped where it is settled well."""
        self._relaying = threading.RLock()
        """Held by the sender from a call's send until its answer is tied to the channel's
        reply: the service may answer ``end_host`` and close the connection before the sender
        thread, descheduled, has tied them, and the loss must see the answer there (an RLock:
        a failed send loses the channel on the sender thread itself)."""
        self._sender = threading.Thread(target=self._send_in_order, name="tiered-host-commands",
                                        daemon=True)
        self._channel.on_lost(self._lost)

    def start(self, job: str, rank: int, request: HostRequest, events: HostEvents) -> None:
        """Have the service run rank ``rank`` of ``job``'s host (it compiles the CPU update
        first, when one is needed); its events go to ``events``."""
        self._events = events
        self._channel.on_event(self._event)
        self._channel.request("host", job=job, rank=rank, request=request.to_wire())
        self._sender.start()

    # -- what the training side calls ----------------------------------------------------------

    def send(self, command: Command) -> None:
        self.worker.raise_if_failed()
        with self._lock:  # numbered in the order queued: the sender keeps it
            message = {**command_to_wire(command), "sequence": next(self._sequence)}
            ready = command.ready if isinstance(command, GradientIn) else None
            self._outbox.put(_Outgoing(message, ready))

    def unit_steps(self) -> list[float]:
        return self.round_trip("unit_steps")["steps"]

    def set_unit_steps(self, steps: list[float]) -> None:
        self._outbox.put(_Outgoing({"op": "set_unit_steps", "steps": list(steps)}))

    def restored(self) -> None:
        self._outbox.put(_Outgoing({"op": "restored"}))

    def params_swapped(self, units: list[int]) -> None:
        """The training side made these units' delayed-update weights current in its tier
        manager; the service's, over the same memory, swaps them too, before the next
        command."""
        if units:
            self._outbox.put(_Outgoing({"op": "params_swapped", "units": list(units)}))

    def step_record(self, step: int, optimizer: dict) -> None:
        """``step()`` call ``step``'s record: the optimizer's part, and the model's made now."""
        self._outbox.put(_Outgoing({"op": "step_record", "step": step, "record": {
            "optimizer": optimizer, "model": self._model_state()}}))

    def round_trip(self, op: str) -> dict:
        """Call ``op`` behind every command sent so far and wait for its answer, or for the
        host's failure or the channel's loss, whichever comes first."""
        answer = self._behind(op)
        if not answer.done() or answer.exception() is not None:
            self.worker.raise_if_failed()  # the failure that settled it, as a failure reported
        return answer.result().fields

    def close(self) -> None:
        """Let the host go: the service runs what was sent, then stops it; this returns once it
        has, so that the rank's detach that follows finds no host of it running (a clean end
        frees the job at once). Bounded when the service dies meanwhile: the channel fails
        the answer at once."""
        if self._closed:
            return
        self._closed = True
        if self._sender.is_alive():
            if not self.worker.failed:
                # A failure meanwhile (the service gone, the host failed: nothing runs there
                # now) is the engine's to report, not raised here, and at exit said once.
                self._ended = self._ask("end_host")  # known before its answer can come
                self._settled(self._ended)
            self._outbox.put(None)
            self._sender.join()
        self._channel.close()

    def _behind(self, op: str) -> Future:
        """Call ``op`` behind every command sent so far; returns once it is answered, the host
        failed or the channel was lost (the answer, settled or not)."""
        return self._settled(self._ask(op))

    def _ask(self, op: str) -> Future:
        """Queue ``op`` behind every command sent so far; its answer comes in the future."""
        answer: Future = Future()
        self._outbox.put(_Outgoing({"op": op}, answer=answer))
        return answer

    def _settled(self, answer: Future) -> Future:
        """``answer``, once it is settled, the host failed or the channel was lost."""
        wait([answer, self.worker.failure], return_when=FIRST_COMPLETED)
        return answer

    # -- its threads ---------------------------------------------------------------------------

    def _lost(self, error: TieredError) -> None:
        """The channel is gone (its reader thread): the host's work is lost with it, unless
        the host had already ended well (the service may close the connection as soon as it
        has answered ``end_host``, whose answer the reader settled before it read the end)."""
        with self._relaying:
            ended = self._ended
            if ended is not None and ended.done() and ended.exception() is None:
                return
        self.worker.fail(error)

    def _send_in_order(self) -> None:
        while (item := self._outbox.get()) is not None:
            try:
                if item.ready is not None:
                    item.ready.synchronize()  # the service reads what this copy writes
                if item.answer is None:
                    self._channel.post(**item.message)
                else:
                    with self._relaying:
                        _relay(self._channel.call(**item.message), item.answer)
            except ServiceError as e:  # lost: the worker failed with it already (on_lost)
                if item.answer is not None:
                    item.answer.set_exception(e)

    def _event(self, message: dict) -> None:
        """An event of the host (the channel's reader thread)."""
        op = message["op"]
        if op == "span":
            span = span_from_wire(message)
            self._timeline.record(span.name, span.category, span.track, span.start_ns,
                                  span.duration_ns, span.args)
        elif op == "failed":
            kind = RankWent if message.get("rank_went") else TieredError
            self.worker.fail(kind(f"in the node's service: {message['error']}"))
        else:
            assert self._events is not None, "an event before the host was started"
            deliver(message, self._events)


def _relay(source: Future, target: Future) -> None:
    """Settle ``target`` as ``source`` settles."""
    def settle(done: Future) -> None:
        if done.exception() is not None:
            target.set_exception(done.exception())
        else:
            target.set_result(done.result())
    source.add_done_callback(settle)
