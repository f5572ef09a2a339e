"""What the tests that run tiered's commands as subprocesses share: where things are, the
environment a run gets, the example's tiny size, and how a run is waited for."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tiered.engine.engine import LAUNCHED_ENV
from tiered.policy import POLICY_ENV

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
EXAMPLE = "examples/train_gpt.py"
SMALL = ["--dim", "32", "--layers", "2", "--heads", "2", "--vocab", "64", "--seq", "16",
         "--batch", "4"]
"""The example's model and data at a size that trains 20 steps in about a second."""


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without what a launcher or a run sets, and with no GPU: the CPU plays
    the device, so that two ranks need no two GPUs."""
    env = {k: v for k, v in os.environ.items()
           if k not in (POLICY_ENV, LAUNCHED_ENV, "OMP_NUM_THREADS", "TIERED_TRACE")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.update(extra)
    return env


def finish(process: subprocess.Popen, timeout: float = 120) -> subprocess.CompletedProcess:
    """Wait for ``process`` (killed if it outlasts ``timeout``) and return what it printed."""
    with process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
