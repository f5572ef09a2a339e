"""Reattach (issue 18): a trainer killed anywhere, relaunched under the same job, goes on from the
state the node's service kept, and ends exactly where an uninterrupted run ends: every
parameter, buffer and loss bit for bit, at one rank and at two (see [Note: reattach] in
tiered/service/commits.py), relaunched by hand or restarted by torchrun. A relaunch that asks
for something else is refused by name; ``--fresh`` starts over.

The killed runs are real processes SIGKILLed at each point (tests/scripts/reattach_train.py);
the relaunches and the uninterrupted references run in this process against the same service.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from tiered.device import DEVICE_ENV, simulated_device
from tiered.engine.reattach import ReattachError
from tiered.launch.cli import main as tiered_cli
from tiered.service import service_status
from tiered.service.client import FRESH_ENV, JOB_ENV, SERVICE_ENV
from tiered.service.paths import RUNTIME_ENV

from helpers import REPO, clean_env, finish, own_service

SCRIPT = REPO / "tests" / "scripts" / "reattach_train.py"
sys.path.insert(0, str(SCRIPT.parent))
from reattach_train import MICRO, train  # noqa: E402


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    with own_service(tmp_path_factory, keep_seconds=600.0) as folder:
        yield folder


@pytest.fixture(scope="module")
def references(service, tmp_path_factory):
    """Each case's uninterrupted run, trained here through the same service."""
    out, made = tmp_path_factory.mktemp("references"), {}

    def reference(case: str) -> dict:
        if case not in made:
            with _job(service, f"reference-{case}"):
                made[case] = train(str(out / f"{case}.pt"), case)
        return made[case]
    return reference


class _job:
    """This process runs as ``name``'s trainer at ``service`` for the block."""

    def __init__(self, service: str, name: str, **extra: str):
        self.env = {SERVICE_ENV: service, JOB_ENV: name, **extra}

    def __enter__(self):
        self.saved = {key: os.environ.get(key) for key in self.env}
        os.environ.update(self.env)

    def __exit__(self, *exc):
        for key, value in self.saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def start_killed(service: str, job: str, out, case: str, point: str, step: int,
                 **env: str) -> subprocess.Popen:
    """The script run as job ``job`` (with ``env`` too) until it dies at ``point`` of
    ``step``."""
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), str(out), case, point, str(step)], cwd=REPO, text=True,
        env=clean_env(**{SERVICE_ENV: service, JOB_ENV: job}, **env), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE)


def scaled(seconds: float) -> float:
    """``seconds``, a deadline ample on a quiet machine, times how much slower this one runs
    now: processes ready to run per core (the last minute's load average), at least 1 and at
    most 4 (so that a run that hangs still fails in bounded time). A busy CI runner, or a suite
    beside other work, slows every subprocess here alike; a fixed deadline then decides
    nothing but the load."""
    busy = os.getloadavg()[0] / (os.cpu_count() or 1)
    return seconds * min(4.0, max(1.0, busy))


def kept_job(service: str, name: str) -> dict:
    """The job's status once the service has seen its trainer go and its hosts ran what the
    trainer had sent (a relaunch's attach waits for that too)."""
    deadline = time.monotonic() + scaled(60)
    while True:
        job = next(j for j in service_status(service)["jobs"] if j["name"] == name)
        if job["state"] == "failed" and job["resumable_step"] is not None \
                or time.monotonic() > deadline:
            return job
        time.sleep(0.05)


def assert_same_run(resumed: dict, reference: dict, first: int) -> None:
    info, expected = json.loads(resumed["info"]), json.loads(reference["info"])
    assert info["reattached"] and info["first"] == first
    assert info["steps_taken"] == expected["steps_taken"]
    # The resumed steps' losses: the same data, weights, dropout masks and BatchNorm stats.
    assert info["losses"] == expected["losses"][(first - 1) * MICRO:]
    assert resumed["params"].keys() == reference["params"].keys()
    for name, value in reference["params"].items():
        assert torch.equal(resumed["params"][name], value), name


