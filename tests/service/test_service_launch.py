"""``tiered-launch`` and the node's service (issue 18), as real subprocesses and signals: the
launcher starts a service when none runs and that service exits once its jobs are gone; a
clean end frees the job at once; a launcher killed with SIGKILL leaves a failed job whose state
is kept for the keep time, then nothing at all; ``--no-daemon`` keeps every tier in the ranks.

Each test has a service folder of its own (TIERED_RUNTIME_DIR), so the services it sees are the
ones its launches start. A launch is mostly its processes' starts (importing torch and tiered), one
core's work at a time: the selected tests' launches, each in its test's folders, run side by side
(``launched``), but for the killed launcher's, whose keep time counts seconds and which runs with
nothing beside it.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
import torch

from tiered.core.liveness import is_held
from tiered.launch.launcher import _job_name, _parser, main as tiered_launch
from tiered.policy.config import Policy
from tiered.service import (JobHold, ServiceError, running_service, service_paths, service_status,
                            start_service, stop_service)
from tiered.service.paths import RUNTIME_ENV

from helpers import CONFIGS, EXAMPLE, REPO, SMALL, clean_env, finish, train_reference, write_policy

SCRIPTS = REPO / "tests" / "scripts"


@pytest.fixture
def folder(tmp_path):
    where = tmp_path / "service"
    yield str(where)
    hello = running_service(str(where))
    if hello is not None:  # a test that failed half-way: leave no service behind
        os.kill(hello["pid"], signal.SIGKILL)


def launch(folder: str, *args, timeout: float = 180, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tiered.launch.launcher", *map(str, args)], cwd=REPO,
                            env=clean_env(**{RUNTIME_ENV: folder}), text=True, **popen)


def wait_until(condition, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "never got there"
        time.sleep(0.1)


def service_gone(folder: str) -> bool:
    """No service runs in ``folder`` and none left its socket."""
    return (not is_held(service_paths(folder).lock)
            and not os.path.exists(service_paths(folder).socket))


AT_ONCE = 3
"""The tests whose launches run at once (``launched``): on 2 cores, enough to keep both busy
(a launch waits on its processes' rendezvous, the service, a sleep), few enough that a launch
that must get somewhere within a deadline gets there well within it."""


def beside(run, first: bool = False):
    """Mark a test whose launches ``run(folder, where)`` makes (``folder``: the test's service
    folder, ``where``: a folder of its own for its other files) and returns what the test checks;
    ``launched`` runs them beside the other selected tests' launches, those marked ``first``
    before the others."""
    def mark(test):
        test.launches, test.launches_first = run, first
        return test
    return mark


def kill_service(folder: str) -> None:
    """Leave no service behind in ``folder`` (a test that failed half-way)."""
    hello = running_service(folder)
    if hello is not None:
        os.kill(hello["pid"], signal.SIGKILL)


class Launched:
    """What each selected test's launches (``beside``) returned, by test name."""

    def __init__(self):
        self.runs: dict[str, Future] = {}
        self.folders: list[str] = []
        """Their service folders."""

    def __getitem__(self, test: str):
        return self.runs[test].result()

    def settle(self) -> None:
        """Wait until every launch has ended (whether or not its test will pass), and the
        services they started with it (each exits once its jobs are gone: a failed one's after
        its keep time of 2 s), for up to 30 s."""
        for run in self.runs.values():
            run.exception()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(map(service_gone, self.folders)):
            time.sleep(0.1)


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    """The launches of the selected tests here that are marked ``beside``, AT_ONCE tests' at a
    time, each test's in a thread that makes them and waits for them as the test did; a test
    checks what its own returned (``ran``)."""
    wanted = sorted((item for item in request.session.items
                     if getattr(item, "module", None) is request.module
                     and hasattr(getattr(item, "function", None), "launches")),
                    key=lambda item: not item.function.launches_first)
    root = tmp_path_factory.mktemp("launched")
    done = Launched()
    folders = done.folders
    pool = ThreadPoolExecutor(max_workers=AT_ONCE)
    try:
        for number, item in enumerate(wanted):
            where = root / str(number)  # short: the service's socket path is limited
            where.mkdir()
            folders.append(str(where / "service"))
            done.runs[item.name] = pool.submit(item.function.launches, folders[-1], where)
        yield done
    finally:
        pool.shutdown(wait=True)  # each run ends within its own timeouts
        for folder in folders:
            kill_service(folder)


@pytest.fixture
def ran(request, launched):
    """What the launches of this test (marked ``beside``) returned."""
    return launched[request.node.name]


@pytest.fixture
def alone(launched):
    """No launch of the other tests runs beside this one."""
    launched.settle()


def clean_end(folder: str, where: Path):
    out = where / "out"
    out.mkdir()
    run = finish(launch(folder, "--nproc-per-node", 2, "--job", "clean-end", "--policy",
                        CONFIGS / "cpu.yaml", SCRIPTS / "launch_train.py", out,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE), timeout=180)
    return folder, out, run


@beside(clean_end)
def test_a_launch_starts_a_service_that_holds_its_ranks_and_exits_after_a_clean_end(ran):
    folder, out, run = ran
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr
    seen = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert [info["service_job"] for info in seen] == ["clean-end", "clean-end"]
    wait_until(lambda: service_gone(folder), seconds=30)
    log = open(service_paths(folder).log).read()
    for said in ["job clean-end held by its launcher", "job clean-end rank 0/2 attached",
                 "job clean-end rank 1/2 attached", "job clean-end ended cleanly; freed",
                 "the jobs this service was started for are gone; exiting",
                 "tiered service stopped"]:
        assert said in log, log
    # The script ends without engine.close(): the launcher's word that all went well frees it.
    assert "job clean-end rank 0: its trainer went without engine.close()" in log, log
    assert "job clean-end failed" not in log, log
    assert sorted(os.listdir(folder)) == ["service.lock", "service.log"]


def no_daemon(folder: str, where: Path):
    out = where / "out"
    out.mkdir()
    run = finish(launch(folder, "--nproc-per-node", 1, "--no-daemon", "--policy",
                        CONFIGS / "cpu.yaml", SCRIPTS / "launch_train.py", out,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE), timeout=180)
    return folder, out, run


@beside(no_daemon)
def test_no_daemon_keeps_the_tiers_in_the_ranks_and_starts_no_service(ran):
    folder, out, run = ran
    assert run.returncode == 0, run.stderr
    assert json.loads((out / "rank0.json").read_text())["service_job"] is None
    assert not os.path.exists(folder)


@pytest.mark.parametrize("flags, said", [
    (["--no-daemon", "--fresh"], "--job, --fresh and --keep-failed are for the node"),
    (["--no-daemon", "--keep-failed", "5"], "which --no-daemon does not use"),
    (["--job", "a/b"], "--job must be 1 to 100 letters, digits"),
    (["--keep-failed", "-1"], "--keep-failed must be >= 0 seconds, got -1.0"),
])
def test_service_flags_that_make_no_sense_are_one_line_errors(folder, flags, said, capsys,
                                                             monkeypatch):
    # In this process: the flags are refused before anything starts (torchrun, a service).
    monkeypatch.setenv(RUNTIME_ENV, folder)
    assert tiered_launch([*flags, EXAMPLE]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("tiered-launch: error: "), lines
    assert said in lines[0], lines
    assert not os.path.exists(folder)


def test_a_killed_launchers_job_is_kept_then_freed_and_its_service_exits(alone, folder,
                                                                          tmp_path):
    """The launcher's process group killed with SIGKILL (a scheduler's kill): its ranks die with
    it, the job counts as failed and its state is kept for --keep-failed; then the service
    frees it and, having been started for it, exits, leaving no process and no socket. A
    relaunch of the same job at another world size meanwhile is refused, and one with --fresh
    is told that its kept state was freed. Alone: the ranks' exits have taken long on a busy
    machine."""
    stdout = open(tmp_path / "stdout", "w+")
    # Kept 60 s: both relaunches must come within it, and each is a launcher's and a rank's
    # start (seconds alone, over 8 on a loaded 2-core machine, where the --fresh one then
    # found the job already freed and had nothing to say). The job is freed by --fresh.
    launcher = launch(folder, "--nproc-per-node", 2, "--job", "killed", "--keep-failed", 60,
                      "--policy", CONFIGS / "cpu.yaml", EXAMPLE, *SMALL, "--steps", 1_000_000,
                      stdout=stdout, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_until(lambda: re.search(r"^step\s+1\s", open(tmp_path / "stdout").read(), re.M)
                   or launcher.poll() is not None, seconds=150)
        assert launcher.poll() is None, "the launcher ended before training"
        ranks = psutil.Process(launcher.pid).children()
        service_pid = running_service(folder)["pid"]
        assert service_pid not in [rank.pid for rank in ranks]
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=30)
        # 60 s: in full runs on 2 cores the ranks' exits (SIGTERM from their parent's death,
        # then the exit handlers) twice took over 30 s, though about 2 s alone; to look into.
        wait_until(lambda: not [r for r in ranks if r.is_running()
                                and r.status() != psutil.STATUS_ZOMBIE], seconds=60)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    job = service_status(folder)["jobs"][0]
    assert (job["name"], job["state"], job["launcher"]) == ("killed", "failed", None)
    assert not any(rank["attached"] for rank in job["ranks"])
    assert 0 < job["freed_in_seconds"] <= 60

    # Relaunched within the keep time at another world size: refused in one line, nothing
    # freed; with --fresh, a fresh start (tests/service/test_reattach.py relaunches it as it was).
    refused = finish(launch(folder, "--nproc-per-node", 1, "--job", "killed", "--policy",
                            CONFIGS / "cpu.yaml", EXAMPLE, *SMALL, "--steps", 2,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE), timeout=180)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "job killed ran at world size 2 and its state is kept" in refused.stderr
    assert "relaunch it at 2, or with --fresh" in refused.stderr
    again = finish(launch(folder, "--nproc-per-node", 1, "--job", "killed", "--fresh",
                          "--policy", CONFIGS / "cpu.yaml", EXAMPLE, *SMALL, "--steps", 2,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE), timeout=180)
    assert again.returncode == 0, again.stderr
    assert "job killed's kept state was freed: a new run of it starts afresh (--fresh)" \
        in again.stderr
    wait_until(lambda: service_gone(folder), seconds=30)
    wait_until(lambda: not psutil.pid_exists(service_pid)  # its interpreter's exit takes a moment
               or psutil.Process(service_pid).status() == psutil.STATUS_ZOMBIE, seconds=30)


def failed_alone(folder: str, where: Path):
    run = finish(launch(folder, "--nproc-per-node", 1, "--keep-failed", 2, "--policy",
                        CONFIGS / "cpu.yaml", SCRIPTS / "launch_fail_rank1.py",
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE), timeout=120)
    # As the launcher ends: within the keep time (2 s), not whenever the test gets to it.
    as_it_ended = running_service(folder) is not None or service_gone(folder)
    return folder, run, as_it_ended


@beside(failed_alone)
def test_a_failed_job_alone_is_freed_after_the_keep_time_and_the_service_exits(ran):
    folder, run, as_it_ended = ran
    assert run.returncode != 0
    assert as_it_ended  # a service running, or none and no socket: not one half-stopped
    wait_until(lambda: service_gone(folder), seconds=30)
    log = open(service_paths(folder).log).read()
    assert re.search(r"job job-\w+: kept 2 s after it failed; freed", log), log


def live_job(folder: str, where: Path):
    """Job J, paused after its first step until the file ``go`` exists, and what is seen of it
    meanwhile: the service's status, a second launch of J, a raw hold of J (the exception it
    raised, or the hold it got), the status again; then J's end."""
    policy_file = write_policy(where / "fp32.yaml", "cpu", compute_dtype="fp32",
                               device="cpu")
    out, go = where / "out", where / "go"
    out.mkdir()
    live = launch(folder, "--job", "J", "--policy", policy_file, SCRIPTS / "launch_train.py",
                  out, go, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    seen = {"policy_file": policy_file, "out": out, "pid": live.pid}
    try:
        wait_until(lambda: (out / "paused0").exists() or live.poll() is not None)
        seen["paused"] = live.poll() is None
        if seen["paused"]:
            seen["before"] = service_status(folder)
            noop = where / "noop.py"
            noop.write_text("")
            seen["second"] = finish(launch(folder, "--job", "J", "--policy", policy_file, noop,
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE),
                                    timeout=120)
            try:
                seen["hold"] = JobHold(folder, "J")
            except Exception as error:  # noqa: BLE001 (the test says which it must be)
                seen["hold"] = error
            seen["after"] = service_status(folder)
    finally:
        go.touch()
    seen["run"] = finish(live, timeout=120)
    return seen


@beside(live_job, first=True)  # its wait for the pause counts from its start
def test_a_second_launch_of_a_live_job_is_refused_by_name_and_the_job_trains_on(ran):
    """A second ``tiered-launch --job J`` while J trains (here: a script that exits 0 without
    using tiered, which once freed J's memory under it), and a raw ``hold`` of J by another
    process of the user, are refused naming what runs J; J's memory stays its own (a job of the
    same size then gets new segments, not J's) and J ends with PyTorch's weights."""
    seen = ran
    pid, run = seen["pid"], seen["run"]
    assert seen["paused"], (run.stdout, run.stderr)
    before, second, after = seen["before"], seen["second"], seen["after"]
    assert second.returncode == 2 and second.stderr.count("\n") == 1, second.stderr
    assert re.search(rf"job J is running: launcher pid {pid} holds it since "
                     rf"[-\d]+ [:\d]+ and ranks attached: 0 \(pid \d+\); a second launch "
                     rf"of it is refused", second.stderr), second.stderr
    with pytest.raises(ServiceError, match=f"job J is running: launcher pid {pid}"):
        if isinstance(seen["hold"], BaseException):
            raise seen["hold"]
    assert after["dram"]["used"] == before["dram"]["used"] > 0
    assert [(job["name"], job["state"]) for job in after["jobs"]] == [("J", "running")]
    assert run.returncode == 0, run.stderr
    policy_file, out = seen["policy_file"], seen["out"]
    reference = train_reference(Policy.from_yaml(policy_file))
    trained = torch.load(out / "rank0.pt")
    for name, weight in reference.items():
        torch.testing.assert_close(trained[name], weight, rtol=0, atol=1e-5, msg=name)


def two_engines(folder: str, where: Path):
    policy_file = write_policy(where / "fp32.yaml", "nvme", compute_dtype="fp32",
                               device="cpu")
    out, nvme = where / "out", where / "nvme"
    out.mkdir()
    nvme.mkdir()
    started = time.monotonic()
    run = finish(launch(folder, "--nproc-per-node", 2, "--job", "J", "--nvme", nvme,
                        "--policy", policy_file, SCRIPTS / "two_engines.py", out,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE), timeout=240)
    return folder, policy_file, out, nvme, run, time.monotonic() - started


@beside(two_engines)
def test_two_engines_in_each_rank_train_beside_each_other_through_the_service(ran):
    """Each engine of a process is a job of its own at the service (``J``, ``J#1``): the
    second ``initialize`` neither waits behind the first's open files (it once waited ten
    minutes, then failed) nor shares its memory, and both train to PyTorch's weights; the
    launcher's clean end frees both."""
    folder, policy_file, out, nvme, run, took = ran
    assert run.returncode == 0, run.stderr
    assert took < 120, took
    assert [json.loads((out / f"jobs{r}.json").read_text()) for r in range(2)] == \
        [["J", "J#1"]] * 2
    reference = train_reference(Policy.from_yaml(policy_file, {"nvme": {"path": str(nvme)}}))
    for which in ["first", "second"]:
        for r in range(2):
            trained = torch.load(out / f"{which}{r}.pt")
            for name, weight in reference.items():
                torch.testing.assert_close(trained[name], weight, rtol=0, atol=1e-5,
                                           msg=f"{which} engine, rank {r}: {name}")
    wait_until(lambda: service_gone(folder), seconds=30)


def small_pool(folder: str, where: Path):
    start_service(folder, dram=64 << 10)
    try:
        out = where / "out"
        out.mkdir()
        run = finish(launch(folder, "--policy", CONFIGS / "cpu.yaml", SCRIPTS / "launch_train.py",
                            out, stdout=subprocess.PIPE, stderr=subprocess.PIPE), timeout=120)
    finally:
        stop_service(folder)
    return run


@beside(small_pool)
def test_a_rank_the_services_pool_cannot_hold_is_refused_in_one_line(ran):
    """The node's pool (here 64 KiB) refuses a rank's DRAM: the rank says so in one line that
    names the pool and the remedy, not in initialize()'s traceback."""
    run = ran
    assert run.returncode == 1, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    refusal = [line for line in run.stderr.splitlines() if line.startswith("tiered rank 0: ")]
    assert len(refusal) == 1, run.stderr
    assert "the service's DRAM pool cannot hold" in refusal[0]
    assert "start the service with a larger --dram, or lower dram.budget" in refusal[0]


def test_the_launchers_of_a_multi_node_job_name_it_alike():
    """Without --job or a rendezvous id, each node's launcher derives the same name from the
    rendezvous endpoint and the script; one node's is new each time."""
    def name(*flags: str) -> str:
        return _job_name(_parser().parse_args([*flags, "train.py"]))
    nodes = [name("--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint", "host:29400")
             for rank in (0, 1)]
    assert nodes[0] == nodes[1] and re.fullmatch(r"job-[0-9a-f]{8}", nodes[0])
    assert name("--nnodes", "2", "--rdzv-endpoint", "other:29400") != nodes[0]
    assert name("--rdzv-id", "run-7") == "run-7"
    assert name() != name()
