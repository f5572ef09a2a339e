"""One connection to the node's service, the only way any part of a trainer or a launcher talks to
it: ``call`` sends a request and returns a future of its reply, ``post`` sends a message that has
none, and what the service sends unasked (a hosted rank's events) goes to one handler.

[Note: one channel]
A request carries ``id``, a number of this channel's, and its reply carries the same ``id``, so
replies may come in any order (an NVMe read answers when its bytes have moved, a drain once the
host ran what came before it) and many requests may wait at once. A message from the service
without an ``id`` is an event. One reader thread takes every message off the socket; callers
never read it.

A channel is lost when its connection is: the service died (its socket reads as closed), a
message came malformed, or a send failed. Then every future still waiting fails with
:class:`ServiceLost`, which names the service's socket and pid, the handlers given to
``on_lost`` run, and every later ``call`` or ``post`` raises it at once. Nothing waits for an
answer that cannot come, whichever thread is waiting and whatever it waits in (a rank's exit
waits in its host's last round trip, which the service may die during). Closing a channel
here ends it the same way, as closed by this side.
"""
from __future__ import annotations

import itertools
import os
import socket
import threading
import time
from concurrent.futures import Future
from typing import Callable, NamedTuple

from . import wire
from .paths import ServiceError, ServicePaths, service_paths

REPLY_SECONDS = 600.0
"""How long a synchronous request may wait for its reply: reserving a segment of many GiB zeroes
every page (about 10 s per 100 GiB), and a service that does not answer in this long is stuck."""
REFUSED_SECONDS = 0.5
"""How long a socket that nothing listens on is tried again: a service between binding its
socket and listening on it is ready within microseconds; a killed one's socket never is."""


class ServiceLost(ServiceError):
    """The connection to the node's service is gone: what waited for an answer fails with this,
    and so does every later call (see [Note: one channel])."""


class Reply(NamedTuple):
    """A request's answer: its fields, and the descriptors it carried (the caller's to close)."""

    fields: dict
    fds: list[int]


EventHandler = Callable[[dict], None]
"""Takes a message the service sent unasked (its ``op`` names it)."""