# (case, where the trainer dies, at which step, the steps the relaunch may go on after). Killed
# right after step() returned, or in the forward after a delayed update's step() (which waits
# for nothing of the service), the trainer may or may not have sent the step's record: either
# way every rank is at the same step, and the run ends the same.
POINTS = {
    "in forward": ("plain", "forward", 3, {2}),
    "in backward, accumulating": ("accumulation", "backward", 3, {2}),
    "during the update": ("plain", "update", 2, {1, 2}),
    "delayed update, in forward": ("delayed", "forward", 4, {2, 3}),
    "delayed update, during it": ("delayed", "update", 3, {2, 3}),
    "during save_checkpoint": ("plain", "save", 3, {3}),
    "an exception, no close": ("plain", "raise", 4, {3}),
    "a scheduler made after initialize": ("scheduled", "forward", 4, {3}),
    "on NVMe, delayed, during it": ("nvme", "update", 3, {2, 3}),
}


KILLED_SECONDS = 120
"""A killed run's deadline from its start, scaled: alone on a quiet core one takes 5-10 s
(Python and torch starting, then a few steps of a tiny model)."""


class _KilledRuns:
    """Each selected point's run, killed there: at most one a core at once, in the order the
    tests ask for them, so that the next runs go on while a test relaunches the one before in
    this process. Started all nine at once, they shared two cores nine ways and the first
    one's deadline ran while all shared them: under load the fixture timed out and every
    point failed with it. Here a run's deadline counts from its own start, beside no more runs
    than cores, and one that fails fails its own point alone."""

    def __init__(self, service: str, out, points: list[str]):
        self.service, self.out, self.waiting = service, out, points
        self.running: dict[str, tuple[str, subprocess.Popen, float]] = {}
        self.ended: dict[str, tuple[str, int] | BaseException] = {}
        self.at_once = os.cpu_count() or 1

    def _start(self) -> None:
        while self.waiting and len(self.running) < self.at_once:
            where = self.waiting.pop(0)
            case, point, step, _ = POINTS[where]
            job = "killed-" + where.replace(" ", "-").replace(",", "")
            self.running[where] = job, start_killed(self.service, job, self.out / f"{job}.pt",
                                                    case, point, step), time.monotonic()

    def __getitem__(self, where: str) -> tuple[str, int]:
        """The run's job and exit status, once it ended."""
        if where not in self.ended and where not in self.running and where not in self.waiting:
            self.waiting.append(where)  # a point no selected test listed (asked by hand)
        self._start()
        while where not in self.ended:  # the runs end in about the order they started
            first = next(iter(self.running))
            job, process, started = self.running.pop(first)
            left = scaled(KILLED_SECONDS) - (time.monotonic() - started)
            try:
                self.ended[first] = job, finish(process, max(left, 1.0)).returncode
            except subprocess.TimeoutExpired as late:  # its own point's test fails on it
                self.ended[first] = late
            self._start()
        if isinstance(self.ended[where], BaseException):
            raise self.ended[where]
        return self.ended[where]

    def close(self) -> None:
        """Ends the runs still going (tests failed or were interrupted before asking)."""
        for _, process, _ in self.running.values():
            process.kill()
            finish(process)


