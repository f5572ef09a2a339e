"""Progress of the long phases (core/progress.py): plain lines where standard error is not a
terminal, on rank 0 alone, none with TIERED_PROGRESS=0; initialize's and ``tiered node``'s in
real subprocesses, as a log or a launcher's pipe receives them."""
from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import time

import pytest

from tiered.core import progress
from tiered.launch.cli import main
from tiered.planning.node import NodeRates

from helpers import REPO, clean_env

INITIALIZE = """
import torch
from torch import nn
import tiered
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)])
engine, _ = tiered.initialize(model, device="cpu", compute_dtype="fp32")
engine.close()
"""

NODE = """
from tiered.planning.node import node_rates
node_rates(remeasure=True, cpu_params=1 << 12, copy_bytes=1 << 20, nvme_bytes=1 << 20)
"""


def run(code: str, tmp_path, *envs: dict[str, str]) -> list[str]:
    """Standard error of ``code`` in a fresh interpreter (a pipe, not a terminal), once under
    each of ``envs``, the interpreters side by side (each is mostly its start)."""
    started = [subprocess.Popen([sys.executable, "-c", code], cwd=REPO, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=clean_env(TIERED_CACHE=str(tmp_path), **env))
               for env in envs]
    said = []
    for process in started:
        _, stderr = process.communicate(timeout=120)
        assert process.returncode == 0, stderr
        said.append(stderr)
    return said


def test_counted_and_phase_say_plain_lines_off_a_terminal(capsys, monkeypatch):
    monkeypatch.setenv(progress.PROGRESS_ENV, "all")
    monkeypatch.delenv("RANK", raising=False)
    assert list(progress.counted(iter("abc"), "reading", "file", total=3)) == ["a", "b", "c"]
    with progress.phase("pinning"):
        pass
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "tiered: reading: 0/3 files"
    assert re.fullmatch(r"tiered: reading: 3/3 files in \d+\.\d s", lines[1])
    assert lines[2] == "tiered: pinning ..."
    assert re.fullmatch(r"tiered: pinning: done in \d+\.\d s", lines[3]) and len(lines) == 4


def test_a_phase_shorter_than_quiet_says_nothing_and_a_longer_one_says_it(capsys,
                                                                          monkeypatch):
    """A set-up of a second is not worth a screen of lines (and a refused input stays one
    line): a phase shows once it has run progress.QUIET_S."""
    monkeypatch.delenv(progress.PROGRESS_ENV, raising=False)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(progress, "QUIET_S", 0.2)
    assert list(progress.counted([1, 2], "reading", "file")) == [1, 2]
    with progress.phase("pinning"):
        pass
    assert capsys.readouterr().err == ""
    with progress.phase("compiling"):
        time.sleep(0.5)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "tiered: compiling ..." and len(lines) == 2
    assert re.fullmatch(r"tiered: compiling: done in \d+\.\d s", lines[1])


@pytest.mark.parametrize("env", [{"RANK": "1"}, {progress.PROGRESS_ENV: "0"}],
                         ids=["rank 1", "TIERED_PROGRESS=0"])
def test_silent_off_rank_0_and_when_turned_off(capsys, monkeypatch, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert list(progress.counted([1, 2], "reading", "file")) == [1, 2]
    with progress.phase("pinning"):
        pass
    assert capsys.readouterr().err == ""


def test_initialize_says_each_long_phase_on_rank_0_unless_turned_off(tmp_path):
    said, rank_1, turned_off = run(INITIALIZE, tmp_path, {progress.PROGRESS_ENV: "all"},
                                   {"RANK": "1"}, {progress.PROGRESS_ENV: "0"})
    assert "tiered: the CPU AdamW kernel (built at first use, then cached) ..." in said
    assert "tiered: allocating the tiers (pinning DRAM, creating NVMe files) ..." in said
    units = re.search(r"^tiered: building units: 0/(\d+) units$", said, re.MULTILINE)
    assert units is not None, said
    assert re.search(rf"^tiered: building units: {units[1]}/{units[1]} units in \d+\.\d s$",
                     said, re.MULTILINE), said
    assert "tiered: " not in rank_1 and "tiered: " not in turned_off


def test_tiered_node_says_what_it_measures(tmp_path):
    said, turned_off = run(NODE, tmp_path, {progress.PROGRESS_ENV: "all"},
                           {progress.PROGRESS_ENV: "0"})
    assert "tiered: measuring the CPU's AdamW ..." in said
    assert re.search(r"^tiered: measuring the CPU's AdamW: done in \d+\.\d s$", said,
                     re.MULTILINE), said
    assert "tiered: " not in turned_off


def test_tiered_plan_counts_the_changes_it_plans_for_a_model_that_does_not_fit(tmp_path, capsys,
                                                                              monkeypatch):
    monkeypatch.setenv(progress.PROGRESS_ENV, "all")
    monkeypatch.setenv("TIERED_CACHE", str(tmp_path))
    small = NodeRates(machine="a small node", measured_at=0.0, cpu_threads=2,
                      cpu_adamw_params_per_s=1e9, cpu_one_pass_params_per_s=1e9,
                      hbm_bytes=1 << 20, dram_bytes=64 << 10)
    node = tmp_path / "node.json"
    node.write_text(json.dumps(dataclasses.asdict(small)))
    policy = tmp_path / "fp32.yaml"
    policy.write_text("compute_dtype: fp32\n")
    assert main(["plan", "helpers_models:make_model", "--policy", str(policy),
                 "--node", str(node)]) == 0
    said = capsys.readouterr().err
    tried = re.search(r"^tiered: planning each change that could make it fit: 0/(\d+) changes$",
                      said, re.MULTILINE)
    assert tried is not None, said
    assert re.search(rf"^tiered: planning each change that could make it fit: {tried[1]}/"
                     rf"{tried[1]} changes in \d+\.\d s$", said, re.MULTILINE), said
