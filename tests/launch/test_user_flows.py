"""What a user does from the shell, as real subprocesses: ``tiered-launch`` running
examples/train_gpt.py under the policies in configs/ at one and two ranks (checkpoints, resume,
LoRA export and import, an interrupted run, TIERED_TRACE), the example's own flags, and the
``tiered check-policy`` / ``tiered bench-io`` commands.

The runs force the CPU (CUDA_VISIBLE_DEVICES=""), where the CPU plays the GPU, so that
configs/gpu.yaml at two ranks needs no two GPUs. Runs that do not depend on each other are
started side by side.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from tiered.core.sizes import parse_size

from helpers import CONFIGS, EXAMPLE, REPO, SMALL, clean_env, finish, left_behind

LOSS_LINE = re.compile(r"^step\s+(\d+)\s+loss (\S+)", re.MULTILINE)


def start(args: list, env: dict[str, str] | None = None, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *map(str, args)], cwd=REPO,
                            env=env or clean_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)


def launch(*args, env: dict[str, str] | None = None, **popen) -> subprocess.Popen:
    """``tiered-launch args`` (as ``python -m tiered.launch.launcher``)."""
    return start(["-m", "tiered.launch.launcher", *args], env, **popen)


def finish_ok(process: subprocess.Popen) -> subprocess.CompletedProcess:
    result = finish(process, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def losses(stdout: str) -> dict[int, str]:
    """The example's printed losses by step, as printed (4 decimals)."""
    return {int(step): loss for step, loss in LOSS_LINE.findall(stdout)}


def file_bytes(path: Path) -> bytes:
    return path.read_bytes()


# -- checkpoints and resume ------------------------------------------------------------------

@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    """The launches of the example that the selected tests here check (through ``resumed`` and
    ``lora_exported``), each started as soon as the run it resumes or imports from has ended,
    side by side with all the others: on the CI machine a launch is mostly its processes'
    starts (importing torch and tiered), one core's work at a time. Yields the folder they
    write under and each run's future (CompletedProcess)."""
    wanted = {name for item in request.session.items
              if getattr(item, "module", None) is request.module
              for name in getattr(item, "fixturenames", ())}
    root = tmp_path_factory.mktemp("launched")
    runs: dict[str, Future] = {}
    pool = ThreadPoolExecutor(max_workers=8)

    def after(needs: tuple, then):
        for need in needs:
            runs[need].result()
        return then()

    def run(name: str, *args, needs: tuple = (), env: dict[str, str] | None = None) -> None:
        runs[name] = pool.submit(after, needs, lambda: finish_ok(launch(*args, env=env)))

    try:
        if "resumed" in wanted:  # (see resumed)
            resume = root / "resume"
            (resume / "nvme").mkdir(parents=True)
            run("whole2", "--nproc-per-node", 2, "--policy", CONFIGS / "gpu.yaml", EXAMPLE,
                *SMALL, "--steps", 20, "--save-pretrained", resume / "whole2",
                env=clean_env(TIERED_TRACE=str(resume / "trace.json")))
            run("whole1", "--policy", CONFIGS / "cpu.yaml", EXAMPLE, *SMALL, "--steps", 20,
                "--save-pretrained", resume / "whole1")
            run("part", "--nproc-per-node", 2, "--nvme", resume / "nvme", "--policy",
                CONFIGS / "nvme.yaml", EXAMPLE, *SMALL, "--steps", 7, "--checkpoint",
                resume / "ck", "--save-every", 7)
            runs["copied"] = pool.submit(after, ("part",), lambda: shutil.copytree(
                resume / "ck", resume / "ck-other"))
            run("same", "--nproc-per-node", 2, "--policy", CONFIGS / "gpu.yaml", EXAMPLE,
                *SMALL, "--steps", 20, "--checkpoint", resume / "ck", "--resume",
                "--save-pretrained", resume / "same", needs=("copied",))
            run("other", "--policy", CONFIGS / "cpu.yaml", EXAMPLE, *SMALL, "--steps", 20,
                "--checkpoint", resume / "ck-other", "--resume", "--save-every", 5,
                "--save-pretrained", resume / "other", needs=("copied",))
        if "lora_exported" in wanted:  # (see lora_exported)
            lora = root / "lora"
            (lora / "nvme").mkdir(parents=True)
            run("lora", "--nproc-per-node", 2, "--nvme", lora / "nvme", "--policy",
                CONFIGS / "nvme.yaml", EXAMPLE, *SMALL, "--steps", 5, "--lora", 4,
                "--save-pretrained", lora / "a")
            run("lora-again", "--policy", CONFIGS / "cpu.yaml", EXAMPLE, *SMALL, "--steps", 0,
                "--lora", 4, "--init-from", lora / "a", "--save-pretrained", lora / "b",
                needs=("lora",))
        yield root, runs
    finally:
        pool.shutdown(wait=True)  # each run ends within finish_ok's timeout


