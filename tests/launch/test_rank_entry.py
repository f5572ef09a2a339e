"""A rank told that a peer went (tiered's RankWent) is stopping with the job, not failing: the
launcher stops every rank at once, yet on a busy machine a peer may stop, and the node's service
tell this rank so, before this rank's own signal arrives. CI saw it: after Ctrl-C, rank 1 printed
the traceback of "step 2 is not run: a rank of the job went". The rank now waits a while for its
own stop signal, then exits as stopped, in silence; with none, it says the error in one line.

The rank is a real process running tiered-launch's rank entry; the script raises the error
itself (tests/launch/test_launch_hardening.py stops whole launched jobs)."""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

from tiered.launch.rank_entry import PEER_STOP_WAIT_S

from helpers import REPO, clean_env

RANK_ENTRY = REPO / "tiered" / "launch" / "rank_entry.py"
RAISED = "raising"
SCRIPT = textwrap.dedent(f"""
    from tiered.core.errors import RankWent
    print({RAISED!r}, flush=True)
    raise RankWent("step 2 is not run: a rank of the job went before every rank had taken it")
""")


def _rank(tmp_path, name: str) -> subprocess.Popen:
    script = tmp_path / f"{name}.py"
    script.write_text(SCRIPT)
    return subprocess.Popen([sys.executable, "-u", str(RANK_ENTRY), "script", str(script)],
                            cwd=REPO, env=clean_env(RANK="1"), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_a_rank_told_a_peer_went_exits_as_stopped_when_its_signal_follows(tmp_path):
    stopped, alone = _rank(tmp_path, "stopped"), _rank(tmp_path, "alone")  # side by side
    try:
        assert stopped.stdout.readline().strip() == RAISED
        time.sleep(0.5)  # the error is raised: the signal comes after it, as in the race
        stopped.send_signal(signal.SIGINT)
        _, stderr = stopped.communicate(timeout=30)
        assert stopped.returncode == 128 + signal.SIGINT, stderr
        assert stderr == "", "a rank stopped with its job said more than the launcher does"

        _, stderr = alone.communicate(timeout=PEER_STOP_WAIT_S + 30)
        assert alone.returncode == 1
        assert stderr.strip() == (
            "tiered rank 1: error: step 2 is not run: a rank of the job went before every rank "
            "had taken it (TIERED_TRACEBACK=1 shows where)")
    finally:
        for rank in (stopped, alone):
            rank.kill()
            rank.wait()
