"""A rank whose node's service dies (SIGKILLed) exits within seconds, saying in one line that the
service at its socket is gone: it never waits for an answer that cannot come, in a step, in its
engine's close or in the engine's shut-down at exit (issue 32, item 3: the channel fails every
call at once when its connection is lost).

The service and the rank are real processes: the rank runs tests/scripts/service_dies.py under
tiered-launch's rank entry, its host in the service, and the service is killed between two of
the rank's steps, or while the rank's shut-down at exit waits for it (stopped first, so that the
rank's last message is sent before the service dies unanswering)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tiered.service import service_paths, start_service
from tiered.service.client import JOB_ENV, SERVICE_ENV

from helpers import REPO, clean_env

SCRIPT = REPO / "tests" / "scripts" / "service_dies.py"
RANK_ENTRY = REPO / "tiered" / "launch" / "rank_entry.py"
TRAINED = "-- trained --"
"""What the script writes to stderr once it has trained (what the tiers said before is not the
test's)."""
EXIT_SECONDS = 30.0
"""How long the rank may take to exit once told to go on: it takes well under one; a rank that
waits for the dead service hangs for ever, and fails here instead."""


@pytest.mark.parametrize("then", ["train", "close", "exit"])
def test_a_rank_whose_service_is_killed_exits_at_once_naming_it(tmp_path, then):
    folder = str(tmp_path / "service")
    pid = start_service(folder, dram=64 << 20)
    rank = subprocess.Popen(
        [sys.executable, "-u", str(RANK_ENTRY), "script", str(SCRIPT), then], cwd=REPO,
        # A rank that dies of a signal says where (a flake here once said nothing at all).
        env=clean_env(**{SERVICE_ENV: folder, JOB_ENV: f"dies-{then}"}, PYTHONFAULTHANDLER="1"),
        text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        said = rank.stdout.readline()
        assert said.strip() == "trained with its host in RemoteHost", (said, rank.stderr.read())
        if then == "exit":
            os.kill(pid, signal.SIGSTOP)
            rank.stdin.write("go on\n")
            rank.stdin.flush()
            time.sleep(1.0)  # the rank ends its script and asks the stopped service to end
        os.kill(pid, signal.SIGKILL)
        began = time.monotonic()
        stdout, stderr = rank.communicate(None if then == "exit" else "go on\n",
                                          timeout=EXIT_SECONDS)
        took = time.monotonic() - began
    finally:
        if rank.poll() is None:
            rank.kill()
            rank.wait()
    lines = stderr.partition(TRAINED)[2].strip().splitlines()  # what it said once it went on
    said = f"exit status {rank.returncode}, stderr:\n{stderr}"
    assert len(lines) == 1, said
    assert f"{service_paths(folder).socket} (pid {pid})" in lines[0], said
    assert rank.returncode == 1, said
    print(f"the rank exited {rank.returncode} {took:.2f} s after its service was killed "
          f"({then}): {lines[0]}")