@pytest.fixture(scope="module")
def resumed(launched):
    """Five runs of the example (same data and seed), ending at step 20 but for part:
    whole2  configs/gpu.yaml, 2 ranks, uninterrupted (and TIERED_TRACE set)
    whole1  configs/cpu.yaml, 1 rank, uninterrupted
    part    configs/nvme.yaml, 2 ranks, 7 steps, --save-every 7; then from a copy each of
    same    configs/gpu.yaml, 2 ranks, --resume to 20 (another policy, same world size)
    other   configs/cpu.yaml, 1 rank, --resume to 20 with --save-every 5 (another world size)
    """
    root, runs = launched
    done = {name: runs[name].result() for name in ("whole2", "whole1", "part", "same", "other")}
    return root / "resume", root / "resume" / "nvme", done


def test_resume_under_another_policy_continues_bit_for_bit(resumed):
    root, nvme, done = resumed
    assert "resumed from" in done["same"].stdout and "at step 8" in done["same"].stdout
    whole, same = losses(done["whole2"].stdout), losses(done["same"].stdout)
    assert set(same) == {8, 20} and whole[20] == same[20], (whole, same)
    assert (file_bytes(root / "whole2" / "model.safetensors")
            == file_bytes(root / "same" / "model.safetensors"))
    assert os.listdir(nvme) == []


def test_resume_at_another_world_size_saves_on_and_ends_where_an_uninterrupted_run_does(resumed):
    root, _, done = resumed
    other = losses(done["other"].stdout)
    assert set(other) == {8, 20}, done["other"].stdout
    # A world-2 checkpoint resumed by one rank: the full batch's loss at step 20 as the
    # uninterrupted one-rank run prints it, up to the rounding that two ranks' bf16 sums bring.
    assert abs(float(other[20]) - float(losses(done["whole1"].stdout)[20])) < 0.02
    ck = root / "ck-other"
    assert sorted(p.name for p in ck.iterdir()) == [".owner.lock", "latest", "step00000007",
                                                    "step00000010", "step00000015",
                                                    "step00000020"]
    assert (ck / "latest").read_text().strip() == "step00000020"
    manifest = json.loads((ck / "step00000020" / "manifest.json").read_text())
    assert manifest["world_size"] == 1 and manifest["optimizer"]["steps_called"] == 20


def test_tiered_trace_from_a_launched_two_rank_run_is_a_chrome_trace_per_rank(resumed):
    root, _, _ = resumed
    assert not (root / "trace.json").exists()
    for rank in range(2):
        events = json.loads((root / f"trace.rank{rank}.json").read_text())["traceEvents"]
        assert events and all(e["ph"] == "X" and e["dur"] >= 0 and e["ts"] >= 0 for e in events)
        names = {e["name"] for e in events}
        # 20 steps: one forward of each block per step.
        assert sum(e["name"] == "forward blocks.0" for e in events) == 20, sorted(names)[:20]
        assert {"compute", "cpu", "setup"} <= {e["cat"] for e in events}


@pytest.fixture(scope="module")
def lora_exported(launched):
    """--lora then --save-pretrained (NVMe, 2 ranks) into a/, then --init-from a/ with --lora
    at 1 rank under configs/cpu.yaml and no step, saved again into b/."""
    root, runs = launched
    return root / "lora", runs["lora"].result(), runs["lora-again"].result()


def test_lora_export_at_two_ranks_imports_at_one_rank_unchanged(lora_exported):
    """Exported again, the same bytes (adapters included)."""
    folder, first, again = lora_exported
    assert re.search(r"\(0\.\d+ M trained\)", first.stdout), first.stdout
    assert "warning" not in again.stderr.lower(), again.stderr  # the adapters were there too
    assert file_bytes(folder / "a" / "model.safetensors") == \
        file_bytes(folder / "b" / "model.safetensors")
    assert os.listdir(folder / "nvme") == []


# -- an interrupted run ----------------------------------------------------------------------

INTERRUPTS = [("SIGTERM", 2), ("SIGINT", 1)]
"""SIGTERM to the launcher is what a job scheduler sends; SIGINT to it is Ctrl-C (the ranks run
in sessions of their own, so the terminal's SIGINT reaches the launcher only, which forwards
it)."""


