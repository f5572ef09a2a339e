"""The node's tier service as its clients meet it (issue 18): a real service process on a real
Unix socket, real memfd segments shared with this process, and bad clients of every kind.

Each test gets a service of its own in a folder of its own, started as ``tiered daemon start``
starts one (in the background, detached) and stopped after; what it holds for a job is
checked through ``status``, and what it hands out through the bytes both sides see.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

from tiered.core.errors import BudgetError
from tiered.core.sizes import format_size
from tiered.device import CpuAccelerator
from tiered.launch.cli import main as tiered
from tiered.service import (Channel, ServiceError, ServiceSlabSource, service_paths, service_status,
                            start_service, stop_service, wire)
from tiered.service.identity import this_code
from tiered.service.paths import RUNTIME_ENV
from tiered.service.remote_nvme import ServiceNvme
from tiered.tiers.aio import IoSettings


@pytest.fixture
def folder(tmp_path):
    where = tmp_path / "service"
    yield str(where)
    if os.path.exists(where):
        stop_service(str(where))


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One service for the tests that leave it as they found it: a 2 MiB DRAM pool, a failed
    job's state kept for 1 s."""
    folder = str(tmp_path_factory.mktemp("shared") / "service")
    pid = start_service(folder, dram=2 << 20, keep_seconds=1.0)
    yield folder, pid
    stop_service(folder)


@pytest.fixture
def service(shared):
    """The shared service, holding nothing (checked after the test, too)."""
    folder, _ = shared
    assert service_status(folder)["dram"]["used"] == 0
    yield shared
    wait_until(lambda: service_status(folder)["jobs"] == [])
    assert service_status(folder)["dram"]["used"] == 0


@pytest.fixture
def own_service(folder):
    """A service for a test that stops or kills it."""
    return folder, start_service(folder, dram=2 << 20, keep_seconds=1.0)


def attached(folder: str, job: str, rank: int = 0, world: int = 1) -> ServiceSlabSource:
    """A rank attached as a trainer process of its own would (its first engine)."""
    return ServiceSlabSource(Channel.connect(folder), job, rank, world, CpuAccelerator(),
                             engine=0)


def job_status(folder: str, name: str) -> dict | None:
    return next((job for job in service_status(folder)["jobs"] if job["name"] == name), None)


