"""The node's rates (tiered/planning/node.py): measured here, cached per machine and library versions,
measured again when asked or when the cache is another machine's or unreadable."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tiered.launch import cli
from tiered.planning.node import node_rates

SMALL = dict(cpu_params=1 << 16, nvme_bytes=4 << 20)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("TIERED_CACHE", str(folder))
    return folder


def node_files(cache: Path) -> list[Path]:
    """The rates cached in ``cache`` (which also holds the kernels built for this machine,
    where the measurement built them: a process that loaded them before builds none)."""
    return sorted(cache.glob("node-*.json"))


def test_rates_are_measured_once_then_read_from_the_cache(cache, tmp_path):
    first = node_rates(str(tmp_path), **SMALL)
    assert first.cpu_adamw_params_per_s > 0 and first.cpu_one_pass_params_per_s > 0
    assert first.cpu_threads >= 1
    assert first.nvme_write_gbps > 0 and first.nvme_read_gbps > 0
    assert sorted(os.listdir(tmp_path)) == ["cache"]  # the drive's test folder is gone
    (file,) = node_files(cache)
    assert node_rates(str(tmp_path), **SMALL) == first  # the cache's, not measured again
    again = node_rates(str(tmp_path), remeasure=True, **SMALL)
    assert again.measured_at > first.measured_at
    assert node_rates(**SMALL).nvme_write_gbps is None  # no path: another key, no drive rate
    assert len(node_files(cache)) == 2


@pytest.mark.parametrize("spoil", ["another machine", "garbage"])
def test_a_cache_of_another_machine_or_unreadable_is_measured_anew(cache, spoil):
    first = node_rates(**SMALL)
    (file,) = node_files(cache)
    if spoil == "garbage":
        file.write_text("{not json")
    else:
        values = json.loads(file.read_text())
        file.write_text(json.dumps({**values, "machine": "another GPU, torch 9"}))
    assert node_rates(**SMALL).measured_at > first.measured_at


def test_the_command_prints_the_cached_rates(cache, capsys):
    rates = node_rates(**SMALL)
    assert cli.main(["node", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["measured_at"] == rates.measured_at
    assert cli.main(["node"]) == 0
    table = capsys.readouterr().out
    assert "CPU AdamW, bf16 (one pass)" in table and rates.machine in table
