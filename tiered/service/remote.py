"""The trainer's end of a host run by the node's service (service/hosting.py): commands go out in
the order sent, events come back on a reader thread into the training side's mailboxes, exactly
as a LocalHost's do in-process.

A gradient's command leaves only once its copy off the device is done (the service cannot wait
on a CUDA event): a sender thread waits for each command's event in turn, so backward never
waits for it. ``RemoteWorker`` stands where the CPU worker stands in-process, for the parts that
wait for the host (``drain``) or learn of its failure; closures never cross to the service.
"""
from __future__ import annotations

import itertools
import queue
import socket
import threading
from typing import Callable

from ..core.errors import TieredError
from ..core.timeline import Timeline
from ..optim.commands import Command, GradientIn, HostEvents
from . import wire
from .client import ServiceClient
from .hostwire import HostRequest, command_to_wire


class RemoteWorker:
    """The CPU worker's face for a host in the service: ``drain`` waits until the service ran
    every command sent so far; ``failed``, ``raise_if_failed`` and ``on_failure`` say, as the
    in-process worker does, that the host failed."""

    def __init__(self, link: "RemoteHost"):
        self._link = link
        self._error: str | None = None
        self.failure_reported = False
        self._callbacks = []

    @property
    def failed(self) -> bool:
        return self._error is not None

    @property
    def error(self) -> str | None:
        return self._error

    def on_failure(self, callback) -> None:
        self._callbacks.append(callback)

    def raise_if_failed(self) -> None:
        if self._error is not None:
            self.failure_reported = True
            raise TieredError(f"the CPU worker failed: {self._error}")

    def drain(self) -> None:
        self._link.round_trip("drain")
        self.raise_if_failed()

    def submit(self, task) -> None:
        raise TieredError("this rank's CPU work runs in the node's service, which takes "
                          "commands, not Python callables")

    def close(self) -> None:
        self._link.close()

    def fail(self, error: str) -> None:
        """The host failed (or its connection did): every waiter wakes with ``error``."""
        if self._error is None:
            self._error = error
            for callback in self._callbacks:
                callback()


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
        """A connection to the service in ``folder``, for a host :meth:`start` asks it to run;
        the spans the host times there go to ``timeline``; ``model_state`` makes the model's
        part of each step's record (engine/reattach.py's StepRecorder). Its ``worker`` exists
        from here on, for the mailboxes the host's events will fill."""
        self._client = ServiceClient.connect(folder)
        self._timeline = timeline
        self._model_state = model_state
        self.worker = RemoteWorker(self)
        self._events: HostEvents | None = None
        self._numbers = itertools.count()
        self._requests = itertools.count()
        self._answers: dict[int, dict] = {}
        self._answered = threading.Condition()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._reader = threading.Thread(target=self._read, name="tiered-host-events",
                                        daemon=True)
        self._sender = threading.Thread(target=self._send_in_order, name="tiered-host-commands",
                                        daemon=True)

    def start(self, job: str, rank: int, request: HostRequest, events: HostEvents) -> None:
        """Have the service run rank ``rank`` of ``job``'s host (it compiles the CPU update
        first, when one is needed); its events go to ``events``."""
        self._client.request("host", job=job, rank=rank, request=request.to_wire())
        self._events = events
        self._sock: socket.socket = self._client.socket
        self._sock.settimeout(None)  # events come when they come
        self._reader.start()
        self._sender.start()

    # -- what the training side calls ----------------------------------------------------------

    def send(self, command: Command) -> None:
        self.worker.raise_if_failed()
        with self._lock:  # numbered in the order queued: the sender keeps it
            message = {**command_to_wire(command), "n": next(self._numbers)}
            ready = command.ready if isinstance(command, GradientIn) else None
            self._outbox.put((message, ready))

    def unit_steps(self) -> list[float]:
        return self.round_trip("unit_steps")["steps"]

    def set_unit_steps(self, steps: list[float]) -> None:
        self._outbox.put(({"op": "set_unit_steps", "steps": list(steps)}, None))

    def restored(self) -> None:
        self._outbox.put(({"op": "restored"}, None))

    def params_swapped(self, units: list[int]) -> None:
        """The training side made these units' delayed-update weights current in its tier
        manager; the service's, over the same memory, swaps them too, before the next
        command."""
        if units:
            self._outbox.put(({"op": "params_swapped", "units": list(units)}, None))

    def step_record(self, step: int, optimizer: dict) -> None:
        """``step()`` call ``step``'s record: the optimizer's part, and the model's made now."""
        self._outbox.put(({"op": "step_record", "step": step,
                           "record": {"optimizer": optimizer, "model": self._model_state()}},
                          None))

    def round_trip(self, op: str) -> dict:
        """Send ``op`` behind every command sent so far and wait for its answer."""
        request = next(self._requests)
        self._outbox.put(({"op": op, "request": request}, None))
        with self._answered:
            self._answered.wait_for(lambda: request in self._answers or self.worker.failed)
            if request not in self._answers:
                self.worker.raise_if_failed()
            return self._answers.pop(request)

    def close(self) -> None:
        """Let the host go: the service runs what was sent, then stops it; this returns once it
        has, so that the rank's detach that follows finds no host of it running (a clean end
        frees the job at once)."""
        if self._closed:
            return
        self._closed = True
        if self._sender.is_alive():
            if not self.worker.failed:
                try:
                    self.round_trip("end")
                except TieredError:
                    pass  # the service is gone, or the host failed: nothing runs there now
            self._outbox.put(None)
            self._sender.join()
        try:  # wakes the reader (a close alone may leave its recv waiting)
            self._client.socket.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._client.close()
        if self._reader.is_alive():
            self._reader.join()

    # -- its threads ---------------------------------------------------------------------------

    def _send_in_order(self) -> None:
        while (item := self._outbox.get()) is not None:
            message, ready = item
            try:
                if ready is not None:
                    ready.synchronize()  # the service reads what this copy writes
                wire.send(self._sock, message)
            except OSError as e:
                self.worker.fail(f"the node's service is gone ({e})")
                self._wake()
                return

    def _read(self) -> None:
        events = self._events
        while True:
            try:
                message, fds = wire.receive(self._sock)
            except (wire.WireError, OSError) as e:
                if not self._closed:
                    self.worker.fail(f"the node's service is gone ({e})")
                self._wake()
                return
            op = message["op"]
            if op == "gradient_taken":
                events.gradient_taken(message["unit"], message["ticket"], message["landing"])
            elif op == "buffers_held":
                events.buffers_held(message["units"])
            elif op == "buffers_read":
                events.buffers_read(message["units"])
            elif op == "weights_written":
                events.weights_written(message["units"])
            elif op == "update_norm":
                events.update_norm(message["number"], message["norm"])
            elif op == "update_wrote":
                events.update_wrote(message["number"], message["unit"])
            elif op == "update_done":
                events.update_done(message["number"], message["overflowed"])
            elif op == "span":
                self._timeline.record(message["name"], message["category"], message["track"],
                                      message["start_ns"], message["duration_ns"],
                                      message["args"])
            elif op == "failed":
                self.worker.fail(f"in the node's service: {message['error']}")
                self._wake()
            else:  # an answer to a round trip (drained, unit_steps)
                with self._answered:
                    self._answers[message["request"]] = message
                    self._answered.notify_all()

    def _wake(self) -> None:
        with self._answered:
            self._answered.notify_all()
