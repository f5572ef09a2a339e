"""The benchmarks the GPU box runs (bench/on_gpu_box.sh) run to the end here, at a toy size.

A session lent the box has about 30 minutes of it; a benchmark that fails on a renamed option or
a policy key it builds wrongly would spend them. These run the scripts' tiered modes on the CPU
(their GPU-only baselines need CUDA) and check that every mode reported a result, not that it
was fast: speed is measured on the box, never asserted.

At a toy size a script's run is mostly its processes' starts (importing torch and tiered,
loading the CPU update's kernel), one process at a time: the scripts the selected tests run
are started side by side, all at once (``benches``), and each test checks its own.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO

TOY = ["--layers", "2", "--dim", "128", "--seq", "16"]
OFFLOAD_MODES = ["tiered:cpu+dpu+thp+threads1+nosplit+depth1", "tiered:cpu+arrive+service"]
"""Every modifier the stages use, chained into two modes."""
TIMEOUT = 300


def command_lines(folder: Path) -> dict[str, list[str]]:
    """Each bench run the tests check: its script and arguments. A run writes into
    ``folder``/its name, a folder of its own, there and empty as it starts."""
    return {
        # Two modes at two batch sizes, as `offload` runs its modes, with their timelines.
        "offload": ["bench_offload.py", *TOY, "--batches", "1,2", "--steps", "3", "--warmup",
                    "1", "--trace", str(folder / "offload"), "--out", str(folder / "offload.json"),
                    "--modes", ",".join(OFFLOAD_MODES)],
        # The clip stage's --set, the lora stage's --lora and the nvme stage's second mode,
        # whose files and update are the service's (its first mode is the in-process engine
        # every other test runs), in one run.
        "nvme": ["bench_offload.py", *TOY, "--lora", "2", "--batch", "2", "--steps", "2",
                 "--warmup", "1", "--out", str(folder / "nvme.json"),
                 "--modes", "tiered:nvme+service", "--nvme", str(folder / "nvme"),
                 "--set", '{"optimizer": {"max_grad_norm": 1.0}}'],
        "load": ["bench_load.py", "--layers", "1", "--dim", "128", "--nvme", str(folder / "load"),
                 "--modes", "read,torch,tiered:cpu,tiered:nvme"],
        "cpu_update": ["bench_cpu_update.py", "--units", "2", "--unit-params", "1e5",
                       "--repeats", "1"],
        "reattach": ["bench_reattach.py", "--layers", "1", "--dim", "128", "--seq", "16",
                     "--dir", str(folder / "reattach" / "checkpoints")],
        "activations": ["bench_activations.py", "--layers", "2", "--dim", "64", "--seq", "64",
                        "--batch", "2", "--steps", "2", "--checkpointing",
                        "--dram-bytes", "64MiB", "--tile", "32", "--nvme",
                        str(folder / "activations"), "--nvme-dram-bytes", "64KiB",
                        "--nvme-bytes", "16MiB"],
        # The three frozen formats, the frozen units on NVMe.
        "quantized": ["bench_quantized.py", *TOY, "--batch", "2", "--steps", "3", "--rank", "2",
                      "--policy", os.path.join(REPO, "configs", "nvme.yaml"),
                      "--nvme", str(folder / "quantized")],
        # The LoRA modes over a base trained first, as RESULTS.md's convergence runs them.
        "convergence": ["bench_convergence.py", "--layers", "1", "--dim", "128", "--seq", "16",
                        "--batch", "2", "--steps", "2", "--every", "2", "--pretrain", "2",
                        "--held-out-batches", "1", "--out", str(folder / "convergence"),
                        "--modes", "lora:torch,lora:compute,lora:int8,lora:nf4"],
    }


def _start(script: str, *args: str, log: Path) -> subprocess.Popen:
    """``python bench/SCRIPT ARGS``, its output into files (``log``.out, .err): runs side by
    side must not wait for their pipes to be read."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    with open(log.with_suffix(".out"), "w") as out, open(log.with_suffix(".err"), "w") as err:
        return subprocess.Popen([sys.executable, os.path.join(REPO, "bench", script), *args],
                                cwd=REPO, env=env, stdout=out, stderr=err)


def _finish(process: subprocess.Popen, log: Path) -> str:
    """Wait for ``process`` (started with ``log``), which must succeed; returns its stdout."""
    try:
        process.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise
    stdout = log.with_suffix(".out").read_text()
    assert process.returncode == 0, stdout[-3000:] + log.with_suffix(".err").read_text()[-3000:]
    return stdout


def runs(*names: str):
    """The bench runs (command_lines) that the decorated test checks."""
    def mark(test):
        test.bench_runs = names
        return test
    return mark