@pytest.fixture(scope="module", params=INTERRUPTS, ids=[f"{s}-{n}rank" for s, n in INTERRUPTS])
def interrupted(request, tmp_path_factory):
    """The example under configs/nvme.yaml saving every 2 steps, with TIERED_TRACE; the launcher
    gets the signal while a save is being written (its staging folder exists) and a complete
    checkpoint is already there."""
    name, ranks = request.param
    root = tmp_path_factory.mktemp(f"interrupt-{name}")
    nvme, ck = root / "nvme", root / "ck"
    nvme.mkdir()
    process = launch("--nproc-per-node", ranks, "--nvme", nvme, "--policy",
                     CONFIGS / "nvme.yaml", EXAMPLE, "--dim", 256, "--layers", 2, "--heads", 2,
                     "--vocab", 256, "--seq", 16, "--batch", 2, "--steps", 100000,
                     "--checkpoint", ck, "--save-every", 2,
                     env=clean_env(TIERED_TRACE=str(root / "trace.json")))
    deadline = time.monotonic() + 90
    try:
        while time.monotonic() < deadline and process.poll() is None:
            names = os.listdir(ck) if ck.is_dir() else []
            if any(n.startswith("step") for n in names) and \
                    any(n.startswith(".step") and n.endswith(".tmp") for n in names):
                break
            time.sleep(0.002)
        else:
            process.kill()
            stderr = finish(process, timeout=180).stderr
            pytest.fail(f"no save in progress seen: {stderr[-2000:]}")
        process.send_signal(getattr(signal, name))
    except BaseException:
        process.kill()
        raise
    result = finish(process, timeout=90)
    return getattr(signal, name), ranks, root, nvme, ck, result


def test_an_interrupted_run_leaves_no_nvme_folder_but_its_kept_jobs(interrupted):
    """The ranks' NVMe folders are the node's service's: kept with the interrupted (failed)
    job for its keep time, to relaunch from; nothing else is left."""
    _, _, _, nvme, _, result = interrupted
    assert result.returncode != 0
    assert left_behind(nvme) == []


def test_interrupted_run_keeps_its_latest_checkpoint_complete(interrupted):
    _, ranks, _, _, ck, _ = interrupted
    tag = (ck / "latest").read_text().strip()
    manifest = json.loads((ck / tag / "manifest.json").read_text())
    assert manifest["world_size"] == ranks
    for name, info in manifest["files"].items():
        data = (ck / tag / name).read_bytes()
        assert len(data) == info["size"] and hashlib.sha256(data).hexdigest() == info["sha256"]


def test_interrupted_run_leaves_a_valid_trace_per_rank(interrupted):
    _, ranks, root, _, _, _ = interrupted
    files = ["trace.json"] if ranks == 1 else [f"trace.rank{r}.json" for r in range(ranks)]
    for name in files:
        events = json.loads((root / name).read_text())["traceEvents"]
        assert any(e["name"] == "forward blocks.0" for e in events)


def test_interrupted_save_leaves_no_partial_checkpoint(interrupted):
    """A save cut short by SIGTERM (SystemExit in the rank) or Ctrl-C (KeyboardInterrupt) is
    not a crash: it unwinds through save_checkpoint, which can remove what it staged. What is
    left must be complete checkpoints, not a hidden folder with part of one."""
    _, _, _, _, ck, _ = interrupted
    # The lock file is the job's claim on the folder (checkpoint/folder.py), not a checkpoint.
    partial = sorted(n for n in os.listdir(ck) if n.startswith(".") and n != ".owner.lock")
    assert partial == [], [(n, sorted(os.listdir(ck / n))) for n in partial]


def test_interrupted_launcher_exits_with_the_signal_and_no_traceback(interrupted):
    signum, _, _, _, _, result = interrupted
    launcher_lines = [line for line in result.stderr.splitlines() if not line.startswith("[rank")]
    assert "Traceback (most recent call last):" not in launcher_lines, result.stderr[-3000:]
    assert result.returncode == 128 + signum, result.returncode


# -- the example's flags ---------------------------------------------------------------------

BAD_EXAMPLE_FLAGS = {
    "resume-without-checkpoint": (["--resume"], "--checkpoint"),
    "save-every-without-checkpoint": (["--save-every", "1"], "--checkpoint"),
    "heads-not-dividing-dim": (["--heads", "3"], "--heads"),
    "negative-lora-rank": (["--lora", "-1"], "--lora"),
    "empty-batch": (["--batch", "0"], "--batch"),
}