def wait_until(condition, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the service never got there"
        time.sleep(0.05)


# --- lifecycle -----------------------------------------------------------------------------

def test_the_daemon_commands_start_report_and_stop_a_service_that_leaves_nothing(
        folder, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv(RUNTIME_ENV, folder)
    nvme = tmp_path / "nvme"
    dead = nvme / f"tiered-{socket.gethostname()}-{2**22 + 1}-abcdef-rank0"  # no such pid
    (dead / "extent-00000.bin").parent.mkdir(parents=True)
    (dead / "extent-00000.bin").write_bytes(b"x" * 4096)

    def tiered_daemon(*args) -> tuple[int, str, str]:
        code = tiered(["daemon", *args])
        out, err = capsys.readouterr()
        return code, out, err

    code, _, err = tiered_daemon("start", "--cores", "3-1")
    assert code == 2 and "--cores '3-1': expected a list such as 0-7,12,14-15" in err, err
    assert not os.path.exists(folder)
    code, _, err = tiered_daemon("start", "--nvme", str(tmp_path / "none"))
    assert code == 2 and f"NVMe path {tmp_path / 'none'} does not exist" in err, err
    code, out, err = tiered_daemon("start", "--dram", "1MiB", "--nvme", str(nvme))
    assert code == 0, err
    assert os.listdir(nvme) == []  # a dead run's folder, removed as the service started
    pid = int(out.split("pid ")[1].split(")")[0])
    process = psutil.Process(pid)
    # Detached: no child of the command that started it, in a session of its own.
    assert process.ppid() != os.getpid() and os.getsid(pid) == pid
    assert oct(os.stat(folder).st_mode & 0o777) == "0o700"
    code, _, err = tiered_daemon("start")
    assert code == 2 and "already runs" in err, err

    code, out, _ = tiered_daemon("status")
    assert code == 0 and "DRAM pool: 0 B of 1.00 MiB held" in out, out
    assert f"; NVMe files under {nvme}\n" in out, out
    rank = attached(folder, "elsewhere")
    with pytest.raises(ServiceError, match=f"this service makes NVMe files only under {nvme} "
                                           f"\\(tiered daemon start --nvme\\); job elsewhere's "
                                           f"nvme.path is {tmp_path}"):
        ServiceNvme(rank, str(tmp_path), None, 0, IoSettings(4096, 1))
    rank.close(clean=True)
    code, out, _ = tiered_daemon("status", "--json")
    as_json = json.loads(out)
    assert as_json["service"]["pid"] == pid
    assert as_json["dram"] == {"budget": 1 << 20, "used": 0, "spare": 0}

    code, out, _ = tiered_daemon("stop")
    assert code == 0 and f"pid {pid}" in out
    assert not os.path.exists(service_paths(folder).socket)  # gone before the stop returns
    process.wait(timeout=10)
    code, _, err = tiered_daemon("status")
    assert code == 1 and "no tiered service runs" in err


def memfds_of(pid: int, nbytes: int, value: int) -> list[str]:
    """The descriptors of process ``pid`` that are segments of ``nbytes`` all ``value``."""
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        path = f"/proc/{pid}/fd/{fd}"
        try:
            if os.readlink(path).startswith("/memfd:tiered-") and os.stat(path).st_size == nbytes:
                with open(path, "rb") as theirs:
                    if theirs.read() == bytes([value]) * nbytes:
                        found.append(fd)
        except OSError:  # closed meanwhile
            pass
    return found


def test_memory_of_a_segment_is_shared_and_counted_per_job_and_rank(service):
    folder, pid = service
    source = attached(folder, "shared", rank=1, world=2)
    slab = source(64 << 10)
    slab.fill_(7)
    rank = job_status(folder, "shared")["ranks"][0]
    assert rank == {"rank": 1, "pid": os.getpid(), "attached": True, "dram_bytes": 64 << 10,
                    "segments": 1, "host": "trainer", "threads": None, "last_step": None,
                    "busy": None}
    assert service_status(folder)["dram"]["used"] == 64 << 10
    # The service holds the memory this process wrote (its memfd, reached through /proc).
    held = memfds_of(pid, 64 << 10, 7)
    assert len(held) == 1, os.listdir(f"/proc/{pid}/fd")
    with open(f"/proc/{pid}/fd/{held[0]}", "rb") as theirs:
        assert theirs.read() == bytes([7]) * (64 << 10)
    source.release(slab)
    assert service_status(folder)["dram"]["used"] == 0
    source.close(clean=True)
    assert job_status(folder, "shared") is None


def test_a_job_that_ended_leaves_its_segments_to_the_next_and_they_give_way_to_a_budget(
        service, capsys, monkeypatch):
    """The warm start: a segment freed with its job is a spare, handed as it is to the next
    reservation of its size (no new memfd, its pages there); spares count against the pool and
    go first when a reservation needs their room."""
    folder, pid = service
    before = service_status(folder)["dram"]["spare"]  # what earlier tests' jobs left: < 1 MiB
    first = attached(folder, "first")
    first(1 << 20).fill_(5)
    first.close(clean=True)
    assert service_status(folder)["dram"] == {"budget": 2 << 20, "used": 0,
                                              "spare": before + (1 << 20)}
    monkeypatch.setenv(RUNTIME_ENV, folder)
    assert tiered(["daemon", "status"]) == 0
    spare = format_size(before + (1 << 20))
    assert f"DRAM pool: 0 B of 2.00 MiB held, {spare} kept spare for the next jobs; " in \
        capsys.readouterr().out
    second = attached(folder, "second")
    reused = second(1 << 20)
    assert int(reused[:4096].sum()) == 5 * 4096  # the same memory, as the first job left it
    assert len(memfds_of(pid, 1 << 20, 5)) == 1  # and no second memfd of its size
    assert service_status(folder)["dram"] == {"budget": 2 << 20, "used": 1 << 20,
                                              "spare": before}
    second.close(clean=True)
    third = attached(folder, "third")
    third((3 << 20) // 2)  # another size, which the largest spare's room is needed for
    assert service_status(folder)["dram"] == {"budget": 2 << 20, "used": (3 << 20) // 2,
                                              "spare": before}
    third.close(clean=True)


def test_the_pool_refuses_past_its_budget_naming_who_holds_it(service):
    folder, _ = service
    first = attached(folder, "big")
    first(1536 << 10)
    second = attached(folder, "other")
    with pytest.raises(BudgetError, match=r"DRAM pool cannot hold 1.00 MiB more for job other "
                                          r"rank 0: 1.50 MiB of 2.00 MiB are held"):
        second(1 << 20)
    assert service_status(folder)["dram"]["used"] == 1536 << 10
    first.close(clean=True)
    second.close(clean=True)


def test_a_failed_job_is_kept_for_the_keep_time_then_freed(service):
    folder, _ = service
    source = attached(folder, "crashes")
    source(8192)
    source.client.close()  # what a killed trainer's socket does
    wait_until(lambda: (job_status(folder, "crashes") or {}).get("state") == "failed")
    kept = job_status(folder, "crashes")
    assert kept["ranks"][0]["dram_bytes"] == 8192 and not kept["ranks"][0]["attached"]
    wait_until(lambda: job_status(folder, "crashes") is None, seconds=15)
    assert service_status(folder)["dram"]["used"] == 0


def test_a_job_that_failed_holding_nothing_is_forgotten_at_once(service):
    """A client that attaches and drops before reserving (a rank refused for its budget, a
    crash in setup) leaves nothing to keep: no failed job stays in the status."""
    folder, _ = service
    source = attached(folder, "held-nothing")
    assert job_status(folder, "held-nothing")["state"] == "running"
    source.client.close()
    wait_until(lambda: job_status(folder, "held-nothing") is None, seconds=5)


def test_a_rank_attached_twice_or_at_another_world_size_is_refused(service):
    folder, _ = service
    source = attached(folder, "twice", rank=0, world=2)
    with pytest.raises(ServiceError, match="job twice rank 0 is attached already"):
        attached(folder, "twice", rank=0, world=2)
    with pytest.raises(ServiceError, match="job twice runs at world size 2, this rank asks for 3"):
        attached(folder, "twice", rank=1, world=3)
    source.close(clean=True)


def test_a_second_service_in_the_same_folder_is_refused(service):
    folder, pid = service
    with pytest.raises(ServiceError, match=f"already runs in .*pid {pid}"):
        start_service(folder)


@pytest.mark.parametrize("problem", ["another user's", "open to others", "a file"])
def test_a_folder_that_is_not_this_users_own_is_refused(tmp_path, problem):
    where = tmp_path / "service"
    if problem == "a file":
        where.write_text("")
        match = "is not a folder"
    else:
        where.mkdir(mode=0o700)
        if problem == "open to others":
            os.chmod(where, 0o755)
            match = "has mode 0755; it must be 0700"
        else:
            if os.getuid() != 0:
                pytest.skip("only root can give a folder to another user")
            os.chown(where, 65534, 65534)
            match = "belongs to uid 65534, not to this user"
    with pytest.raises(ServiceError, match=match):
        start_service(str(where))


# --- bad clients ---------------------------------------------------------------------------

def raw(folder: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(service_paths(folder).socket)
    return sock


def header(length: int, magic: bytes = wire.MAGIC, version: int = wire.VERSION) -> bytes:
    return wire.HEADER.pack(magic, version, length)


def body(message) -> bytes:
    data = json.dumps(message).encode()
    return header(len(data)) + data


def dropped(sock: socket.socket) -> bool:
    """The service closed the connection (a reset, when it left bytes unread)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


BAD_MESSAGES = {
    "garbage": (b"GET / HTTP/1.1\r\n\r\n", "not a tiered service message"),
    "another version": (header(2, version=wire.VERSION + 1) + b"{}",
                        f"protocol version {wire.VERSION + 1}"),
    "oversized": (header(wire.MAX_BODY + 1), "at most 1048576 allowed"),
    "not JSON": (header(5) + b"\xff\xfe{}}", "not UTF-8 JSON"),
    "a JSON list": (body([1, 2]), "not a JSON object with a string 'op'"),
    "no op": (body({"job": "x"}), "not a JSON object with a string 'op'"),
}
"""Each: what is sent, and what the error reply says (the connection is dropped after)."""


@pytest.mark.parametrize("case", sorted(BAD_MESSAGES))
def test_a_malformed_message_gets_an_error_and_is_dropped_and_other_jobs_go_on(service, case):
    folder, pid = service
    bystander = attached(folder, "bystander")
    slab = bystander(4096)
    slab.fill_(3)
    sent, said = BAD_MESSAGES[case]
    with raw(folder) as sock:
        sock.sendall(sent)
        reply, _ = wire.receive(sock)
        assert reply["ok"] is False and said in reply["error"], reply
        assert dropped(sock)
    # The service serves on, and the bystander's job is as it was.
    assert psutil.pid_exists(pid)
    assert job_status(folder, "bystander")["ranks"][0]["dram_bytes"] == 4096
    more = bystander(4096)
    assert int(slab.sum()) == 3 * 4096 and more.numel() == 4096
    bystander.close(clean=True)


@pytest.mark.parametrize("how", ["mid-header", "mid-body", "mid-attach"])
def test_a_client_that_dies_mid_message_touches_no_job(service, how):
    folder, pid = service
    bystander = attached(folder, "bystander")
    bystander(4096)
    with raw(folder) as sock:
        whole = body({"op": "attach", "job": "half", "rank": 0, "world": 1, "code": CODE})
        sock.sendall({"mid-header": whole[:5], "mid-body": whole[:-3],
                      "mid-attach": whole}[how])
    wait_until(lambda: job_status(folder, "half") is None
               or job_status(folder, "half")["state"] == "failed")
    assert psutil.pid_exists(pid)
    assert job_status(folder, "bystander")["ranks"][0]["attached"]
    bystander.close(clean=True)


CODE = this_code().to_wire()
"""What a launcher or trainer of this installation says of its code (identity.py)."""

REFUSED_REQUESTS = {
    "unknown op": ({"op": "format_disk"}, "unknown request 'format_disk'"),
    "rank as text": ({"op": "attach", "job": "j", "rank": "0", "world": 1, "code": CODE},
                     "needs 'rank' as int, got '0'"),
    "rank as bool": ({"op": "attach", "job": "j", "rank": True, "world": 1, "code": CODE},
                     "needs 'rank' as int, got True"),
    "rank past world": ({"op": "attach", "job": "j", "rank": 2, "world": 2, "code": CODE},
                        "needs 0 <= rank < world"),
    "a world past the bound": ({"op": "attach", "job": "j", "rank": 0, "world": 10**15,
                                "code": CODE}, "a job has 1 to 65536 ranks, got world 10000"),
    "a held world past the bound": ({"op": "hold", "job": "j", "world": 10**15, "code": CODE},
                                    "a job has 1 to 65536 ranks"),
    "an engine past the bound": ({"op": "attach", "job": "j", "rank": 0, "world": 1,
                                  "engine": 64, "code": CODE}, "needs 0 <= engine < 64"),
    "a path as job": ({"op": "attach", "job": "../x", "rank": 0, "world": 1, "code": CODE},
                      "a job name is 1 to 100 letters"),
    "attach without its code": ({"op": "attach", "job": "j", "rank": 0, "world": 1},
                                "a tiered that does not say its code"),
    "reserve unattached": ({"op": "reserve", "nbytes": 4096}, "needs an attached rank"),
    "release unattached": ({"op": "release", "segment": 0}, "needs an attached rank"),
}
"""Each: a well-formed request the service refuses, and what it says (the connection stays)."""


@pytest.mark.parametrize("case", sorted(REFUSED_REQUESTS))
def test_a_refused_request_gets_an_error_and_the_connection_serves_on(service, case):
    folder, _ = service
    request, said = REFUSED_REQUESTS[case]
    with raw(folder) as sock:
        wire.send(sock, request)
        reply, fds = wire.receive(sock)
        assert reply["ok"] is False and said in reply["error"], reply
        assert fds == []
        wire.send(sock, {"op": "hello"})
        assert wire.receive(sock)[0]["ok"] is True


def test_another_jobs_segment_cannot_be_released(service):
    folder, _ = service
    owner = attached(folder, "owner")
    owner(4096)
    thief = attached(folder, "thief")
    with pytest.raises(ServiceError, match="job thief rank 0 holds no segment 0"):
        thief.client.request("release", segment=0)
    assert job_status(folder, "owner")["ranks"][0]["dram_bytes"] == 4096
    owner.close(clean=True)
    thief.close(clean=True)


def bad_file_requests(mine: int, theirs: int, released: int) -> list[tuple[dict, str]]:
    """Requests on a rank's file stream whose segment is ``mine`` (another job's is
    ``theirs``; one it released, ``released``), and what the error answer to each says."""
    read = {"op": "read", "shard": 0, "segment": mine, "at": 0, "nbytes": 4096, "offset": 0}
    return [({"op": "truncate"}, "unknown NVMe request 'truncate'"),
            ({**read, "shard": 7}, "the rank has no NVMe shard 7 (it has 1)"),
            ({**read, "at": 4096}, f"bytes 4096..8192 are outside segment {mine}"),
            ({**read, "offset": 4096}, "bytes 4096..8192 are outside the shard's 4096"),
            ({**read, "segment": theirs}, f"job files rank 0 holds no segment {theirs}"),
            ({**read, "segment": released}, f"job files rank 0 holds no segment {released}"),
            ({**read, "op": "write", "version": 3}, "no open NVMe version 3"),
            ({"op": "version"}, "'shard'")]


def test_bad_file_requests_get_errors_and_the_files_and_other_jobs_go_on(service, tmp_path):
    """A rank's file stream (service/files.py) answers each bad request with an error naming
    it, moves no byte for it, and reaches no other job's memory; garbage ends the stream, and
    the rank's files are as they were for the next one."""
    folder, _ = service
    owner = attached(folder, "files")
    block = owner(4096)
    other = attached(folder, "other")
    theirs = other(4096)
    theirs.fill_(9)
    with raw(folder) as sock:
        wire.send(sock, {"op": "files", "job": "files", "rank": 0, "root": str(tmp_path),
                         "block_size": 4096, "queue_depth": 2})
        assert wire.receive(sock)[0]["ok"] is True
        wire.send(sock, {"op": "create", "id": 0, "what": "w", "nbytes": 4096,
                         "budget": 1 << 20})
        assert wire.receive(sock)[0]["shard"] == 0
        gone = owner(4096)
        released = owner.locate(gone)[0]
        wire.send(sock, {"op": "read", "id": 99, "shard": 0, "segment": released, "at": 0,
                         "nbytes": 4096, "offset": 0})  # mapped by the service, then released
        assert "error" not in wire.receive(sock)[0]
        owner.release(gone)
        requests = bad_file_requests(owner.locate(block)[0], other.locate(theirs)[0], released)
        for number, (request, said) in enumerate(requests, start=1):
            wire.send(sock, {**request, "id": number})
            answer, _ = wire.receive(sock)
            assert answer["id"] == number and said in answer["error"], answer
        sock.sendall(b"garbage, then nothing more")
        assert dropped(sock)
    assert int(theirs.sum()) == 9 * 4096
    # The next stream of the rank finds its shard, and moves its bytes both ways.
    files = ServiceNvme(owner, str(tmp_path), None, 0, IoSettings(4096, 2))
    shard = files.create("w", 4096)
    assert shard.number == 0
    block.fill_(5)
    version = shard.next_version()
    version.write(block).wait()
    version.commit()
    version.wait()
    block.zero_()
    shard.read_into(block)
    assert int(block.sum()) == 5 * 4096
    assert job_status(folder, "files")["ranks"][0]["nvme_bytes"] == 4 * 4096  # and 3 spares
    files.close()
    owner.close(clean=True)
    other.close(clean=True)
    assert os.listdir(tmp_path) == []  # the job's files went with it


def test_descriptors_sent_to_the_service_are_closed_not_kept(service):
    folder, pid = service
    before = psutil.Process(pid).num_fds()
    with raw(folder) as sock:
        reads = [os.open(os.devnull, os.O_RDONLY) for _ in range(4)]
        socket.send_fds(sock, [body({"op": "hello"})], reads)
        for fd in reads:
            os.close(fd)
        assert wire.receive(sock)[0]["ok"] is True
    wait_until(lambda: psutil.Process(pid).num_fds() <= before)


def test_a_process_of_another_user_is_refused():
    if os.getuid() != 0:
        pytest.skip("only root can run a process as another user")
    # In /tmp itself: the other user must be able to reach the socket at all (pytest's folders
    # are 0700), so that the service's own check of its credentials is what refuses it.
    folder = tempfile.mkdtemp(prefix="tiered-service-")
    start_service(folder, dram=1 << 20)
    path = service_paths(folder).socket
    probe = (
        "import json, os, socket, struct, sys\n"
        "os.setgid(65534); os.setuid(65534)\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.settimeout(10)\n"
        f"s.connect({path!r})\n"
        "head = s.recv(10); magic, version, n = struct.unpack('<4sHI', head)\n"
        "data = b''\n"
        "while len(data) < n: data += s.recv(n - len(data))\n"
        "print(json.loads(data)['error'])\n")
    os.chmod(folder, 0o711)
    os.chmod(path, 0o666)
    try:
        result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                                timeout=60)
    finally:
        os.chmod(folder, 0o700)
        stop_service(folder)
        shutil.rmtree(folder)
    assert f"uid 65534 may not use the tiered service of uid {os.getuid()}" in result.stdout, \
        result.stderr


def test_a_stop_frees_every_job_and_removes_the_socket(own_service):
    folder, pid = own_service
    running = attached(folder, "running")
    running(4096)
    failed = attached(folder, "failed")
    failed(4096)
    failed.client.close()
    stop_service(folder)
    assert not os.path.exists(service_paths(folder).socket)
    psutil.Process(pid).wait(timeout=10)
    with pytest.raises(ServiceError, match="no tiered service runs"):
        Channel.connect(folder)
    running.client.close()


def test_a_killed_service_leaves_a_folder_the_next_one_starts_in(own_service):
    folder, pid = own_service
    os.kill(pid, 9)
    wait_until(lambda: not psutil.pid_exists(pid)
               or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    assert os.path.exists(service_paths(folder).socket)  # it could not remove it
    pid = start_service(folder, dram=1 << 20)
    assert service_status(folder)["service"]["pid"] == pid


def test_wire_header_is_the_documented_layout():
    data = body({"op": "hello"})
    magic, version, length = struct.unpack("<4sHI", data[:10])
    assert (magic, version, length) == (b"TIER", 2, len(data) - 10)
