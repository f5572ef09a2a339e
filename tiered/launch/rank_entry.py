"""What each rank of ``tiered-launch`` runs first: it ties the rank's life to the launcher's,
then runs the training script as ``python`` itself would have.

    python -u .../tiered/rank_entry.py script PATH [ARGS...]     torchrun's default
    python -u .../tiered/rank_entry.py module NAME [ARGS...]     torchrun's --module
    python -u .../tiered/rank_entry.py program PATH [ARGS...]    torchrun's --no-python

torchrun starts each rank in a session of its own, with no parent-death signal: a launcher
killed with SIGKILL (a closed ssh session, a scheduler killing the job's process group) left its
ranks training on, writing checkpoints beside the next job's. Here the kernel is asked to send
the rank SIGTERM when the launcher dies.

A stop signal (SIGTERM, SIGINT, SIGHUP: torchrun stops the ranks with the signal the launcher
got) is raised in the script once: SIGINT as KeyboardInterrupt, as Python does (a script may
catch it to save), the others as SystemExit(128 + signal), as tiered's own SIGTERM handler does.
The exit handlers then remove the rank's NVMe folder. A repeat is only noted, or it would cut
that clean-up short: the kernel sends the parent-death signal each time it hands the rank on to
another thread of the dying launcher (twice, 34 ms apart, under strace here), and schedulers
repeat SIGTERM. What follows a stop in a rank is expected, not a failure (the
KeyboardInterrupt, the error of a collective whose peer has just gone, the service's word that
a peer went, told before this rank's own signal came): the rank exits 128 + the signal without
a traceback, and the launcher says why in one line.

This file is run by path, and imports only the standard library: importing the ``tiered``
package would import torch before the script could set what torch reads at import.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import runpy
import signal
import sys
import time

LAUNCHER_PID_ENV = "TIERED_LAUNCHER_PID"
"""The launcher's pid, which tiered-launch puts in the ranks' environment."""
PR_SET_PDEATHSIG = 1
"""From <linux/prctl.h>."""
MODES = ("script", "module", "program")
TRACEBACK_ENV = "TIERED_TRACEBACK"
"""Set to 1: a rank refused for its budget, or whose service died, shows its traceback, not one
line."""

_stopped_by: int | None = None
"""The first stop signal the rank got while its script ran (see _on_stop_signal)."""
_script_running = False


def die_with_launcher() -> None:
    """Have the kernel send this process SIGTERM when its parent, the launcher, dies; exit at
    once if it died already (before the request, the kernel would never send it)."""
    if sys.platform.startswith("linux"):
        # The signal is sent when the thread that started this process ends: torchrun starts
        # the ranks from the launcher's main thread, which lives as long as the launcher.
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            print(f"tiered rank: warning: this rank will not stop if the launcher is killed "
                  f"(prctl: {os.strerror(ctypes.get_errno())})", file=sys.stderr)
    # Elsewhere there is no parent-death signal (macOS, Windows): a rank outlives a launcher
    # killed with SIGKILL, as under torchrun. The check below still catches one already dead.
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if launcher is not None and os.getppid() != int(launcher):
        print(f"tiered rank: the launcher (pid {launcher}) is gone; not starting",
              file=sys.stderr)
        sys.exit(128 + signal.SIGTERM)


def _on_stop_signal(signum: int, frame) -> None:
    """Raise the first stop signal in the script (see the module's doc); after the script
    (in the exit handlers' clean-up), or for a repeat, only note it."""
    global _stopped_by
    first = _stopped_by is None
    _stopped_by = signum
    if first and _script_running:
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        sys.exit(128 + signum)


def _stop_once_on_signals() -> None:
    """Handle the stop signals that have Python's default disposition. One ignored stays
    ignored (SIGHUP under nohup); tiered's SIGTERM handler then sees this one installed and
    leaves it. SIGHUP's default would kill the rank without removing its NVMe folder."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_stop_signal)
    for name in ("SIGTERM", "SIGHUP"):
        signum = getattr(signal, name, None)  # no SIGHUP on Windows
        if signum is not None and signal.getsignal(signum) is signal.SIG_DFL:
            signal.signal(signum, _on_stop_signal)


def _first_on_path(folder: str) -> None:
    """``python`` puts the script's folder (with ``-m``, the working folder) first on sys.path;
    for this file it put tiered/'s, whose modules (policy, errors, ...) must not shadow the
    script's. Under ``-P`` (safe_path) it put none, and none is put."""
    if not getattr(sys.flags, "safe_path", False):
        sys.path[0] = folder


def run_target(mode: str, target: str, args: list[str]) -> None:
    """Run ``target`` as ``python [-m] target args`` would, in this process, as ``__main__``."""
    sys.argv = [target, *args]
    if mode == "module":
        _first_on_path(os.getcwd())
        runpy.run_module(target, run_name="__main__", alter_sys=True)  # argv[0]: its file
    else:
        _first_on_path(os.path.dirname(os.path.realpath(target)))
        runpy.run_path(target, run_name="__main__")


def main(argv: list[str]) -> None:
    global _script_running
    if len(argv) < 2 or argv[0] not in MODES:
        sys.exit(f"usage: rank_entry.py {{{','.join(MODES)}}} TARGET [ARGS...]")
    mode, target, args = argv[0], argv[1], argv[2:]
    die_with_launcher()
    if mode == "program":
        os.execvp(target, [target, *args])  # the parent-death signal is kept across exec
    _script_running = True
    _stop_once_on_signals()
    try:
        try:
            with _ordering_checked():
                run_target(mode, target, args)
        finally:
            _script_running = False
    except SystemExit as done:
        if done.code in (None, 0) and _last_update_failed():
            sys.exit(1)
        raise
    except BaseException as error:
        if _stopped_by is None and _caused_by_a_peer(error):
            _await_stop(PEER_STOP_WAIT_S)
        if _stopped_by is not None:
            sys.exit(128 + _stopped_by)
        if not _said_in_one_line(error) or os.environ.get(TRACEBACK_ENV) == "1":
            raise
        # What does not fit is the user's to change (a budget, the service's pool), and a
        # service that died is no bug of the script's: the message says what and how, and the
        # stack would only bury it.
        print(f"tiered rank {os.environ.get('RANK', '?')}: error: {error} ({TRACEBACK_ENV}=1 "
              f"shows where)", file=sys.stderr)
        sys.exit(1)
    if _last_update_failed():
        sys.exit(1)


def _last_update_failed() -> bool:
    """Shut the script's engines down now, while the exit status can still say how their last
    update ended (at exit, Python would, and end 0 whatever it said: engine/process_exit.py).
    A script that never imported tiered has none."""
    process_exit = sys.modules.get("tiered.engine.process_exit")
    return process_exit is not None and process_exit.shut_down_engines()


def _ordering_checked():
    """Under ``TIERED_DEVICE=sim``, the script's operators tracked on the simulated device (a
    race a GPU would run ends the rank with both sites named: tiered/device/sim.py); else
    nothing. Only then is torch imported before the script, which may set what torch reads
    at import."""
    if os.environ.get("TIERED_DEVICE") != "sim":  # tiered.device.DEVICE_ENV, torch-free
        return contextlib.nullcontext()
    from tiered.device import simulated_device
    return simulated_device().tracking()


PEER_ERRORS = {("tiered.core.errors", "RankWent")}
"""tiered's errors that say another rank of the job went (its cause is that rank's)."""
ONE_LINE_ERRORS = {("tiered.core.errors", "BudgetError"),
                   ("tiered.service.channel", "ServiceLost"), *PEER_ERRORS}
"""tiered's errors a rank reports in one line: a refusal for its budget, the loss of the
node's service (which names the service's socket and pid), and another rank's going."""
PEER_STOP_WAIT_S = 5.0
"""How long a rank told that a peer went waits for a stop signal of its own. The launcher
stops every rank at once, yet a peer may stop, and the service tell this rank so, before this
rank's signal arrives (it did on a busy 2-core machine): that error is the stop's echo, not a
failure. When a peer failed instead, the launcher stops this rank within its poll interval."""


def _is_one_of(error: BaseException, names: set[tuple[str, str]]) -> bool:
    """Whether ``error`` is of a class in ``names`` (module, name), known by name: importing
    tiered here would import torch before the script could set what torch reads at import."""
    return any((kind.__module__, kind.__name__) in names for kind in type(error).__mro__)


def _said_in_one_line(error: BaseException) -> bool:
    return _is_one_of(error, ONE_LINE_ERRORS)


def _caused_by_a_peer(error: BaseException) -> bool:
    return _is_one_of(error, PEER_ERRORS)


def _await_stop(seconds: float) -> None:
    """Sleep until a stop signal arrived (its handler notes it: the script has ended) or
    ``seconds`` passed."""
    deadline = time.monotonic() + seconds
    while _stopped_by is None and time.monotonic() < deadline:
        time.sleep(0.05)


if __name__ == "__main__":
    main(sys.argv[1:])