@pytest.fixture(scope="module")
def killed(service, tmp_path_factory, request):
    """Each point's killed run, started as the tests of this session come to it (see
    _KilledRuns): its job and exit status."""
    selected = [item.callspec.params["where"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")
                and "where" in item.callspec.params]
    runs = _KilledRuns(service, tmp_path_factory.mktemp("killed"), selected)
    yield runs
    runs.close()


@pytest.mark.parametrize("where", POINTS)
def test_a_trainer_killed_anywhere_goes_on_exactly_from_the_kept_state(where, service, killed,
                                                                         references, tmp_path):
    case, point, step, kept = POINTS[where]
    job, code = killed[where]
    assert code == (1 if point == "raise" else -9)
    held = kept_job(service, job)
    assert held["state"] == "failed" and held["resumable_step"] in kept
    with _job(service, job):
        resumed = train(str(tmp_path / "resumed.pt"), case)
    assert_same_run(resumed, references(case), first=held["resumable_step"] + 1)
    # A clean end frees what was kept at once.
    assert job not in [j["name"] for j in service_status(service)["jobs"]]


def test_a_trainer_on_the_simulated_device_killed_in_its_delayed_update_goes_on_exactly(
        service, references, tmp_path, monkeypatch):
    """A GPU's branches (TIERED_DEVICE=sim: streams, events, the update through the service)
    killed and reattached; the relaunch tracked by the simulator, every access ordered."""
    case, point, step, kept = POINTS["delayed update, during it"]
    job = "killed-on-the-simulated-device"
    run = start_killed(service, job, tmp_path / "killed.pt", case, point, step,
                       **{DEVICE_ENV: "sim"})
    assert finish(run, scaled(KILLED_SECONDS)).returncode == -9
    held = kept_job(service, job)
    assert held["resumable_step"] in kept
    monkeypatch.setenv(DEVICE_ENV, "sim")
    with _job(service, job), simulated_device().tracking():
        resumed = train(str(tmp_path / "resumed.pt"), case)
    assert_same_run(resumed, references(case), first=held["resumable_step"] + 1)


def test_a_relaunch_with_another_policy_is_refused_by_name_and_fresh_starts_over(
        service, references, tmp_path, monkeypatch, capsys):
    job = "mismatched"
    run = start_killed(service, job, tmp_path / "killed.pt", "plain", "forward", 3)
    assert finish(run, scaled(KILLED_SECONDS)).returncode == -9
    kept_job(service, job)
    monkeypatch.setenv(RUNTIME_ENV, service)
    assert tiered_cli(["daemon", "status"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines()
                if line.startswith(f"job {job}: "))
    assert line.startswith(f"job {job}: failed, freed in ") and line.endswith(
        "last step done 2, a relaunch of it goes on from there"), line
    with _job(service, job), pytest.raises(ReattachError) as refused:
        train(str(tmp_path / "other.pt"), "plain", lr=0.02)
    message = str(refused.value)
    assert "policy.optimizer.lr was 0.01, is 0.02" in message and "--fresh" in message
    assert "\n" not in message
    # The refusal changed nothing: the kept state is still there to go on from.
    assert kept_job(service, job)["resumable_step"] == 2
    with _job(service, job, **{FRESH_ENV: "1"}):
        fresh = train(str(tmp_path / "fresh.pt"), "plain")
    info = json.loads(fresh["info"])
    assert not info["reattached"] and info["first"] == 1
    expected = references("plain")["params"]
    assert all(torch.equal(fresh["params"][name], value) for name, value in expected.items())


def launch(runtime: str, job: str, out, *args: str, restarts: int = 0):
    command = [sys.executable, "-m", "tiered.launch.launcher", "--nproc-per-node", "2", "--job", job,
               "--max-restarts", str(restarts), "--keep-failed", "120", str(SCRIPT), str(out),
               *args]
    return finish(subprocess.Popen(command, cwd=REPO, text=True, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE,
                                   env=clean_env(**{RUNTIME_ENV: runtime})),
                  timeout=scaled(240))


def test_a_torchrun_restart_reattaches_and_ends_as_an_uninterrupted_run(tmp_path):
    """--max-restarts 1: rank 1 is killed in backward while rank 0 may have sent its update, so
    no rank runs that step (the commit barrier); torchrun restarts both, the launcher holding
    the job throughout, and the new ranks take its state over from the step before (their
    rendezvous store is new: see tiered/launch/launcher.py on TORCH_DISABLE_SHARE_RDZV_TCP_STORE)."""
    runtime = str(tmp_path / "service")
    reference = launch(runtime, "reference", tmp_path / "reference.pt", "plain")
    assert reference.returncode == 0, reference.stderr
    run = launch(runtime, "restarted", tmp_path / "out.pt", "plain", "backward", "3",
                 restarts=1)
    assert run.returncode == 0, run.stderr
    assert_same_run(torch.load(tmp_path / "out.pt"), torch.load(tmp_path / "reference.pt"),
                    first=3)
