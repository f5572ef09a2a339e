"""The per-node tier service: one process that holds the node's DRAM pool for every job's ranks.

    python -m tiered.service [--dram BYTES] [--keep-failed SECONDS] [--until-idle] [--folder DIR]

(``tiered daemon start`` runs it in the background; see control.py.) It listens on a Unix
socket in a folder only its user can enter (paths.py), and checks every peer's credentials: a
process of another user (root excepted) is told so and dropped. Each connection gets a thread,
and speaks the messages of wire.py; a connection that attaches is one rank of one job, and
whatever it reserved is that job's (jobs.py, [Note: job lifecycle]). A connection that drops
without a clean detach is a failed rank, and its job's state is kept for the keep time.

A malformed message (garbage, a wrong version, an oversized or truncated one) gets an error
reply when the peer can still read one, and its connection is dropped: a stream cannot be
resynchronised, and nothing of any job changes. A well-formed request the service refuses (an
unknown op, a field of the wrong type, a rank attached twice, a pool too small) gets an error
reply and the connection stays.

On ``stop``, SIGTERM or SIGINT (and, with ``--until-idle``, once the jobs it served are gone)
the service frees every segment, removes its socket and exits.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable

from ..core.errors import TieredError
from ..core.limits import usable_cores
from ..core.liveness import HeldElsewhere, OwnerLock
from ..core.version import __version__
from ..tiers.aio import IoQueue, IoSettings
from ..tiers.nvme import check_nvme_path, remove_dead_runs
from . import wire
from .cores import CorePool
from .files import FILE_OPS, FileStream, RankFiles
from .hosting import HostedRank, HostSeat, JobNorm
from .conversation import Answer, Conversation, Phase, Route, checked
from .hostwire import COMMANDS, HostRequest, command_from_wire
from .identity import mismatch, this_code
from .jobs import RefusedError, Registry
from .paths import ServiceError, service_paths

log = logging.getLogger("tiered.service")

TICK_SECONDS = 0.5
"""How often the service looks at the keep times and at whether it should exit."""
KEEP_SECONDS = 900.0
"""How long a failed job's state is kept by default (``--keep-failed``)."""


@dataclass(frozen=True)
class ServiceConfig:
    folder: str
    """The service folder (paths.py): its socket, lock and log."""
    dram_budget: int
    """Bytes of DRAM the service may hand out, all jobs together."""
    keep_seconds: float = KEEP_SECONDS
    """How long a failed job's state is kept after its last trainer is gone."""
    until_idle: bool = False
    """Exit once the jobs it served are gone and it holds nothing (a service tiered-launch
    started for its job)."""
    cores: tuple[int, ...] | None = None
    """The cores its CPU work runs on (``--cores``); None: those it was started with."""
    nvme: str | None = None
    """The folder its jobs' NVMe files go under (``--nvme``); None: wherever a job's policy
    says."""


