"""TieredTrainer at two ranks under ``tiered-launch`` with the NVMe policy (its states in O_DIRECT
files, the node's service running the update): the same weights and logs as plain Trainer in
one process on the same global batch, and an export every rank took part in.

Each test's subprocess is mostly its processes' starts (importing torch, transformers and tiered),
one core's work at a time: those of the selected tests run side by side (``started``)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from helpers import CONFIGS, REPO, clean_env, finish, left_behind
from helpers_hf import arguments, assert_close_states, dataset, llama, train_plain

pytest.importorskip("transformers")

TWO_RANKS = dict(rtol=1e-4, atol=1e-5)
"""Two ranks sum each gradient in another order than one process (and rows are split across
them), so the last bits of every step differ: measured 3e-7 at most over six steps."""


def launched(tmp_path: Path) -> subprocess.Popen:
    nvme, out = tmp_path / "nvme", tmp_path / "out"
    nvme.mkdir()
    out.mkdir()
    return subprocess.Popen(
        [sys.executable, "-m", "tiered.launch.launcher", "--nvme", str(nvme), "--policy",
         str(CONFIGS / "nvme.yaml"), "--nproc-per-node", "2",
         str(REPO / "tests" / "scripts" / "hf_train.py"), str(out)],
        cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


BUDGET = 80 << 20


def budgeted(tmp_path: Path) -> subprocess.Popen:
    llama(vocab_size=512, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
          num_attention_heads=8, num_key_value_heads=8).save_pretrained(tmp_path / "base")
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    return subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "scripts" / "hf_budget.py"),
         str(tmp_path / "base"), str(nvme), str(BUDGET), str(tmp_path / "out.json")],
        cwd=REPO, env=clean_env(MALLOC_MMAP_THRESHOLD_="65536"), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)


RUNS = {"test_two_ranks_on_nvme_under_the_launcher_train_as_plain_trainer": launched,
        "test_a_folder_larger_than_the_dram_budget_fine_tunes_within_it": budgeted}
"""Each test's subprocess, started in a folder of the test's own (in this thread: llama()
seeds torch's global generator)."""


@pytest.fixture(scope="module")
def started(request, tmp_path_factory) -> dict[str, tuple[Path, Future]]:
    """The subprocesses of the selected tests here, all started at once, each waited for in a
    thread (as subprocess.run waited, with the tests' timeout of 180 s); by test name, the
    test's folder and the subprocess's future (CompletedProcess)."""
    wanted = [item.name for item in request.session.items
              if getattr(item, "module", None) is request.module and item.name in RUNS]
    pool = ThreadPoolExecutor(max_workers=len(RUNS))
    runs = {}
    try:
        for name in wanted:
            folder = tmp_path_factory.mktemp(name[:30])
            runs[name] = folder, pool.submit(finish, RUNS[name](folder), 180)
        yield runs
    finally:
        pool.shutdown(wait=True)  # each ends within its timeout


@pytest.fixture
def ran(request, started) -> tuple[Path, subprocess.CompletedProcess]:
    folder, run = started[request.node.name]
    return folder, run.result()


def test_two_ranks_on_nvme_under_the_launcher_train_as_plain_trainer(ran):
    tmp_path, run = ran
    nvme, out = tmp_path / "nvme", tmp_path / "out"
    assert run.returncode == 0, run.stderr[-3000:]
    assert left_behind(nvme) == []
    seen = json.loads((out / "logs.json").read_text())
    assert seen["world"] == 2
    assert {tier for unit in seen["placement"].values() for tier in unit.values()} >= {"nvme"}
    # One process with the two ranks' rows together: per-device batch 4 instead of 2.
    expected, expected_logs = train_plain(
        llama(), arguments(tmp_path / "plain", per_device_train_batch_size=4), dataset())
    assert_close_states(torch.load(out / "state.pt"), expected, **TWO_RANKS)
    for ours, theirs in zip(seen["logs"], expected_logs, strict=True):
        assert ours["learning_rate"] == theirs["learning_rate"]
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
        assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)
    exported = __import__("transformers").LlamaForCausalLM.from_pretrained(out / "export")
    for name, value in exported.state_dict().items():
        torch.testing.assert_close(value, expected[name], **TWO_RANKS)


def test_a_folder_larger_than_the_dram_budget_fine_tunes_within_it(ran):
    """load_model of a 98.5 MiB (fp32) checkpoint under the NVMe policy with an 80 MiB DRAM
    budget: it trains, and the process's resident memory grows by at most the DRAM budget, the
    HBM tier's peak (the CPU plays the GPU, so its memory is resident too) and 64 MiB (the
    activations, the data, the allocator). Measured: 76 + 25 + 38 MiB. glibc's mmap threshold
    is fixed in the run, so that freed blocks leave the resident set (by default it keeps
    freed blocks of up to 32 MiB, and counted every freed staging copy)."""
    tmp_path, run = ran
    fp32_bytes = 25_829_888 * 4
    budget = BUDGET
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads((tmp_path / "out.json").read_text())
    report = seen["report"]
    assert budget < fp32_bytes
    assert report["dram"]["peak"] <= budget
    assert seen["peak"] - seen["before"] <= budget + report["hbm"]["peak"] + (64 << 20)
    assert len(seen["losses"]) == 3 and all(map(math.isfinite, seen["losses"]))
