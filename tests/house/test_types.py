"""The type checker over tiered/, as pyproject.toml's [tool.mypy] sets it: the seams (the
device's Protocols, the tiers, the plan, the CPU update) are held to their declared types, so a
caller handing an accelerator a foreign stream or a resident state where an NVMe one is meant
fails here, not on a GPU."""
from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import REPO

ROOT = REPO


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One cache for both checks: the second reads tiered's types from the first's."""
    return tmp_path_factory.mktemp("mypy_cache")


def test_mypy_finds_nothing_in_tiered(cache):
    run = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(cache),
                          "--no-error-summary", "--hide-error-context"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    errors = [line for line in run.stdout.splitlines() if ": error:" in line]
    assert run.returncode == 0 and errors == [], run.stdout + run.stderr


def test_mypy_sees_a_planted_error(tmp_path, cache):
    """The check above would pass vacuously if mypy read nothing: a wrong type in a module
    it holds is reported by file and line."""
    planted = tmp_path / "planted.py"
    planted.write_text("from tiered.core.sizes import format_size\n\nformat_size('64GiB')\n")
    run = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(cache),
                          "--config-file", str(ROOT / "pyproject.toml"), str(planted)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 1 and f"{planted}:3: error" in run.stdout, run.stdout + run.stderr
