"""Convergence on real text through bench/bench_convergence.py (its own command line): what the
tests that hold a setting's final held-out loss to a reference's share."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import REPO


def final_losses(tmp_path, runs: list[list[str]], settings: list[str]) -> dict[str, float]:
    """Each list of modes run by one process with the bench's ``settings`` (its arguments
    but ``--modes`` and ``--out``), the processes side by side: every mode starts from the same
    weights and reads the same batches, whatever ran before it. The final held-out loss of
    each mode."""
    outs = [str(tmp_path / str(index)) for index in range(len(runs))]
    started = [subprocess.Popen(
        [sys.executable, os.path.join(REPO, "bench", "bench_convergence.py"), *settings,
         "--modes", ",".join(modes), "--out", out],
        cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True) for out, modes in zip(outs, runs)]
    final = {}
    try:
        for process, out in zip(started, outs):
            stdout, stderr = process.communicate(timeout=600)
            assert process.returncode == 0, stdout[-3000:] + stderr[-3000:]
            with open(os.path.join(out, "convergence.json")) as file:
                final.update({result["mode"]: result["curve"][-1][1]
                              for result in json.load(file)})
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
                process.wait()
    return final
