"""Starting, finding and stopping a node's service, for ``tiered daemon`` and ``tiered-launch``.

A service started here runs in a session of its own, detached from the terminal and from the
launcher's process group: a scheduler's ``kill -9`` of the launcher's group must not take the
state of the job with it (the job is a failed one then, whose state is kept; jobs.py). Its
output goes to ``service.log`` in the service folder.
"""
from __future__ import annotations

import subprocess
import sys
import time

from ..core.liveness import is_held
from .channel import Channel
from .identity import this_code
from .paths import ServiceError, service_paths

START_SECONDS = 120.0
"""How long a start may take before it is given up on (importing torch on a cold disk)."""


PROBE_SECONDS = 10.0
"""How long a service has to answer ``hello`` or ``status`` (they only read its books)."""


def running_service(folder: str | None = None) -> dict | None:
    """The ``hello`` of the service running in ``folder``, or None when none answers."""
    try:
        client = Channel.connect(folder, PROBE_SECONDS)
    except ServiceError:
        return None
    try:
        reply, _ = client.request("hello")
        return reply
    except ServiceError:
        return None
    finally:
        client.close()


def start_service(folder: str | None = None, *, dram: int | None = None,
                  keep_seconds: float | None = None, until_idle: bool = False,
                  cores: str | None = None, nvme: str | None = None) -> int:
    """Start a service in the background and wait until it serves; returns its pid. Raises
    ServiceError (with its words) when it cannot start, or when one already runs."""
    paths = service_paths(folder, create=True)
    command = [sys.executable, "-m", "tiered.service", "--background", "--folder", paths.folder]
    if dram is not None:
        command += ["--dram", str(dram)]
    if keep_seconds is not None:
        command += ["--keep-failed", str(keep_seconds)]
    if until_idle:
        command.append("--until-idle")
    if cores is not None:
        command += ["--cores", cores]
    if nvme is not None:
        command += ["--nvme", nvme]
    try:
        started = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True,
                                 text=True, timeout=START_SECONDS)
    except subprocess.TimeoutExpired:
        raise ServiceError(f"the tiered service did not start within {START_SECONDS:.0f} s "
                           f"(see {paths.log})") from None
    if started.returncode != 0:
        said = started.stderr.strip().removeprefix("tiered service: error: ")
        raise ServiceError(f"the tiered service did not start: {said or 'no reason given'}")
    return int(started.stdout.split()[-1])


def ensure_service(folder: str | None = None, **settings) -> tuple[int, bool]:
    """The service running in ``folder``, started (with ``settings``, see start_service) when
    none runs; returns (its pid, whether this call started it). Two callers racing to start
    one (launchers started together) end up using the same: the loser finds the winner's."""
    hello = running_service(folder)
    if hello is not None:
        return hello["pid"], False
    try:
        return start_service(folder, **settings), True
    except ServiceError:
        # Another caller's service holds the folder's lock: it serves a moment later.
        lock = service_paths(folder).lock
        deadline = time.monotonic() + START_SECONDS
        while (hello := running_service(folder)) is None and is_held(lock) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        if hello is None:
            raise
        return hello["pid"], False


def stop_service(folder: str | None = None, wait: float = 30.0) -> int | None:
    """Ask the service in ``folder`` to stop and wait until it has freed everything; returns
    its pid, or None when none was running."""
    paths = service_paths(folder)
    hello = running_service(paths.folder)
    if hello is None:
        return None
    client = Channel(paths)
    try:
        client.request("stop")
    finally:
        client.close()
    deadline = time.monotonic() + wait
    while is_held(paths.lock) and time.monotonic() < deadline:
        time.sleep(0.05)
    if is_held(paths.lock):
        raise ServiceError(f"the tiered service (pid {hello['pid']}) did not stop within "
                           f"{wait:.0f} s")
    return hello["pid"]


def service_status(folder: str | None = None) -> dict:
    client = Channel.connect(folder, PROBE_SECONDS)
    try:
        reply, _ = client.request("status")
    finally:
        client.close()
    for key in ("op", "id", "ok"):  # the channel's, not the status's
        reply.pop(key, None)
    return reply


class JobHold:
    """A launcher's hold on its job at the service, for as long as the job runs (see [Note: job
    lifecycle] in jobs.py): :meth:`end` says how it ended; a launcher that dies lets go of it
    as a failed job."""

    def __init__(self, folder: str | None, job: str, fresh: bool = False,
                 world: int | None = None):
        """``fresh``: a state the service kept of a failed run of ``job`` is freed, not taken
        over by this run's ranks; ``world``: its ranks, where known."""
        self.job = job
        self.client = Channel.connect(folder)
        try:
            reply, _ = self.client.request("hold", job=job, fresh=fresh, world=world,
                                           code=this_code().to_wire())
        except BaseException:
            self.client.close()
            raise
        self.note: str = reply.get("note", "")

    def end(self, clean: bool) -> None:
        try:
            self.client.request("unhold", clean=clean)
        except ServiceError:
            pass  # the service went away: it holds nothing of the job any more
        finally:
            self.client.close()
