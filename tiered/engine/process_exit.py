"""What a process running engines does at its end: engines shut down before the thread pools
and the process group they use go, and torchrun's SIGTERM turned into an exit that runs them."""
from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import weakref

import torch
import torch.distributed as dist

_engines: "weakref.WeakSet" = weakref.WeakSet()
"""Live engines, shut down at exit before the process group they use goes (_leave_group)."""


def shut_down_at_exit(engine) -> None:
    """Have ``engine`` shut down (its ``_finalizer``) when the main thread ends."""
    _engines.add(engine)
    _shut_down_before_thread_pools_stop()


def init_distributed(device: torch.device) -> None:
    """Join the torchrun group when launched by it and nobody has joined yet (and leave it at
    exit, which NCCL asks for, unless the program already has)."""
    if dist.is_initialized() or "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    atexit.register(_leave_group)


def _leave_group() -> None:
    """At exit: every engine's worker first finishes its update, whose gradient norm may still
    be an all-reduce over the group's ranks, then the group goes."""
    shut_down_engines()
    if dist.is_initialized():
        dist.destroy_process_group()


def shut_down_engines() -> bool:
    """Shut every live engine down; whether one's last update failed with nothing left to
    raise it. Python runs this at exit, where nothing can change the exit status any more;
    tiered-launch's ranks run it as their script ends, and exit 1 on a failure."""
    failed = False
    for engine in list(_engines):
        failed |= bool(engine._finalizer())  # None: shut down already
    return failed


_shutdown_registered = False


def _shut_down_before_thread_pools_stop() -> None:
    """Shut live engines down when the main thread ends, before Python stops its thread pools.

    [Note: exit order]
    A script may end with an update still running on the CPU worker (the delayed update
    returns at once). When the main thread ends, Python first runs the hooks registered with
    threading's own exit list, among them concurrent.futures', which refuses new work from then
    on, and only later the atexit handlers and finalizers. The update's NVMe reads and writes go
    through such pools, so an engine finished by atexit failed its last update with "cannot
    schedule new futures after shutdown", and said so on every run. Hooks on that list run
    newest first, so one registered after the pools' own (which exist once an engine does)
    runs before it. ``threading._register_atexit`` is private, but it is what
    concurrent.futures itself uses; where it is missing, atexit remains (the old order)."""
    global _shutdown_registered
    if _shutdown_registered:
        return
    register = getattr(threading, "_register_atexit", atexit.register)
    try:
        register(shut_down_engines)
    except RuntimeError:  # the interpreter is already shutting down: atexit still runs
        atexit.register(shut_down_engines)
    _shutdown_registered = True


def exit_cleanly_on_sigterm() -> None:
    """torchrun stops the other ranks with SIGTERM when one fails; turning it into SystemExit
    runs the exit handlers that remove this rank's NVMe folder."""
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit_once)


def _exit_once(signum: int, frame) -> None:
    """A second SIGTERM (a scheduler repeating itself, or the parent-death signal sent again)
    would raise again inside the exit handlers and cut the NVMe folder's removal short, so
    after the first one SIGTERM is ignored; SIGKILL still ends the process."""
    signal.signal(signum, signal.SIG_IGN)
    sys.exit(128 + signum)