@pytest.fixture(scope="module")
def bad_flag_runs():
    """The example run directly (one process, as its docstring also allows) with each bad
    command line, side by side."""
    started = {key: start([EXAMPLE, *SMALL, "--steps", "1", *flags])
               for key, (flags, _) in BAD_EXAMPLE_FLAGS.items()}
    return {key: finish(process, timeout=180) for key, process in started.items()}


@pytest.mark.parametrize("case", list(BAD_EXAMPLE_FLAGS))
def test_example_refuses_conflicting_or_out_of_range_flags(bad_flag_runs, case):
    result, flag = bad_flag_runs[case], BAD_EXAMPLE_FLAGS[case][1]
    assert "Traceback" not in result.stderr, result.stderr[-1500:]
    assert result.returncode == 2, (result.returncode, result.stdout[-500:])
    error = result.stderr.strip().splitlines()[-1]
    assert "error:" in error and flag in error, result.stderr


# -- tiered check-policy and bench-io --------------------------------------------------------

def cli(*args, cwd: Path = REPO) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tiered.launch.cli", *map(str, args)], cwd=cwd,
                            env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def test_check_policy_prints_every_config_as_a_policy_that_checks_to_itself(tmp_path):
    """``tiered check-policy`` on each file of configs/ (nvme.yaml with --nvme): its output,
    read back as a policy file the way the commands read one, resolves to what it printed."""
    from tiered.launch.launcher import policy_from_args

    (tmp_path / "nv").mkdir()
    files = sorted(CONFIGS.glob("*.yaml"))
    assert {f.name for f in files} >= {"cpu.yaml", "gpu.yaml", "nvme.yaml"}
    started = {f: cli("check-policy", f, *(["--nvme", tmp_path / "nv"]
                                           if f.name == "nvme.yaml" else [])) for f in files}
    tiers = {}
    for f, process in started.items():
        result = finish(process, timeout=180)
        assert result.returncode == 0 and result.stderr == "", (f, result.stderr)
        printed = tmp_path / f"resolved-{f.name}"
        printed.write_text(result.stdout)
        assert policy_from_args(str(printed), None).to_dict() == yaml.safe_load(result.stdout), f
        tiers[f.name] = yaml.safe_load(result.stdout)["params"]["tier"]
    assert (tiers["cpu.yaml"], tiers["gpu.yaml"], tiers["nvme.yaml"]) == ("dram", "hbm", "nvme")
    assert os.listdir(tmp_path / "nv") == []


def test_check_policy_names_the_file_and_key_of_a_missing_nvme_path(tmp_path):
    missing = tmp_path / "no-such-ssd"
    policy = tmp_path / "ssd.yaml"
    policy.write_text(f"params: {{tier: nvme}}\noptimizer: {{tier: nvme}}\n"
                      f"nvme: {{path: {missing}}}\n")
    result = finish(cli("check-policy", policy))
    assert result.returncode == 2 and result.stdout == "" and "Traceback" not in result.stderr
    line = result.stderr.strip()
    assert line.startswith("tiered: error: ") and str(missing) in line, line
    # The path came from the file, not from --nvme: say which file and key hold it.
    assert str(policy) in line and "nvme.path" in line, line


def test_bench_io_labels_the_single_stream_with_the_request_it_made(tmp_path):
    result = finish(cli("bench-io", "--nvme", tmp_path, "--size", "4MiB", "--sweep-size", "1MiB",
                        "--repeats", "1", "--json"))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    single = report["single_stream"]
    assert single["block_size"] == 4 << 20  # min(8 MiB, the 4 MiB file)
    # The table prints the label only: its request size must be the one measured.
    label_size = single["label"].split(", ")[1]
    assert parse_size(label_size) == single["block_size"], single
    assert single["label"] in result.stdout
    assert os.listdir(tmp_path) == []


def test_an_interrupted_launcher_names_its_job_and_the_command_that_goes_on_from_it(
        interrupted):
    """At start the launcher names the job; stopped, it says until when the node's service
    keeps it and the command that goes on from it: the same, with its --job (a relaunch of a
    kept job: tests/service/test_reattach.py)."""
    _, _, _, _, _, result = interrupted
    job = re.search(r"^tiered-launch: job (job-[0-9a-f]{8})$", result.stderr, re.M)
    assert job, result.stderr[-3000:]
    keeps = re.search(rf"^tiered-launch: the node's service keeps job {job[1]} until "
                      rf"\d\d:\d\d:\d\d; go on from it with: (.*)$", result.stderr, re.M)
    assert keeps, result.stderr[-3000:]
    assert shlex.split(keeps[1]) == ["tiered-launch", "--job", job[1],
                                     *map(str, result.args[3:])]