class TierService:
    def __init__(self, config: ServiceConfig):
        self.config = config
        self.paths = service_paths(config.folder, create=True)
        try:
            self._lock = OwnerLock(self.paths.lock, "tiered service")
        except HeldElsewhere as e:
            raise ServiceError(f"a tiered service already runs in {self.paths.folder} "
                               f"({e.owner}); stop it first (tiered daemon stop)") from None
        if config.cores is not None:
            try:
                os.sched_setaffinity(0, config.cores)
            except OSError as e:
                raise ServiceError(f"--cores {_cores_text(config.cores)}: this process may not "
                                   f"run there ({e.strerror}); it may use "
                                   f"{_cores_text(sorted(os.sched_getaffinity(0)))}") from None
        self.cores = usable_cores()
        """The cores the hosted ranks' CPU work shares (the affinity and cgroup quota's)."""
        self.core_pool = CorePool(self.cores)
        """What the hosted ranks' updates run on, together (cores.py)."""
        self.io_queue: IoQueue | None = None
        """The I/O queue every rank's NVMe files share (files.py), made with the first."""
        self._queue_made = threading.Lock()
        if config.nvme is not None:  # what a killed service left there goes now, said in its log
            check_nvme_path(config.nvme)
            remove_dead_runs(config.nvme)
        self.registry = Registry(config.dram_budget, config.keep_seconds)
        self._norms: dict[str, JobNorm] = {}
        """Per job, the sum of its hosted ranks' gradient norms (see [Note: hosted ranks])."""
        self._norms_lock = threading.Lock()
        self._hosted: dict[tuple[str, int], tuple[int, HostedRank]] = {}
        """The (job, rank) whose hosts run here: their CPU update's threads, and the host."""
        self.started = time.time()
        self._stopping = threading.Event()
        # The lock is ours, so a socket file there is a dead service's.
        if os.path.lexists(self.paths.socket):
            os.unlink(self.paths.socket)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.paths.socket)
        os.chmod(self.paths.socket, 0o600)
        # Every rank of every job on the node connects at once as a run starts (and again for
        # its files and host): past the backlog the kernel refuses a Unix connect at once
        # (EAGAIN) instead of queueing it. The kernel caps this at net.core.somaxconn.
        self._listener.listen(4096)
        self._listener.settimeout(TICK_SECONDS)

    def stop(self) -> None:
        self._stopping.set()

    def serve(self) -> None:
        """Serve until stopped; then free everything and remove the socket."""
        log.info("tiered service: %s (pid %d) serving in %s, DRAM pool %d bytes, failed jobs "
                 "kept %.0f s", this_code().describe(), os.getpid(), self.paths.folder,
                 self.config.dram_budget, self.config.keep_seconds)
        try:
            while not self._stopping.is_set():
                try:
                    conn, _ = self._listener.accept()
                except socket.timeout:
                    pass
                else:
                    threading.Thread(target=self._serve_client, args=(conn,), daemon=True,
                                     name="tiered-service-client").start()
                for name in self.registry.expire():
                    log.info("job %s: kept %.0f s after it failed; freed", name,
                             self.config.keep_seconds)
                if (self.config.until_idle and self.registry.jobs_served
                        and self.registry.idle):
                    log.info("the jobs this service was started for are gone; exiting")
                    break
        finally:
            self._listener.close()
            try:
                os.unlink(self.paths.socket)
            except FileNotFoundError:
                pass
            for _, hosted in list(self._hosted.values()):  # no update waits for a commit now
                hosted.commits.broken()
                hosted.close()
            self.registry.close()
            if self.io_queue is not None:
                self.io_queue.close()
            self._lock.release()
            log.info("tiered service stopped")

    # -- one connection --------------------------------------------------------------------

    def _serve_client(self, conn: socket.socket) -> None:
        client = Conversation(conn)
        try:
            pid, uid, _ = wire.peer_credentials(conn)
            client.pid = pid
            if uid not in (os.getuid(), 0):
                log.warning("refused pid %d of uid %d: not this service's user", pid, uid)
                client.reply_error(None, f"uid {uid} may not use the tiered service of uid "
                                         f"{os.getuid()}")
                return
            while not self._stopping.is_set() and not client.over:
                try:
                    message, fds = wire.receive(conn)
                except wire.Closed:
                    return
                except wire.WireError as e:
                    log.warning("pid %d sent a malformed message (%s); dropped", pid, e)
                    if client.phase is Phase.CONTROL:  # a stream's end is its channel's word
                        client.reply_error(None, str(e))
                    return
                for fd in fds:  # no request of ours sends descriptors to the service
                    os.close(fd)
                self._dispatch(client, message)
        except OSError as e:  # the peer went mid-reply, or the socket failed
            log.info("pid %s: connection ended (%s)", client.pid, e)
        finally:
            if client.hosted is not None:
                self._end_host(client)
            if client.files is not None:
                self._end_files(client)
            if client.attached is not None:
                job, rank = client.attached
                self.registry.detach(job, rank, clean=False)
                log.info("job %s rank %d: its trainer went without engine.close()", job, rank)
            if client.holds is not None and client.pid is not None:
                self.registry.unhold(client.holds, client.pid, clean=False)
                log.info("job %s: its launcher went without a word; its state is kept",
                         client.holds)
            conn.close()

    def _dispatch(self, client: Conversation, message: dict) -> None:
        """Run the route of ``message``'s op (see [Note: one dispatch table]); a call is
        answered with its reply or why it was refused, a post that fails ends the
        conversation."""
        op, call = message["op"], message.get("id")
        route = ROUTES.get(op)
        if route is not None and route.phase is not client.phase:
            route = None
        try:
            if route is None:
                raise RefusedError(f"unknown {client.phase.value} {op!r}; this service "
                                   f"answers {', '.join(ops_of(client.phase))}")
            answer = route.handle(self, client, message)
        except Exception as e:  # a refusal, a field of the wrong type, a failed transfer
            if not isinstance(e, (TieredError, KeyError, TypeError, ValueError)):
                log.exception("pid %s: %r failed", client.pid, op)
            if route is None or route.call:
                client.reply_error(call, str(e), **wire.refusal_fields(e))
            else:  # a command the host never ran: nothing after it can run
                client.send({"op": "failed", "error": f"the service refused {op!r}: {e}"})
                client.over = True
            return
        if answer is not None:
            client.reply(call, *answer)

    def _op_hello(self, client, message):
        return {"pid": os.getpid(), "version": __version__, "folder": self.paths.folder,
                "code": this_code().to_wire()}, []

    def _op_status(self, client, message):
        status = self.registry.status()
        for job in status["jobs"]:
            for rank in job["ranks"]:
                threads, hosted = self._hosted.get((job["name"], rank["rank"]), (None, None))
                rank["threads"] = threads
                rank["last_step"] = hosted.host.last_step if hosted is not None else None
                rank["busy"] = round(hosted.busy, 3) if hosted is not None else None
            # The last step committed on every rank, where the service runs their updates
            # (commits.py); the step a relaunch goes on from once they are gone.
            job["last_step"] = job["committed_step"]
        return {"service": {"pid": os.getpid(), "version": __version__,
                            "code": this_code().to_wire(),
                            "folder": self.paths.folder,
                            "uptime_seconds": round(time.time() - self.started, 1),
                            "until_idle": self.config.until_idle,
                            "cores": sorted(os.sched_getaffinity(0)),
                            "nvme": self.config.nvme,
                            "usable_cores": self.cores,
                            # threads of the hosted ranks' updates running now, and at most
                            "threads_running": self.core_pool.running,
                            "threads_peak": self.core_pool.peak,
                            "io_queue_depth": (self.io_queue.depth
                                               if self.io_queue is not None else None)},
                **status}, []

    def _op_stop(self, client, message):
        log.info("stop requested by pid %s", client.pid)
        # Answered before the serve loop may see it: once it has, the process can exit before
        # this thread (a daemon) has written the answer, and the asker would read a lost service.
        client.reply(message.get("id"), {}, [])
        self.stop()
        return None

    def _op_attach(self, client, message):
        if client.attached is not None or client.holds is not None:
            raise RefusedError("this connection holds or is a rank already; one connection "
                               "per rank")
        _refuse_other_code(message)
        job = checked(message, "job", str)
        rank, world = checked(message, "rank", int), checked(message, "world", int)
        fresh = bool(message.get("fresh", False))
        engine = checked(message, "engine", int) if "engine" in message else 0
        job, note, kept = self.registry.attach(job, rank, world, client.pid, fresh, engine)
        client.attached = (job, rank)
        log.info("job %s rank %d/%d attached (pid %s)%s", job, rank, world, client.pid,
                 f", takes over step {kept['step']}" if kept else "")
        return {"job": job, "note": note, "kept": kept}, []

    def _op_map(self, client, message):
        """A kept segment of the rank, to map again (a reattached trainer: jobs.py)."""
        job, rank = client.rank_of("map")
        segment = self.registry.segment(job, rank, checked(message, "segment", int))
        return {"segment": segment.id, "nbytes": segment.nbytes, "populate": True}, [segment.fd]

    def _op_reserve(self, client, message):
        job, rank = client.rank_of("reserve")
        segment = self.registry.reserve(job, rank, checked(message, "nbytes", int))
        return ({"segment": segment.id, "nbytes": segment.nbytes, "populate": segment.touched},
                [segment.fd])

    def _op_release(self, client, message):
        job, rank = client.rank_of("release")
        self.registry.release(job, rank, checked(message, "segment", int))
        return {}, []

    def _op_detach(self, client, message):
        job, rank = client.rank_of("detach")
        clean = checked(message, "clean", bool)
        self.registry.detach(job, rank, clean)
        client.attached = None
        log.info("job %s rank %d detached (%s)", job, rank, "clean end" if clean else "failed")
        return {}, []

    def _op_hold(self, client, message):
        if client.attached is not None or client.holds is not None:
            raise RefusedError("this connection holds or is a rank already")
        _refuse_other_code(message)
        job = checked(message, "job", str)
        world = message.get("world")
        note = self.registry.hold(job, client.pid, bool(message.get("fresh", False)),
                                  None if world is None else checked(message, "world", int))
        client.holds = job
        log.info("job %s held by its launcher (pid %s)", job, client.pid)
        return {"note": note}, []

    def _op_unhold(self, client, message):
        if client.holds is None:
            raise RefusedError("'unhold' needs a held job: send 'hold' first")
        job, client.holds = client.holds, None
        clean = checked(message, "clean", bool)
        self.registry.unhold(job, client.pid, clean)
        log.info("job %s %s (its launcher says)", job,
                 "ended cleanly; freed once nothing of it is attached" if clean else "failed")
        return {}, []


    def _op_host(self, client, message):
        """Run the host of an attached rank here (see [Note: hosted ranks]); the connection
        then carries its commands and events until it closes."""
        if client.attached is not None or client.holds is not None:
            raise RefusedError("this connection holds or is a rank already; a host needs one "
                               "of its own")
        job, rank = checked(message, "job", str), checked(message, "rank", int)
        try:
            request = HostRequest.from_wire(message["request"])
        except (KeyError, TypeError, ValueError) as e:
            raise RefusedError(f"the host request of job {job} rank {rank} is malformed: "
                               f"{e}") from None
        segments, files, world, commits, round_ = self.registry.host_started(
            job, rank, client.pid, request.segment_ids, request.fingerprint(),
            nvme=request.has_nvme_shards)
        with self._norms_lock:
            norm = self._norms.setdefault(job, JobNorm(world))
        # The node's ranks share these cores: none is given more than its share, and where
        # there are more ranks than cores (one thread each) the pool bounds what runs at once
        # (cores.py), so that the ranks' updates together never run more threads than cores.
        threads = max(1, min(request.threads, self.cores // world))
        started = time.monotonic()
        try:
            hosted = HostedRank(request, HostSeat(rank, world, segments, files, norm, commits,
                                                  round_, self.core_pool, threads), client.send)
        except Exception as e:  # a plan that does not fit its segments, a failed compile
            self.registry.host_ended(job, rank, None, ran=False)
            raise RefusedError(f"cannot run the host of job {job} rank {rank}: "
                               f"{type(e).__name__}: {e}") from None
        client.hosted = (job, hosted)
        self._hosted[(job, rank)] = threads, hosted
        log.info("job %s rank %d: its host runs here, %d thread(s) (set up in %.1f s)", job,
                 rank, threads, time.monotonic() - started)
        return {}, []

    def _op_files(self, client, message):
        """The NVMe files of an attached rank (see [Note: NVMe in the service]); the connection
        then carries their transfers until it closes."""
        if client.attached is not None or client.holds is not None:
            raise RefusedError("this connection holds or is a rank already; a rank's files "
                               "need a connection of their own")
        job, rank = checked(message, "job", str), checked(message, "rank", int)
        root = checked(message, "root", str)
        block_size = checked(message, "block_size", int)
        depth = checked(message, "queue_depth", int)
        if not os.path.isabs(root) or block_size < 4096 or block_size % 4096 or not (
                1 <= depth <= 1024):
            raise RefusedError(f"NVMe files need an absolute root, a block size that is a "
                               f"multiple of 4096 and a queue depth of 1 to 1024, got {root!r}, "
                               f"{block_size}, {depth}")
        allowed = self.config.nvme
        if allowed is not None and os.path.commonpath(
                [os.path.realpath(allowed), os.path.realpath(root)]) != os.path.realpath(allowed):
            raise RefusedError(f"this service makes NVMe files only under {allowed} (tiered "
                               f"daemon start --nvme); job {job}'s nvme.path is {root}")

        def segment_of(segment_id: int) -> tuple[int, int]:
            segment = self.registry.segment(job, rank, segment_id)
            return segment.fd, segment.nbytes
        with self._queue_made:  # one queue on the drive, as deep as the first job asked
            if self.io_queue is None:
                self.io_queue = IoQueue(depth)
        files, kept = self.registry.files_opened(job, rank, client.pid, lambda: RankFiles(
            root, rank, IoSettings(block_size, depth), segment_of, self.io_queue))
        client.files = (job, rank, FileStream(files, kept, client.reply, client.reply_error))
        log.info("job %s rank %d: its NVMe files are %s%s", job, rank, files.tier.run_dir,
                 " (kept)" if kept else "")
        return {"folder": files.tier.run_dir, "kept": kept, "held": files.tier.usage.current,
                "removed": [] if kept else [list(pair) for pair in files.tier.removed]}, []

    # -- a hosted rank's conversation (see [Note: hosted ranks]) -----------------------------

    def _host_command(self, client, message):
        client.host.run(checked(message, "sequence", int), command_from_wire(message))

    def _host_drain(self, client, message):
        client.host.after_queued(partial(client.reply, message["id"], {}))

    def _host_unit_steps(self, client, message):
        hosted = client.host
        hosted.after_queued(lambda: client.reply(message["id"], {"steps": hosted.unit_steps()}))

    def _host_set_unit_steps(self, client, message):
        client.host.set_unit_steps([float(v) for v in checked(message, "steps", list)])

    def _host_restored(self, client, message):
        client.host.restored()

    def _host_params_swapped(self, client, message):
        client.host.params_swapped([int(unit) for unit in checked(message, "units", list)])

    def _host_step_record(self, client, message):
        client.host.step_record(checked(message, "step", int),
                                     dict(checked(message, "record", dict)))

    def _host_end(self, client, message):
        """The trainer closes: its host ends before it detaches. What it sent runs first, its
        last step's update too once every rank's record of it is in (a rank ending right after
        step() is no crash); it sends no record from here on (see [Note: reattach])."""
        hosted = client.host
        hosted.commits.ending(hosted.rank)
        hosted.run_queued()
        self._end_host(client)
        client.over = True
        return {}, []

    # -- a rank's NVMe files' conversation (see [Note: NVMe in the service]) ------------------

    def _files_end(self, client, message):
        """The trainer closes its NVMe tier: answered once the rank's files count as closed,
        so that a clean end that follows frees the job at once."""
        self._end_files(client)
        client.over = True
        return {}, []

    def _end_files(self, client: Conversation) -> None:
        assert client.files is not None, "a file stream ended twice"
        job, rank, stream = client.files
        client.files = None
        stream.settle()
        self.registry.files_closed(job, rank)

    def _end_host(self, client: Conversation) -> None:
        assert client.hosted is not None, "a host ended twice"
        job, hosted = client.hosted
        client.hosted = None
        self._hosted.pop((job, hosted.rank), None)
        # No step is committed from here on (commits.py); one that was runs to its end, and
        # what the host leaves is the rank's kept state.
        hosted.commits.broken()
        with self._norms_lock:  # a relaunch's hosts sum in a norm of their own
            self._norms.pop(job, None)
        hosted.close()  # what was queued runs to its end; nothing more is taken
        self.registry.host_ended(job, hosted.rank, hosted.final_state())


def _on_files(method: Callable[[FileStream, dict], Answer | None]
              ) -> Callable[[TierService, Conversation, dict], Answer | None]:
    """A route to the connection's file stream."""
    return lambda service, client, message: method(client.file_stream, message)


ROUTES: dict[str, Route] = {
    # what any client asks
    **{name[len("_op_"):]: Route(Phase.CONTROL, method) for name, method
       in vars(TierService).items() if name.startswith("_op_")},
    # a hosted rank's commands (posts, run in the order sent) and calls
    **{op: Route(Phase.HOST, TierService._host_command, call=False) for op in COMMANDS},
    "drain": Route(Phase.HOST, TierService._host_drain),
    "unit_steps": Route(Phase.HOST, TierService._host_unit_steps),
    "set_unit_steps": Route(Phase.HOST, TierService._host_set_unit_steps, call=False),
    "restored": Route(Phase.HOST, TierService._host_restored, call=False),
    "params_swapped": Route(Phase.HOST, TierService._host_params_swapped, call=False),
    "step_record": Route(Phase.HOST, TierService._host_step_record, call=False),
    "end_host": Route(Phase.HOST, TierService._host_end),
    # a rank's NVMe tier's transfers (each answered once it is carried out)
    **{op: Route(Phase.FILES, _on_files(method)) for op, method in FILE_OPS.items()},
    "end_files": Route(Phase.FILES, TierService._files_end),
}
"""Every op any connection may send, and in which phase (see [Note: one dispatch table])."""


def ops_of(phase: Phase) -> list[str]:
    return sorted(op for op, route in ROUTES.items() if route.phase is phase)


def parse_cores(text: str) -> tuple[int, ...]:
    """``"0-7,12,14-15"`` as the cores it names; ValueError naming what is wrong."""
    cores: set[int] = set()
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        if not first.isdigit() or (last and not last.isdigit()) or (
                last and int(last) < int(first)):
            raise ValueError(f"--cores {text!r}: expected a list such as 0-7,12,14-15, got "
                             f"{part.strip()!r}")
        cores.update(range(int(first), int(last or first) + 1))
    return tuple(sorted(cores))


def _cores_text(cores) -> str:
    return ",".join(str(core) for core in cores)


def _refuse_other_code(message: dict) -> None:
    """A launcher or trainer of another installation is not served (identity.py)."""
    why = mismatch(message.get("code"))
    if why is not None:
        raise RefusedError(why)


def run(config: ServiceConfig) -> int:
    """Run a service in this process until it stops; SIGTERM and SIGINT stop it cleanly."""
    return serve(TierService(config))


def serve(service: TierService) -> int:
    """Serve with ``service`` until it stops; SIGTERM and SIGINT stop it cleanly."""

    def on_signal(signum, frame):
        log.info("stopping on %s", signal.Signals(signum).name)
        service.stop()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a service outlives the terminal
    service.serve()
    return 0
