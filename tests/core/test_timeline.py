"""The Chrome-trace timeline: every kind of work appears, on its own track, and loads as JSON."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

import tiered

from distributed import run_ranks
from gpt import GPT, next_token_loss

from helpers import REPO

BENCH = os.path.join(REPO, "bench")
sys.path.insert(0, BENCH)
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
    rows = table_rows(summary)
    assert ("tiered-cpu-worker", "adamw") in rows
    # Busy time is the union of a track's spans: no track is busy longer than the iteration,
    # and the root's spans, which enclose its layers', are all the compute stream's forward.
    assert all(percent <= 100 for _, percent in rows.values()), summary
    roots = sorted((e for e in events if e["name"] == "forward <root>"), key=lambda e: e["ts"])
    begin = roots[2]["ts"]  # where the summary's iterations start: the third root forward
    roots = roots[2:]
    assert all(any(root["ts"] <= e["ts"] and e["ts"] + e["dur"] <= root["ts"] + root["dur"]
                   for root in roots)
               for e in events if e["name"].startswith("forward blocks") and e["ts"] >= begin)
    assert rows[("compute stream", "forward")][0] == pytest.approx(
        sum(root["dur"] for root in roots) / 1e3 / 4, abs=0.05)
    assert rows[("compute stream", "all")][0] >= rows[("compute stream", "backward")][0]
    # Every AdamW span says what it stepped: each step covers every unit's shard, in pieces.
    shards = sum(flat.shard_numel for flat in engine.runtime.flats)
    stepped = sum(e["args"]["params"] for e in events if e["name"].startswith("adamw "))
    assert stepped == 3 * shards
    assert summary[-1].startswith("adamw: ") and summary[-1].endswith("G params/s")


def table_rows(summary: list[str]) -> dict[tuple[str, str], tuple[float, int]]:
    """trace_summary's table: (track, work) -> (ms/iteration, % of iteration)."""
    rows = {}
    for line in summary[summary.index(next(l for l in summary if l.startswith("track "))) + 2:]:
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) != 4:  # the table has ended
            break
        rows[(cells[0], cells[1])] = (float(cells[2]), int(cells[3]))
    return rows


def nested_iteration(start: float) -> list[dict]:
    """One iteration of 1 ms (us from ``start``): on the compute stream, the root's forward and
    backward enclose two layers' each; on the CPU worker a write overlaps an AdamW step."""
    def span(name: str, track: str, begin: float, end: float, **args) -> dict:
        event = {"name": name, "cat": "x", "ph": "X", "pid": 1, "tid": track,
                 "ts": start + begin, "dur": end - begin}
        return event | ({"args": args} if args else {})

    compute, worker = "compute stream", "tiered-cpu-worker"
    return [span("forward <root>", compute, 0, 300), span("forward a", compute, 50, 150),
            span("forward b", compute, 150, 250), span("backward <root>", compute, 400, 900),
            span("backward b", compute, 450, 650), span("backward a", compute, 650, 850),
            span("adamw a", worker, 500, 700, params=1000), span("write a", worker, 600, 1000)]


def test_summary_busy_time_is_the_union_of_each_tracks_spans(tmp_path):
    """Two iterations whose numbers are worked out by hand. The compute stream's spans add up
    to 1.4 ms of each 1 ms iteration (what was reported as 140%); they cover 0.8 ms."""
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": nested_iteration(0) + nested_iteration(1000)}))
    done = subprocess.run([sys.executable, os.path.join(BENCH, "trace_summary.py"), str(path),
                           "--skip", "0"], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert done.returncode == 0, done.stderr
    summary = done.stdout.splitlines()
    assert summary[0] == "2 iterations after the first 0: 1.0 ms each"
    assert table_rows(summary) == {
        ("compute stream", "all"): (0.8, 80),           # [0, 300] and [400, 900]
        ("compute stream", "backward"): (0.5, 50),      # the root's [400, 900] holds a and b
        ("compute stream", "forward"): (0.3, 30),       # the root's [0, 300] holds a and b
        ("tiered-cpu-worker", "all"): (0.5, 50),        # [500, 700] and [600, 1000] overlap
        ("tiered-cpu-worker", "write"): (0.4, 40),
        ("tiered-cpu-worker", "adamw"): (0.2, 20)}
    assert list(table_rows(summary))[0] == ("compute stream", "all")  # busiest track first


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
