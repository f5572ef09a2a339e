"""The service's socket under hostile or heavy use (issue 30): a body no decoder can take gets an
error reply and the service serves on; a burst of connections is queued, not refused; and a
client whose connect meets a full backlog waits for room within its timeout.

The service is a real one (started as ``tiered daemon start`` starts one); the full backlog a
client meets is a real listening socket that nobody accepts from.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import psutil
import pytest

from tiered.service import (Channel, ServiceError, service_paths, service_status, start_service,
                            stop_service, wire)
from tiered.service.channel import REFUSED_SECONDS
from tiered.service.paths import ServicePaths


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("wire") / "service")
    pid = start_service(folder, dram=1 << 20)
    yield folder, pid
    stop_service(folder)


def raw(path: str) -> socket.socket:
    """A connection as any process could open it; with a timeout, as every client of ours has,
    so that a full backlog refuses it at once (EAGAIN) rather than blocking."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        raise
    return sock


def framed(body: bytes) -> bytes:
    """``body`` behind a correct header: only the body is wrong."""
    return wire.HEADER.pack(wire.MAGIC, wire.VERSION, len(body)) + body


def dropped(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


DEEP = 100_000
UNDECODABLE = {
    "nested arrays": (b"[" * DEEP + b"]" * DEEP, "JSON nested too deeply to decode"),
    "nested objects": (b'{"a":' * DEEP + b"1" + b"}" * DEEP, "JSON nested too deeply to decode"),
    "a request with a nested field": (
        b'{"op":"status","x":' + b"[" * DEEP + b"]" * DEEP + b"}",
        "JSON nested too deeply to decode"),
    "a number past Python's digits": (b'{"op":"status","x":' + b"9" * 5000 + b"}",
                                      "not UTF-8 JSON"),
    "a JSON string": (json.dumps("status").encode(), "not a JSON object with a string 'op'"),
    "a number as op": (b'{"op":7}', "not a JSON object with a string 'op'"),
}
"""Each: a body sent behind a correct header, and what the error reply says."""


@pytest.mark.parametrize("case", sorted(UNDECODABLE))
def test_a_body_no_decoder_takes_gets_an_error_reply_and_the_service_serves_on(service, case):
    folder, pid = service
    body, said = UNDECODABLE[case]
    with raw(service_paths(folder).socket) as sock:
        sock.sendall(framed(body))
        reply, fds = wire.receive(sock)
        assert fds == []
        assert reply["ok"] is False and said in reply["error"], reply
        assert dropped(sock)
    assert psutil.pid_exists(pid)
    assert service_status(folder)["service"]["pid"] == pid  # a new connection is answered
    with open(service_paths(folder).log) as log:
        assert "Traceback" not in log.read()


def test_a_burst_of_connections_is_queued_while_the_service_accepts_none(service):
    """Every rank of a node's jobs connects at once as a run starts: while the service accepts
    none (stopped here, to make the burst outrun it for certain), the kernel queues them all."""
    folder, pid = service
    with open("/proc/sys/net/core/somaxconn") as f:
        cap = int(f.read())
    burst = 256
    if cap < burst:
        pytest.skip(f"net.core.somaxconn is {cap}: the kernel caps every backlog below {burst}")
    connections = []
    os.kill(pid, signal.SIGSTOP)
    try:
        for _ in range(burst):
            connections.append(raw(service_paths(folder).socket))
    finally:
        os.kill(pid, signal.SIGCONT)
        for sock in connections:
            sock.close()
    assert len(connections) == burst
    assert service_status(folder)["service"]["pid"] == pid


class FullBacklog:
    """A real listening socket (backlog 1) that accepts nothing, filled until the kernel refuses
    connects with EAGAIN; ``drain`` then accepts every connection, answering ``hello``."""

    def __init__(self, folder: str):
        os.makedirs(folder, mode=0o700)
        self.paths = ServicePaths(folder)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.paths.socket)
        self.listener.listen(1)
        self.listener.settimeout(0.05)
        self.fillers = []
        while True:
            try:
                self.fillers.append(raw(self.paths.socket))
            except BlockingIOError:
                break
            assert len(self.fillers) < 16, "the backlog of 1 took 16 connections"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def drain_after(self, seconds: float) -> None:
        self._thread = threading.Thread(target=self._drain, args=(seconds,), daemon=True)
        self._thread.start()

    def _drain(self, seconds: float) -> None:
        if self._stop.wait(seconds):
            return
        for sock in self.fillers:  # they are accepted below, and read as closed at once
            sock.close()
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except socket.timeout:
                continue
            with conn:
                try:
                    message, _ = wire.receive(conn)
                except wire.Closed:
                    continue
                wire.send(conn, {"op": "reply", "id": message["id"], "ok": True,
                                  "answered": message["op"]})

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for sock in self.fillers:
            sock.close()
        self.listener.close()


@pytest.fixture
def full_backlog(tmp_path):
    backlog = FullBacklog(str(tmp_path / "service"))
    yield backlog
    backlog.close()


def test_a_client_that_meets_a_full_backlog_connects_once_there_is_room(full_backlog):
    with pytest.raises(BlockingIOError):  # what any connect meets now
        raw(full_backlog.paths.socket)
    full_backlog.drain_after(0.3)
    began = time.monotonic()
    client = Channel(full_backlog.paths, timeout=5.0)
    try:
        assert 0.25 < time.monotonic() - began < 3.0
        reply, _ = client.request("hello")
        assert reply["answered"] == "hello"
    finally:
        client.close()


def test_a_backlog_that_stays_full_fails_within_the_clients_timeout(full_backlog):
    began = time.monotonic()
    with pytest.raises(ServiceError, match="took no connection within 0.4 s: its backlog "
                                           "stayed full"):
        Channel(full_backlog.paths, timeout=0.4)
    assert 0.4 <= time.monotonic() - began < 2.0


def test_a_missing_socket_fails_at_once_and_a_dead_services_socket_soon(tmp_path):
    folder = tmp_path / "service"
    folder.mkdir(mode=0o700)
    paths = ServicePaths(str(folder))
    began = time.monotonic()
    with pytest.raises(ServiceError, match="no tiered service runs in"):
        Channel(paths, timeout=5.0)
    assert time.monotonic() - began < 0.1
    # A socket file nothing listens on, as a killed service leaves: refused (ECONNREFUSED),
    # tried again only briefly, however long the client would wait for a reply.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(paths.socket)
        began = time.monotonic()
        with pytest.raises(ServiceError, match="no tiered service runs in"):
            Channel(paths, timeout=5.0)
        assert time.monotonic() - began < REFUSED_SECONDS + 0.5
