"""The service's wire format: one message is a fixed header, then a JSON object.

    magic b"TIER" | protocol version (u16) | body length (u32) | body: UTF-8 JSON object

Messages cross a Unix stream socket. A message may carry file descriptors (memfd segments) as
``SCM_RIGHTS`` ancillary data, sent with its first byte. JSON, never pickle: a message is data,
and a peer that sends garbage gets an error, never code run on its behalf. Every way a message
can be wrong (another magic, another version, a length past ``MAX_BODY``, a body that is not a
JSON object with a string ``op``, JSON nested too deeply to decode, more descriptors than
``MAX_FDS``, a peer that stops mid-message) raises :class:`WireError` naming what was wrong;
descriptors that came with a refused message are closed, so a bad peer cannot leak them into
the service.
"""
from __future__ import annotations

import array
import json
import os
import socket
import struct
from typing import Sequence

from ..core.errors import BudgetError, NvmeError, TieredError
from .paths import ServiceError

MAGIC = b"TIER"
VERSION = 2
"""Bumped whenever a message changes meaning; each side refuses another version by name (2:
every call and its reply carry one ``id``, channel.py)."""
HEADER = struct.Struct("<4sHI")
MAX_BODY = 1 << 20
"""A status of many jobs fits many times over; anything longer is refused unread."""
MAX_FDS = 16
"""Descriptors one message may carry."""


class WireError(TieredError):
    """A message that is not one of ours, or a peer that went away mid-message."""


class Closed(WireError):
    """The peer closed the connection between messages (the ordinary end of a conversation)."""


def send(sock: socket.socket, message: dict, fds: Sequence[int] = ()) -> None:
    """Send ``message`` (a JSON-serialisable dict), with ``fds`` attached to its first byte."""
    body = json.dumps(message, separators=(",", ":")).encode()
    if len(body) > MAX_BODY:
        raise WireError(f"message of {len(body)} bytes is longer than {MAX_BODY}")
    if len(fds) > MAX_FDS:
        raise WireError(f"message carries {len(fds)} descriptors, at most {MAX_FDS} allowed")
    data = HEADER.pack(MAGIC, VERSION, len(body)) + body
    if fds:
        sent = socket.send_fds(sock, [data], list(fds))
        data = data[sent:]
    if data:
        sock.sendall(data)


def receive(sock: socket.socket) -> tuple[dict, list[int]]:
    """The next message and the descriptors it carried (the caller owns and closes them).
    Raises Closed at a clean end between messages, WireError for anything malformed."""
    fds: list[int] = []
    try:
        first, fds = _first_bytes(sock)
        header = first + _exactly(sock, HEADER.size - len(first))
        magic, version, length = HEADER.unpack(header)
        if magic != MAGIC:
            raise WireError(f"not a tiered service message (starts with {magic!r}, not {MAGIC!r})")
        if version != VERSION:
            raise WireError(f"protocol version {version}, but this side speaks version "
                            f"{VERSION}: run the same tiered version on both sides")
        if length > MAX_BODY:
            raise WireError(f"message body of {length} bytes announced, at most {MAX_BODY} "
                            f"allowed")
        body = _exactly(sock, length)
        try:
            message = json.loads(body.decode())
        except ValueError as e:  # bytes that are not UTF-8 (UnicodeDecodeError) or not JSON
            raise WireError(f"message body is not UTF-8 JSON ({e})") from None
        except RecursionError:
            # The decoder recurses once per nested array or object: a short body of brackets
            # (``[[[[...]]]]``) reaches the interpreter's limit, which must not end the thread
            # that reads this peer. No message of ours nests more than a few levels.
            raise WireError("message body is JSON nested too deeply to decode") from None
        if not isinstance(message, dict) or not isinstance(message.get("op"), str):
            raise WireError("message body is not a JSON object with a string 'op'")
        return message, fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _first_bytes(sock: socket.socket) -> tuple[bytes, list[int]]:
    """Up to a header's bytes, with any descriptors sent alongside (they ride the first byte)."""
    space = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
    data, ancillary, flags, _ = sock.recvmsg(HEADER.size, space)
    carried = array.array("i")
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            whole = len(payload) - len(payload) % carried.itemsize
            carried.frombytes(payload[:whole])
    fds = list(carried)
    if flags & socket.MSG_CTRUNC:
        for fd in fds:
            os.close(fd)
        raise WireError(f"message carried more than {MAX_FDS} descriptors")
    if not data:
        for fd in fds:
            os.close(fd)
        raise Closed("the peer closed the connection")
    return data, fds


def _exactly(sock: socket.socket, count: int) -> bytes:
    chunks, left = [], count
    while left:
        chunk = sock.recv(min(left, 1 << 16))
        if not chunk:
            raise WireError(f"the peer closed the connection {left} bytes short of a message")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end, as the kernel saw it connect."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)


def refusal_fields(error: BaseException) -> dict:
    """What a refused call's reply carries besides the words, for the client to raise the same
    error (:func:`refusal`)."""
    if isinstance(error, BudgetError):
        return {"kind": "budget", "shortfalls": error.shortfalls}
    if isinstance(error, NvmeError):
        return {"kind": "nvme", "errno": error.errno, "path": error.path,
                "offset": error.offset, "size": error.size}
    return {}


def refusal(reply: dict, what: str) -> Exception:
    """The error a refused call's reply carries: a BudgetError with its shortfalls for a pool
    too small, an NvmeError with its file and offset for a failed transfer, else a ServiceError
    saying ``what`` with the service's words."""
    error = str(reply.get("error", "no reason given"))
    kind = reply.get("kind")
    if kind == "budget":
        return BudgetError(error, {tier: tuple(pair) for tier, pair
                                   in (reply.get("shortfalls") or {}).items()})
    if kind == "nvme":
        return NvmeError(error, errno=reply.get("errno"), path=reply.get("path"),
                         offset=reply.get("offset"), size=reply.get("size"))
    return ServiceError(f"{what}: {error}")
