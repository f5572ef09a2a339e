"""The service's end of one connection: who is at the other end, what it has become (a rank, a
launcher's hold, a hosted rank's host, a rank's NVMe files), and how it is answered.

[Note: one dispatch table]
Every message a connection sends is routed by its ``op`` through one table (server.ROUTES),
whose every entry says in which phase of a connection the op is asked: CONTROL (what any client
asks: hello, status, attach, reserve, ...), HOST (the commands and calls of a rank whose host
runs here, once it asked ``host``) or FILES (the transfers of a rank's NVMe tier, once it asked
``files``), and whether it is a call or a post. A call is answered once, with its ``id`` (its
reply, or why it was refused), at once or later (a drain once the host ran what came before
it, a read once its bytes have moved); a post is not, and its failure ends the conversation (a
command that did not run leaves nothing after it that can). An op no route takes is refused as
a call. channel.py is the other end.
"""
from __future__ import annotations

import enum
import socket
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

from . import wire
from .files import FileStream
from .hosting import HostedRank
from .jobs import RefusedError

class Phase(enum.Enum):
    """What a connection carries (see [Note: one dispatch table])."""

    CONTROL = "request"
    HOST = "host request"
    FILES = "NVMe request"


Answer = tuple[dict, list[int]]
"""A reply's fields and the descriptors it carries."""


@dataclass(frozen=True)
class Route:
    phase: Phase
    handle: Callable[..., Answer | None]
    """Takes the service, the conversation and the message (server.py); answers a call now, or
    returns None: a post, or a call it answers later itself."""
    call: bool = True
    """Whether the op is a call (answered, its refusal too), else a post."""


class Conversation:
    """One connection: who is at the other end, and which rank of which job it attached as."""

    def __init__(self, conn: socket.socket):
        self.conn = conn
        self.pid: int | None = None
        self.attached: tuple[str, int] | None = None
        """(job, rank) once attached, until a detach."""
        self.holds: str | None = None
        """The job this connection's launcher holds, until it lets go."""
        self.hosted: tuple[str, HostedRank] | None = None
        """The job and the rank's host this connection runs (hosting.py)."""
        self.files: tuple[str, int, FileStream] | None = None
        """The job, the rank and the stream of the NVMe files this connection serves
        (files.py)."""
        self.over = False
        """The conversation has ended (a host's or a file stream's end): the connection
        closes."""
        self._sending = threading.Lock()  # a host's events, transfers' answers and replies

    @property
    def phase(self) -> Phase:
        if self.hosted is not None:
            return Phase.HOST
        return Phase.FILES if self.files is not None else Phase.CONTROL

    @property
    def host(self) -> HostedRank:
        """The rank's host (what a HOST route is routed to)."""
        assert self.hosted is not None, "a host's request on a connection that runs none"
        return self.hosted[1]

    @property
    def file_stream(self) -> FileStream:
        """The rank's NVMe file stream (what a FILES route is routed to)."""
        assert self.files is not None, "an NVMe request on a connection that serves none"
        return self.files[2]

    def rank_of(self, op: str) -> tuple[str, int]:
        if self.attached is None:
            raise RefusedError(f"{op!r} needs an attached rank: send 'attach' first")
        return self.attached

    def reply(self, call: int | None, fields: dict, fds: Sequence[int] = ()) -> None:
        """Answer call ``call``; a client that is gone is told nothing (its connection's end is
        what the service then sees)."""
        try:
            self.send({"op": "reply", "id": call, "ok": True, **fields}, fds)
        except OSError:
            pass

    def reply_error(self, call: int | None, error: str, **extra) -> None:
        """Refuse call ``call`` (None: a message that was no call, which the client hears as
        its connection's end)."""
        try:
            self.send({"op": "reply", "id": call, "ok": False, "error": error, **extra})
        except OSError:
            pass

    def send(self, message: dict, fds: Sequence[int] = ()) -> None:
        with self._sending:
            wire.send(self.conn, message, fds)


def checked(message: dict, key: str, kind: type):
    """``message[key]``, which must be a ``kind``."""
    value = message.get(key)
    # bool is an int in Python; a rank of True is no rank.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise RefusedError(f"request {message['op']!r} needs {key!r} as {kind.__name__}, got "
                           f"{value!r}")
    return value