class Benches:
    """Bench runs started side by side in ``folder`` (command_lines), their logs in logs/."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.started: dict[str, subprocess.Popen] = {}

    def start(self, names: list[str]) -> None:
        (self.folder / "logs").mkdir()
        lines = command_lines(self.folder)
        for name in names:
            (self.folder / name).mkdir()
            self.started[name] = _start(*lines[name], log=self.folder / "logs" / name)

    def finish(self, name: str) -> str:
        """The stdout of the run ``name``, once it has ended; it must have succeeded."""
        return _finish(self.started[name], self.folder / "logs" / name)

    def stop(self) -> None:
        for process in self.started.values():
            if process.poll() is None:
                process.kill()
                process.wait()


@pytest.fixture(scope="module")
def benches(request, tmp_path_factory):
    """The bench runs that this session's selected tests here check, all started at once."""
    names = sorted({name for item in request.session.items
                    if getattr(item, "module", None) is request.module
                    for name in getattr(getattr(item, "function", None), "bench_runs", ())})
    started = Benches(tmp_path_factory.mktemp("benches"))
    try:
        started.start(names)
        yield started
    finally:
        started.stop()


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
@runs("offload")
def test_offload_bench_runs_the_modes_of_the_offload_variants_and_hbm_stages(benches):
    benches.finish("offload")
    _assert_trained(_results(benches.folder / "offload.json"), OFFLOAD_MODES, [1, 2])
    folder = benches.folder / "offload"
    traces = sorted(p.name for p in folder.glob("trace_*.json"))
    assert traces == ["trace_cpu-arrive-service_b1-2.json",
                      "trace_cpu-dpu-thp-threads1-nosplit-depth1_b1-2.json"]
    # The stage summarizes each timeline (the two side by side here).
    logs = benches.folder / "logs"
    summaries = [(_start("trace_summary.py", str(folder / trace), log=logs / f"summary{index}"),
                  logs / f"summary{index}") for index, trace in enumerate(traces)]
    for process, log in summaries:
        summary = _finish(process, log)
        assert "adamw" in summary, summary


@pytest.mark.slow
@runs("nvme")
def test_offload_bench_runs_the_clip_lora_and_nvme_stages(benches):
    benches.finish("nvme")
    (result,) = _results(benches.folder / "nvme.json")
    _assert_trained([result], ["tiered:nvme+service"], [2])
    assert result["lora"] == 2
    assert result["memory_report"]["nvme"]["peak"] > 0
    assert result["nvme_GB_per_step"]["read"] > 0 and result["nvme_GB_per_step"]["write"] > 0


@pytest.mark.slow
@runs("load", "cpu_update")
def test_load_and_cpu_update_benches_print_their_tables(benches):
    table = benches.finish("load")
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in rows[2:]] == [
        "| read", "| torch", "| tiered:cpu", "| tiered:nvme"], table

    table = benches.finish("cpu_update")
    assert "default pages" in table and "huge pages" in table, table


@runs("reattach")
def test_reattach_bench_prints_its_table(benches):
    table = benches.finish("reattach")
    assert "both at step 2, same master weights" in table, table
    rows = [line.split()[0] for line in table.splitlines()[-3:]]
    assert rows == ["checkpoint", "checkpoint+service", "reattach"], table


@runs("activations")
def test_activations_bench_compares_the_tiers_and_finds_the_same_weights(benches):
    table = benches.finish("activations")
    assert "weights bit for bit equal: False" not in table, table
    assert table.count("weights bit for bit equal: True") == 2, table
    rows = [line.split()[0] for line in table.splitlines()[2:6]]
    assert rows == ["hbm", "dram", "nvme", "hbm+tiled"], table
    assert "hbm+tiled / hbm step:" in table, table


@runs("quantized")
def test_quantized_bench_trains_each_frozen_format(benches):
    table = benches.finish("quantized")
    rows = [line.split() for line in table.splitlines()[-3:]]
    assert [(row[0], row[3]) for row in rows] == [("compute", "0"), ("int8", "3"),
                                                  ("nf4", "3")], table
    frozen = [float(row[4]) for row in rows]  # MiB: nf4's records the smallest
    assert frozen[0] > frozen[1] > frozen[2] > 0, table
    assert all(float(row[6]) > 0 for row in rows), table  # the frozen units on the drive


@runs("convergence")
def test_convergence_bench_runs_lora_over_each_frozen_format(benches):
    benches.finish("convergence")
    results = {r["mode"]: r["curve"] for r in _results(benches.folder / "convergence"
                                                        / "convergence.json")}
    assert list(results) == ["lora:torch", "lora:compute", "lora:int8", "lora:nf4"]
    assert results["lora:compute"] == results["lora:torch"]  # tiered in fp32 is torch's
    assert results["lora:nf4"] != results["lora:torch"]  # over another base