class Channel:
    """One connection to the node's service (see [Note: one channel])."""

    def __init__(self, paths: ServicePaths, timeout: float = REPLY_SECONDS):
        """Connect to the service at ``paths``; ``timeout`` bounds the wait for room in its
        backlog and, in :meth:`request`, for a reply."""
        self.paths = paths
        self.timeout = timeout
        self._sock = _connected(paths, timeout)
        self._sock.settimeout(None)  # the reader waits for as long as the service lives
        self.pid: int = wire.peer_credentials(self._sock)[0]
        """The service's process, as the kernel saw it listen."""
        self._ids = itertools.count()
        self._state = threading.Lock()
        """Guards the pending futures and whether the channel has ended."""
        self._pending: dict[int, Future] = {}
        self._ended: ServiceError | None = None
        """Why the channel ended (lost, or closed here); None while it serves."""
        self._closed_here = False
        self._sending = threading.Lock()  # one message's bytes at a time on the socket
        self._on_event: EventHandler | None = None
        self._on_lost: list[Callable[[ServiceLost], None]] = []
        self._reader = threading.Thread(target=self._read, name="tiered-service-channel",
                                        daemon=True)
        self._reader.start()

    @classmethod
    def connect(cls, folder: str | None = None, timeout: float = REPLY_SECONDS) -> "Channel":
        return cls(service_paths(folder), timeout)

    # -- what a client calls ---------------------------------------------------------------------

    def call(self, op: str, **fields) -> Future:
        """Send request ``op``; the future is its Reply, or the service's refusal (refusal()),
        or ServiceLost."""
        answer: Future = Future()
        with self._state:
            self._raise_if_ended()
            number = next(self._ids)
            self._pending[number] = answer
        self._send({"op": op, "id": number, **fields})
        return answer

    def request(self, op: str, **fields) -> Reply:
        """``call`` and wait for its reply (at most the channel's timeout)."""
        answer = self.call(op, **fields)
        try:
            return answer.result(self.timeout)
        except TimeoutError:
            raise ServiceError(f"the tiered service at {self.paths.socket} (pid {self.pid}) did "
                               f"not answer {op!r} within {self.timeout:g} s") from None

    def post(self, op: str, **fields) -> None:
        """Send ``op``, which the service answers with no reply."""
        with self._state:
            self._raise_if_ended()
        self._send({"op": op, **fields})

    def on_event(self, handler: EventHandler) -> None:
        """Hand every event to ``handler``, on the reader thread, in the order they come."""
        self._on_event = handler

    def on_lost(self, handler: Callable[[ServiceLost], None]) -> None:
        """Call ``handler`` once, when the channel is lost, before any waiting future fails."""
        self._on_lost.append(handler)

    @property
    def ended(self) -> bool:
        """Lost, or closed here: nothing more can be asked."""
        return self._ended is not None

    @property
    def closed(self) -> bool:
        """Closed here (:meth:`close`)."""
        return self._closed_here

    def close(self) -> None:
        """End the connection; what still waits fails as closed by this side (not lost: the
        ``on_lost`` handlers do not run). Once is enough; more do nothing."""
        if self._closed_here:
            return
        self._closed_here = True
        self._end(ServiceError(f"the connection to the tiered service at {self.paths.socket} "
                               f"(pid {self.pid}) was closed by this process"))
        try:  # wakes the reader (a close alone may leave its recv waiting)
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if threading.current_thread() is not self._reader:
            self._reader.join()
        self._sock.close()

    # -- the socket ------------------------------------------------------------------------------

    def _send(self, message: dict) -> None:
        try:
            with self._sending:
                wire.send(self._sock, message)
        except OSError as e:
            self._lose(f"a send failed ({e.strerror or e})")
            with self._state:
                self._raise_if_ended()

    def _read(self) -> None:
        while True:
            try:
                message, fds = wire.receive(self._sock)
            except wire.Closed:
                self._lose("closed the connection")
                return
            except (wire.WireError, OSError) as e:
                self._lose(f"broke the connection ({e})")
                return
            if "id" not in message:
                self._event(message, fds)
                continue
            with self._state:
                answer = self._pending.pop(message["id"], None)
            if answer is None:
                _close_all(fds)
                self._lose(f"answered a request this side did not send: {message}")
                return
            if message.get("ok"):
                answer.set_result(Reply(message, fds))
            else:
                _close_all(fds)
                answer.set_exception(wire.refusal(message, f"the tiered service at "
                                                           f"{self.paths.socket} refused"))

    def _event(self, message: dict, fds: list[int]) -> None:
        _close_all(fds)  # no event of ours carries descriptors
        if self._on_event is None:
            self._lose(f"sent {message['op']!r} unasked")
            return
        try:
            self._on_event(message)
        except Exception as e:  # an event this side cannot take: nothing after it can be trusted
            self._lose(f"sent an event this side could not take ({type(e).__name__}: {e})")

    def _lose(self, why: str) -> None:
        self._end(ServiceLost(f"the node's service is gone: the tiered service at "
                              f"{self.paths.socket} (pid {self.pid}) {why}"))

    def _end(self, error: ServiceError) -> None:
        """Fail everything that waits with ``error``, and every later call, once; a ServiceLost
        (the connection went by itself) the ``on_lost`` handlers hear first (see [Note: one
        channel])."""
        with self._state:
            if self._ended is not None:
                return
            self._ended = error
            waiting, self._pending = self._pending, {}
        if isinstance(error, ServiceLost):
            for handler in self._on_lost:
                handler(error)
        for answer in waiting.values():
            answer.set_exception(error)

    def _raise_if_ended(self) -> None:
        if self._ended is not None:
            raise type(self._ended)(str(self._ended))


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def _connected(paths: ServicePaths, timeout: float) -> socket.socket:
    """A socket connected to the service, tried again with a growing pause while the service
    cannot take it yet: a full backlog for up to ``timeout``, a socket nothing listens on for up
    to REFUSED_SECONDS. A missing socket fails at once."""
    start = time.monotonic()
    pause = 0.001
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(paths.socket)
            return sock
        except OSError as e:
            sock.close()
            if isinstance(e, BlockingIOError):
                # A full backlog: a burst of connections outran the service's accepts, and the
                # kernel refuses a socket with a timeout at once (EAGAIN), unqueued.
                patience = timeout
            elif isinstance(e, ConnectionRefusedError):
                patience = min(timeout, REFUSED_SECONDS)
            else:
                patience = 0.0
            left = patience - (time.monotonic() - start)
            if left > 0:
                time.sleep(min(pause, left))
                pause = min(2 * pause, 0.05)
                continue
            if isinstance(e, BlockingIOError):
                raise ServiceError(f"the tiered service at {paths.socket} took no connection "
                                   f"within {timeout:g} s: its backlog stayed full") from None
            if isinstance(e, (FileNotFoundError, ConnectionRefusedError)):
                raise ServiceError(f"no tiered service runs in {paths.folder} (start one with "
                                   f"'tiered daemon start', or train without one: tiered-launch "
                                   f"--no-daemon)") from None
            raise ServiceError(f"cannot reach the tiered service at {paths.socket}: "
                               f"{e.strerror}") from None
