"""The benchmarks the GPU box runs (bench/on_gpu_box.sh) run to the end here, at a toy size.

A session lent the box has about 30 minutes of it; a benchmark that fails on a renamed option or
a policy key it builds wrongly would spend them. These run the scripts' tiered modes on the CPU
(their GPU-only baselines need CUDA) and check that every mode reported a result, not that it
was fast: speed is measured on the box, never asserted.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOY = ["--layers", "2", "--dim", "128", "--seq", "16"]


def _bench(script: str, *args: str) -> str:
    env = dict(os.environ, PYTHONPATH=REPO)
    done = subprocess.run([sys.executable, os.path.join(REPO, "bench", script), *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _results(path) -> list[dict]:
    with open(path) as f:
        return json.load(f)


def _assert_trained(results: list[dict], modes: list[str], batches: list[int]) -> None:
    assert [(r["mode"], r["batch"]) for r in results] == [
        (mode, batch) for mode in modes for batch in batches]
    for result in results:
        assert "error" not in result, result
        assert len(result["times"]) == len(result["losses"]) > 0
        assert all(loss == loss and loss > 0 for loss in result["losses"]), result


@pytest.mark.slow
def test_offload_bench_runs_the_modes_of_the_offload_variants_and_hbm_stages(tmp_path):
    # Every modifier the stages use, chained into two modes, at two batch sizes as `offload`.
    modes = ["tiered:cpu+dpu+thp+threads1+nosplit+depth1", "tiered:cpu+arrive+service"]
    out = tmp_path / "offload.json"
    _bench("bench_offload.py", *TOY, "--batches", "1,2", "--steps", "3", "--warmup", "1",
           "--trace", str(tmp_path), "--out", str(out), "--modes", ",".join(modes))
    _assert_trained(_results(out), modes, [1, 2])
    traces = sorted(p.name for p in tmp_path.glob("trace_*.json"))
    assert traces == ["trace_cpu-arrive-service_b1-2.json",
                      "trace_cpu-dpu-thp-threads1-nosplit-depth1_b1-2.json"]
    for trace in traces:  # the stage summarizes each timeline
        summary = _bench("trace_summary.py", str(tmp_path / trace))
        assert "adamw" in summary, summary


@pytest.mark.slow
def test_offload_bench_runs_the_clip_lora_and_nvme_stages(tmp_path):
    # The clip stage's --set, the lora stage's --lora and the nvme stage's second mode, whose
    # files and update are the service's (its first mode is the in-process engine every other
    # test runs), in one run.
    out = tmp_path / "nvme.json"
    folder = tmp_path / "ssd"
    folder.mkdir()
    _bench("bench_offload.py", *TOY, "--lora", "2", "--batch", "2", "--steps", "2",
           "--warmup", "1", "--out", str(out), "--modes", "tiered:nvme+service",
           "--nvme", str(folder), "--set", '{"optimizer": {"max_grad_norm": 1.0}}')
    (result,) = _results(out)
    _assert_trained([result], ["tiered:nvme+service"], [2])
    assert result["lora"] == 2
    assert result["memory_report"]["nvme"]["peak"] > 0
    assert result["nvme_GB_per_step"]["read"] > 0 and result["nvme_GB_per_step"]["write"] > 0


@pytest.mark.slow
def test_load_and_cpu_update_benches_print_their_tables(tmp_path):
    table = _bench("bench_load.py", "--layers", "1", "--dim", "128", "--nvme", str(tmp_path),
                   "--modes", "read,torch,tiered:cpu,tiered:nvme")
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in rows[2:]] == [
        "| read", "| torch", "| tiered:cpu", "| tiered:nvme"], table

    table = _bench("bench_cpu_update.py", "--units", "2", "--unit-params", "1e5",
                   "--repeats", "1")
    assert "default pages" in table and "huge pages" in table, table


def test_reattach_bench_prints_its_table(tmp_path):
    table = _bench("bench_reattach.py", "--layers", "1", "--dim", "128", "--seq", "16",
                   "--dir", str(tmp_path / "checkpoints"))
    assert "both at step 2, same master weights" in table, table
    rows = [line.split()[0] for line in table.splitlines()[-3:]]
    assert rows == ["checkpoint", "checkpoint+service", "reattach"], table
