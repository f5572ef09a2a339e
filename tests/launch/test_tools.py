"""``tiered``'s help and ``tiered bench-io``'s output, as a user sees them: real subprocesses of
``python -m tiered.launch.cli``."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from tiered.policy.config import POLICY_ENV
from helpers import REPO

TINY_BENCH = ["--size", "4MiB", "--sweep-size", "1MiB", "--repeats", "1"]
RST_MARKUP = re.compile(r"``|:(func|class|meth|mod|attr):`|::$", re.MULTILINE)
"""reStructuredText that docstrings use and a terminal shows raw."""


def tiered(*args: str, **run) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != POLICY_ENV}
    return subprocess.run([sys.executable, "-m", "tiered.launch.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120, **run)


@pytest.mark.parametrize("command", [[], ["check-policy"], ["bench-io"], ["version"]])
def test_help_is_plain_text(command):
    result = tiered(*command, "--help")
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert result.stdout.startswith(f"usage: tiered {' '.join(command)}".rstrip())
    assert not RST_MARKUP.search(result.stdout), result.stdout


def test_bench_io_prints_a_table_and_json_only_when_asked(tmp_path):
    table = tiered("bench-io", "--nvme", str(tmp_path), *TINY_BENCH)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.strip().splitlines()
    assert lines[0].split() == ["setting", "write", "GB/s", "read", "GB/s"]
    assert lines[-1].startswith("policy settings / best of sweep: write ")
    assert any(line.startswith("single stream, 4.00 MiB, 1 in flight  ") for line in lines)
    assert "{" not in table.stdout  # no JSON dump after the table

    dumped = tiered("bench-io", "--nvme", str(tmp_path), *TINY_BENCH, "--json")
    assert dumped.returncode == 0, dumped.stderr
    report = json.loads(dumped.stdout)  # the whole of standard output is the JSON
    assert report["size"] == 4 << 20 and report["repeats"] == 1
    assert len(report["sweep"]) == 6 * 3 + 1
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(shutil.which("jq") is None, reason="needs jq")
def test_bench_io_json_pipes_into_jq(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != POLICY_ENV}
    bench = subprocess.Popen([sys.executable, "-m", "tiered.launch.cli", "bench-io", "--nvme",
                              str(tmp_path), *TINY_BENCH, "--json"], cwd=REPO, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    jq = subprocess.run(["jq", "-r", ".single_stream.label"], stdin=bench.stdout,
                        capture_output=True, text=True, timeout=120)
    bench.stdout.close()
    assert bench.wait(timeout=120) == 0
    assert jq.returncode == 0, jq.stderr
    assert jq.stdout == "single stream, 4.00 MiB, 1 in flight\n"
