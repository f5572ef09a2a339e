"""The Chrome-trace timeline: every kind of work appears, on its own track, and loads as JSON."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

import tiered
from distributed import run_ranks
from gpt import GPT, next_token_loss

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "bench"))
from trace_summary import summarize  # noqa: E402


def test_trace_has_compute_transfers_nvme_and_cpu_work(tmp_path, monkeypatch):
    path = tmp_path / "trace.json"
    monkeypatch.setenv("TIERED_TRACE", str(path))
    torch.manual_seed(0)
    engine, optimizer = tiered.initialize(GPT(64, 32, 2, 2), "configs/nvme.yaml", device="cpu",
                                          nvme={"path": str(tmp_path)})
    for _ in range(3):
        for _ in range(2):  # the second backward's gradients are added to the first's
            idx = torch.randint(0, 64, (2, 8))
            next_token_loss(engine(idx), idx).backward()
        optimizer.step()
        optimizer.zero_grad()
    engine.close()
    events = json.loads(path.read_text())["traceEvents"]
    kinds = {(e["cat"], e["name"].split(" ")[0]) for e in events}
    for expected in [("compute", "forward"), ("compute", "backward"), ("h2d", "gather"),
                     ("d2h", "reduce+offload"), ("nvme", "nvme"), ("cpu", "add"),
                     ("cpu", "adamw"), ("cpu", "write"), ("setup", "compile"),
                     ("setup", "allocate"), ("setup", "build")]:
        assert expected in kinds, f"no {expected} span"
    # One forward and one backward span per unit per backward; spans have a start and a length.
    forwards = [e for e in events if e["name"] == "forward blocks.0"]
    assert len(forwards) == 6
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in events)
    tracks = {e["tid"] for e in events}
    assert {"compute stream", "gather stream", "offload stream", "tiered-cpu-worker"} <= tracks
    # bench/trace_summary.py reads it: setup, then busy time per track and work per iteration.
    summary = summarize(events, skip=2).splitlines()
    assert summary[0].startswith("setup: compile one-pass AdamW") and "build units" in summary[0]
    assert summary[1].startswith("4 iterations after the first 2:")
    assert any(line.split()[:2] == ["tiered-cpu-worker", "adamw"] for line in summary[3:])
    # Every AdamW span says what it stepped: each step covers every unit's shard, in pieces.
    shards = sum(flat.shard_numel for flat in engine.runtime.flats)
    stepped = sum(e["args"]["params"] for e in events if e["name"].startswith("adamw "))
    assert stepped == 3 * shards
    assert summary[-1].startswith("adamw: ") and summary[-1].endswith("G params/s")


def test_no_trace_without_a_path(tmp_path, monkeypatch):
    monkeypatch.delenv("TIERED_TRACE", raising=False)
    engine, optimizer = tiered.initialize(GPT(64, 32, 2, 2), "configs/cpu.yaml", device="cpu")
    assert not engine.runtime.timeline.enabled
    engine.close()


@pytest.mark.parametrize("through_env", [True, False])
def test_a_trace_folder_that_is_missing_is_refused_at_start(tmp_path, monkeypatch, through_env):
    path = str(tmp_path / "missing" / "trace.json")
    if through_env:
        monkeypatch.setenv("TIERED_TRACE", path)
    else:
        monkeypatch.delenv("TIERED_TRACE", raising=False)
    overrides = {} if through_env else {"trace": {"path": path}}
    name = "TIERED_TRACE" if through_env else "trace.path"
    with pytest.raises(tiered.PolicyError, match=f"{name} .*missing.* does not exist"):
        tiered.initialize(GPT(64, 32, 2, 2), "configs/cpu.yaml", device="cpu", **overrides)


def test_a_trace_path_that_is_a_folder_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERED_TRACE", str(tmp_path))
    with pytest.raises(tiered.PolicyError, match="is a folder; name the file"):
        tiered.initialize(GPT(64, 32, 2, 2), "configs/cpu.yaml", device="cpu")


def _refuse_on_one_rank(rank: int, world: int, out: str) -> None:
    if rank == 1:
        os.environ["TIERED_TRACE"] = os.path.join(out, "missing", "trace.json")
    try:
        tiered.initialize(GPT(64, 32, 2, 2), "configs/cpu.yaml", device="cpu")
        message = "initialized"
    except tiered.PolicyError as error:
        message = str(error)
    with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
        f.write(message)


def test_a_trace_folder_missing_on_one_rank_is_refused_on_every_rank(tmp_path):
    """The other ranks must not go on into a collective the refusing rank never joins."""
    run_ranks(2, _refuse_on_one_rank, str(tmp_path))
    assert "another rank cannot write its timeline" in (tmp_path / "rank0.txt").read_text()
    assert "does not exist" in (tmp_path / "rank1.txt").read_text()
