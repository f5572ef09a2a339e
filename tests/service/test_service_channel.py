"""The channel to the node's service (tiered/service/channel.py, [Note: one channel]): replies find
their calls by ``id`` in whatever order they come, events reach the handler in order, and when
the connection is lost every call still waiting fails at once with ServiceLost naming the
service's socket and pid, and so does every later call.

The service here is a real listening socket in this process that answers as the test says, so
that the order of replies and the moment the connection ends are the test's to choose."""
from __future__ import annotations

import os
import socket
import threading
from concurrent.futures import wait

import pytest
from helpers import run_with_deadline

from tiered.service import Channel, ServiceLost, wire
from tiered.service.paths import ServicePaths


class Scripted:
    """A listening socket that accepts one connection and runs ``script(conn)`` on it."""

    def __init__(self, folder: str, script):
        os.makedirs(folder, mode=0o700)
        self.paths = ServicePaths(folder)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.paths.socket)
        self.listener.listen(1)
        self.thread = threading.Thread(target=self._serve, args=(script,), daemon=True)
        self.thread.start()

    def _serve(self, script) -> None:
        conn, _ = self.listener.accept()
        with conn:
            script(conn)

    def close(self) -> None:
        self.thread.join(timeout=10)
        self.listener.close()


def received(conn: socket.socket, count: int) -> list[dict]:
    return [wire.receive(conn)[0] for _ in range(count)]


def test_replies_find_their_calls_in_any_order_and_events_come_in_order(tmp_path):
    events = []

    def script(conn):
        calls = received(conn, 3)
        wire.send(conn, {"op": "progress", "step": 1})
        for call in reversed(calls):
            wire.send(conn, {"op": "reply", "id": call["id"], "ok": True, "echo": call["x"]})
        wire.send(conn, {"op": "progress", "step": 2})
        received(conn, 1)  # the end of the test: the channel's close

    service = Scripted(str(tmp_path / "service"), script)
    channel = Channel(service.paths, timeout=10)
    channel.on_event(events.append)
    try:
        answers = [channel.call("echo", x=x) for x in range(3)]
        assert [answer.result(10).fields["echo"] for answer in answers] == [0, 1, 2]
        run_with_deadline(lambda: wait_for(lambda: len(events) == 2), 10)
        assert [event["step"] for event in events] == [1, 2]
        channel.post("bye")
    finally:
        channel.close()
        service.close()


def test_a_lost_connection_fails_every_waiting_call_and_every_later_one(tmp_path):
    def script(conn):
        first, second, third = received(conn, 3)
        wire.send(conn, {"op": "reply", "id": second["id"], "ok": True})
        # and the service dies: its end of the connection closes

    service = Scripted(str(tmp_path / "service"), script)
    channel = Channel(service.paths, timeout=10)
    heard = []
    channel.on_lost(heard.append)
    try:
        answers = [channel.call("work") for _ in range(3)]
        run_with_deadline(lambda: wait(answers), 10)
        assert answers[1].result().fields["ok"] is True
        named = f"the tiered service at {service.paths.socket} (pid {os.getpid()})"
        for answer in (answers[0], answers[2]):
            with pytest.raises(ServiceLost, match="the node's service is gone") as lost:
                answer.result()
            assert named in str(lost.value)
        assert len(heard) == 1 and named in str(heard[0])
        with pytest.raises(ServiceLost, match="closed the connection"):
            channel.call("more")  # at once, not a future that never settles
        with pytest.raises(ServiceLost):
            channel.post("more")
        assert channel.ended and not channel.closed  # lost, not closed here
    finally:
        channel.close()
        service.close()


def test_a_close_here_fails_what_waits_without_calling_it_lost(tmp_path):
    def script(conn):
        received(conn, 1)
        conn.recv(1)  # until the client closes

    service = Scripted(str(tmp_path / "service"), script)
    channel = Channel(service.paths, timeout=10)
    heard = []
    channel.on_lost(heard.append)
    answer = channel.call("work")
    channel.close()
    service.close()
    with pytest.raises(Exception, match="was closed by this process"):
        answer.result(10)
    assert heard == []


def wait_for(condition) -> None:
    while not condition():
        threading.Event().wait(0.01)
