"""What the training side knows of the grads-tier buffers and of the gradients on their way to
them: the state that [Note: buffer hand-off] and [Note: gradients in flight] (gradients.py)
describe, shared by the thread running backward and the host's events."""
from __future__ import annotations

import enum
import threading

from ..optim.host import HostWorker
from ..tiers import TierUsage


class BufferState(enum.Enum):
    FREE = "free"
    TAKEN = "taken"
    HELD = "held"


class InFlight:
    """One gradient's device bytes on their way to the grads tier (see [Note: gradients in
    flight]): released once, by whichever thread sees its copy complete first."""

    __slots__ = ("event", "nbytes", "released")

    def __init__(self, event, nbytes: int):
        self.event = event
        self.nbytes = nbytes
        self.released = False

    def copied(self) -> bool:
        return self.event is None or self.event.query()


class GradientBuffers:
    """What the training side knows of each grads-tier buffer and of the gradients on their way
    to it (see [Note: buffer hand-off] and [Note: gradients in flight]): changed by the thread
    running backward and by the host's events (HostEvents.gradient_taken, .buffers_read), under
    one condition that a failed worker also wakes."""

    def __init__(self, units: int, landing: list[str], usage: TierUsage, worker: HostWorker,
                 slots: int):
        self.usage = usage
        """The HBM tier's bytes, which gradients in flight hold."""
        self._slots = slots
        """``grads.landing_slots``."""
        self._worker = worker
        self._changed = threading.Condition()
        self._states = [BufferState.FREE] * units
        self._in_flight = 0
        """Gradients holding device bytes; backward waits at ``grads.landing_slots``."""
        self._landing = list(landing)
        """Free pinned landing buffers (for gradients after a step's first)."""
        self._tickets: dict[int, InFlight] = {}
        """The gradients the host has not taken in yet, by ticket."""
        self._next_ticket = 0
        worker.on_failure(self._wake)

    def reserve(self, unit: int, first: bool, needs_landing: bool) -> str | None:
        """The thread running backward: wait for room on the way to the grads tier (and, for a
        first gradient, for the unit's buffer to be FREE; it becomes TAKEN); returns a landing
        buffer when one is needed."""
        with self._changed:
            self._changed.wait_for(lambda: self._worker.failed or (
                self._in_flight < self._slots
                and (not first or self._states[unit] is BufferState.FREE)
                and (not needs_landing or self._landing)))
            self._worker.raise_if_failed()
            self._in_flight += 1
            if first:
                self._states[unit] = BufferState.TAKEN
            return self._landing.pop() if needs_landing else None

    def unreserve(self, unit: int, first: bool, landing: str | None) -> None:
        """Undo :meth:`reserve` (the gradient never left)."""
        with self._changed:
            self._in_flight -= 1
            if first:
                self._states[unit] = BufferState.FREE
            if landing is not None:
                self._landing.append(landing)
            self._changed.notify_all()

    def sent(self, event, nbytes: int) -> tuple[int, InFlight]:
        """A gradient holding ``nbytes`` of the device until ``event`` leaves for the host;
        returns the ticket the host names it by, and its record."""
        in_flight = InFlight(event, nbytes)
        with self._changed:
            ticket = self._next_ticket
            self._next_ticket += 1
            self._tickets[ticket] = in_flight
        return ticket, in_flight

    def forget(self, ticket: int) -> None:
        """The gradient of ``ticket`` was never sent (the send failed)."""
        with self._changed:
            self._tickets.pop(ticket, None)

    def waiting_for_copies(self) -> bool:
        with self._changed:
            return self._in_flight >= self._slots

    def release(self, in_flight: InFlight) -> None:
        """Its device bytes are free (its copy off the device has run)."""
        with self._changed:
            if in_flight.released:
                return
            in_flight.released = True
            self._in_flight -= 1
            self._changed.notify_all()
        self.usage.release(in_flight.nbytes)

    # -- the host's events ---------------------------------------------------------------------

    def gradient_taken(self, unit: int, ticket: int, landing: str | None) -> None:
        with self._changed:
            in_flight = self._tickets.pop(ticket)
            # An update may have read the buffer since it was filled (a step without zero_grad
            # in between): the next one reads this sum, so backward must not fill it till then.
            self._states[unit] = BufferState.HELD
            if landing is not None:
                self._landing.append(landing)
            self._changed.notify_all()
        self.release(in_flight)

    def buffers_held(self, units: list[int]) -> None:
        with self._changed:
            for unit in units:
                self._states[unit] = BufferState.HELD

    def buffers_read(self, units: list[int]) -> None:
        """HELD buffers of ``units`` become FREE. A TAKEN one is a backward's after the
        zero_grad that dropped it: it stays taken."""
        with self._changed:
            for unit in units:
                if self._states[unit] is BufferState.HELD:
                    self._states[unit] = BufferState.FREE
            self._changed.notify_all()

    def _wake(self) -> None:
        with self._changed:
            self._changed.notify_all()
