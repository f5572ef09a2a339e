"""A user's bad day with ``tiered-launch`` and the example (issue 17), as real subprocesses and
real signals, on the CPU (CUDA_VISIBLE_DEVICES=""):

- the launcher's process group killed with SIGKILL (a scheduler's kill, a dropped ssh session):
  the ranks must not train on as orphans;
- SIGHUP to it (the terminal closed) and SIGINT (Ctrl-C): the ranks stop, clean up, and the
  launcher says why in one line, with no traceback from any rank; under ``nohup`` nothing stops;
- the example's ``--resume`` before any checkpoint exists, and a ``--checkpoint`` that is a file;
- what ``optimizer.steps_taken`` counts when a step has no backward, across a save and a load.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import torch

import tiered

from gpt import next_token_loss
from helpers import CONFIGS, EXAMPLE, REPO, SMALL, clean_env, finish, left_behind
from helpers_models import OPTIM, make_model, token_batches, train_batches

TORCH_LOG_LINE = re.compile(r"^[DIWEF]\d{4} \d\d:\d\d:\d\d\.\d+ .*\n", re.MULTILINE)
STOPS = ("SIGKILL", "SIGHUP", "SIGINT")
"""What reaches the launcher's process group: a scheduler's or a dropped session's kill, a
terminal that closed, Ctrl-C. The ranks run in sessions of their own (torchrun's), so none of
these reaches them but through the launcher."""


@dataclass
class Stopped:
    result: subprocess.CompletedProcess
    alive: list[int]
    """The ranks' pids still running (not zombies) after the launcher ended and a grace."""
    nvme: Path


def _stops_by_default() -> None:
    """In the launcher's child, before it runs: a terminal's stop signals as a shell in the
    foreground leaves them. A suite run under ``nohup`` (SIGHUP ignored) or as a background
    job of a script (SIGINT ignored) would pass the ignoring on, and the launcher keeps an
    ignored SIGHUP ignored, as nohup asks: the run would train on."""
    for name in ("SIGHUP", "SIGINT"):
        signal.signal(getattr(signal, name), signal.SIG_DFL)


def alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    running = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                running.append(process)
        except psutil.NoSuchProcess:
            pass
    return running


def wait_gone(processes: list[psutil.Process], seconds: float) -> list[psutil.Process]:
    deadline = time.monotonic() + seconds
    while alive(processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive(processes)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> dict[str, Stopped]:
    """For each of STOPS, the example at two ranks under configs/nvme.yaml, training for good,
    in a process group of its own; once it trains, the group gets the signal. The runs go side
    by side: most of each is Python and torch starting."""
    runs = {}
    for name in STOPS:
        root = tmp_path_factory.mktemp(name)
        (root / "nvme").mkdir()
        # Files, not pipes: ranks left running must not block on a pipe no one reads.
        with open(root / "stdout", "w") as out, open(root / "stderr", "w") as err:
            process = subprocess.Popen(
                [sys.executable, "-m", "tiered.launch.launcher", "--nproc-per-node", "2", "--nvme",
                 str(root / "nvme"), "--policy", str(CONFIGS / "nvme.yaml"), EXAMPLE, *SMALL,
                 "--steps", "1000000"],
                cwd=REPO, env=clean_env(), stdout=out, stderr=err, start_new_session=True,
                preexec_fn=_stops_by_default)
        runs[name] = (root, process)
    ranks: dict[str, list[psutil.Process]] = {}
    try:
        deadline = time.monotonic() + 150
        while len(ranks) < len(runs):
            for name, (root, process) in runs.items():
                if name in ranks:
                    continue
                if process.poll() is not None:
                    pytest.fail(f"{name}: the launcher ended before training: "
                                f"{(root / 'stderr').read_text()[-3000:]}")
                if re.search(r"^step\s+1\s", (root / "stdout").read_text(), re.MULTILINE):
                    ranks[name] = psutil.Process(process.pid).children()
                    os.killpg(process.pid, getattr(signal, name))
            assert time.monotonic() < deadline, "no run started training"
            time.sleep(0.05)
        done = {}
        for name, (root, process) in runs.items():
            process.wait(timeout=90)
            left = wait_gone(ranks[name], 30)
            done[name] = Stopped(
                subprocess.CompletedProcess(process.args, process.returncode,
                                            (root / "stdout").read_text(),
                                            (root / "stderr").read_text()),
                [p.pid for p in left], root / "nvme")
        return done
    finally:
        # Never leave a run training on this machine, whatever failed above.
        for name, (_, process) in runs.items():
            for orphan in alive(ranks.get(name, [])):
                orphan.kill()
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def test_ranks_die_with_a_launcher_killed_by_sigkill(stopped):
    """torchrun starts ranks in new sessions with no parent-death signal: they trained on
    and wrote checkpoints beside the next job. Now the kernel sends each SIGTERM as the
    launcher dies, on which it exits; its NVMe folder is the node's service's, kept with the
    failed job for its keep time, and nothing else is left."""
    run = stopped["SIGKILL"]
    assert run.result.returncode == -signal.SIGKILL
    assert run.alive == [], f"ranks {run.alive} outlived their launcher"
    assert left_behind(run.nvme) == []


@pytest.mark.parametrize("name", ["SIGHUP", "SIGINT"])
def test_a_hangup_or_ctrl_c_stops_the_ranks_with_one_line(stopped, name):
    """SIGHUP killed the ranks without their clean-up (their NVMe folders stayed); Ctrl-C
    printed a KeyboardInterrupt traceback from every rank, or a gloo error from one whose
    peer had gone."""
    run = stopped[name]
    signum = getattr(signal, name)
    assert run.result.returncode == 128 + signum, run.result.stderr[-3000:]
    assert "Traceback" not in run.result.stderr, run.result.stderr[-3000:]
    # The launcher's lines: its own, and torch's log (whose lines about the stop it drops).
    said = [line for line in run.result.stderr.splitlines()
            if line.startswith("tiered-launch") or TORCH_LOG_LINE.match(line + "\n")]
    # Its job's name at start; after the stop, until when the service keeps the job and the
    # command that goes on from it (tests/launch/test_user_flows.py checks that command).
    assert len(said) == 3 and re.fullmatch(r"tiered-launch: job job-[0-9a-f]{8}", said[0]), \
        run.result.stderr[-3000:]
    assert said[1] == f"tiered-launch: stopped by {name}; the ranks were stopped with it"
    assert said[2].startswith(f"tiered-launch: the node's service keeps job {said[0][19:]} "
                              f"until "), said[2]
    assert run.alive == []
    assert left_behind(run.nvme) == []


# -- the example's checkpoint flags, refused before it trains ----------------------------------

@pytest.fixture(scope="module")
def refused_example(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """The example run directly (one process) with a checkpoint folder it cannot use, side by
    side: --resume where no checkpoint was ever saved (a first run given the flag a restart
    gets), and --checkpoint naming a regular file."""
    root = tmp_path_factory.mktemp("refused")
    (root / "afile").write_text("not a folder\n")
    cases = {
        "resume-before-any-save": ["--checkpoint", root / "ck", "--resume"],
        "checkpoint-is-a-file": ["--checkpoint", root / "afile", "--save-every", "1"],
    }
    started = {name: subprocess.Popen([sys.executable, EXAMPLE, *SMALL, "--steps", "3",
                                       *map(str, flags)], cwd=REPO, env=clean_env(),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for name, flags in cases.items()}
    return {name: (finish(process, timeout=180), root) for name, process in started.items()}


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("train_gpt.py: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert not re.search(r"^step\s", result.stdout, re.MULTILINE)  # it never trained


def test_resume_before_any_checkpoint_is_one_line_error(refused_example):
    """--resume means resume: a folder with no checkpoint most likely is the wrong folder, and a
    fresh start would train from scratch and save beside what the user meant to resume."""
    result, root = refused_example["resume-before-any-save"]
    assert_one_line_error(result, "--resume", f"no checkpoint in {root / 'ck'}")
    assert not (root / "ck").exists()  # nothing made where the user pointed, maybe by mistake


def test_checkpoint_folder_that_is_a_file_is_refused_before_training(refused_example):
    result, root = refused_example["checkpoint-is-a-file"]
    assert_one_line_error(result, "--checkpoint", str(root / "afile"), "regular file")
    assert (root / "afile").read_text() == "not a folder\n"


# -- what steps_taken counts -------------------------------------------------------------------

@pytest.mark.parametrize("optimizer_keys", [
    {}, {"accumulation_steps": 1}, {"delayed_update": {"enabled": True, "warmup_steps": 1}},
], ids=["plain", "accumulation", "delayed"])
def test_a_step_without_backward_counts_as_a_call_and_resumes_exactly(tmp_path, optimizer_keys):
    """``steps_taken`` counts step() calls (the loop's position, as the example's resume uses
    it to skip batches): a call with no backward since zero_grad() counts, steps no unit (its
    AdamW count stays, as torch's state["step"]), and a checkpoint after it resumes where the
    run that went on is, the count included."""
    engine, optimizer = tiered.initialize(
        make_model(), str(CONFIGS / "cpu.yaml"), compute_dtype="fp32", device="cpu",
        optimizer=dict(OPTIM, **optimizer_keys))
    batches = token_batches(5)
    train_batches(engine, optimizer, batches[:2])
    unit_steps = optimizer.checkpoint_state()["unit_steps"]
    optimizer.step()  # no backward since the loop's zero_grad()
    assert optimizer.steps_taken == 3
    assert optimizer.checkpoint_state()["unit_steps"] == unit_steps == [2.0] * len(unit_steps)
    tag = os.path.basename(engine.save_checkpoint(str(tmp_path / "ck")))
    assert tag == "step00000003"
    train_batches(engine, optimizer, batches[2:])
    went_on = engine.full_state_dict()
    assert optimizer.steps_taken == 6
    engine.load_checkpoint(str(tmp_path / "ck"))
    assert optimizer.steps_taken == 3
    train_batches(engine, optimizer, batches[2:])
    resumed = engine.full_state_dict()
    assert optimizer.steps_taken == 6
    engine.close()
    for name, value in went_on.items():
        assert torch.equal(resumed[name], value), name
    if not optimizer_keys:  # the no-op is torch's too: AdamW skips parameters without a grad
        model = make_model()
        reference = torch.optim.AdamW(model.parameters(), **OPTIM)
        for i, idx in enumerate(batches):
            if i == 2:
                reference.step()
            next_token_loss(model(idx), idx).backward()
            reference.step()
            reference.zero_grad()
        for name, value in model.state_dict().items():
            torch.testing.assert_close(went_on[name], value, rtol=0, atol=1e-5, msg=name)


def test_a_hangup_ignored_with_nohup_stops_nothing(tmp_path):
    """torchrun handled SIGHUP even when the launcher was started to ignore it (``nohup``):
    the job stopped with the terminal that its user had detached it from."""
    script = tmp_path / "wait.py"
    script.write_text("import time\nprint('ready', flush=True)\ntime.sleep(4)\nprint('done')\n")
    out = tmp_path / "stdout"
    with open(out, "w") as stdout:
        process = subprocess.Popen(
            [sys.executable, "-m", "tiered.launch.launcher", script], cwd=REPO, env=clean_env(),
            stdout=stdout, stderr=subprocess.PIPE, text=True, start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))  # as nohup does
    try:
        deadline = time.monotonic() + 60
        while "ready" not in out.read_text():
            assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
            time.sleep(0.05)
        os.killpg(process.pid, signal.SIGHUP)
        result = finish(process, timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert result.returncode == 0, result.stderr
    assert out.read_text() == "ready\ndone\n"
