"""``tiered-launch`` as a user runs it: a real subprocess (``python -m tiered.launch.launcher``) from the
repository root, real policy files, real NVMe folders, real ranks over gloo on the CPU.

Bad input must stop before any rank starts (exit 2, a one-line ``tiered-launch: error:`` naming
the file, key or path, no traceback, nothing created under the NVMe path); a budget that cannot
fit must fail inside ``tiered.initialize`` in the rank; a good run must train and clean up.

A launch is mostly its processes' starts (importing torch and tiered), one core's work at a time:
the selected tests' launches run side by side (``launched``), each test's in a folder of its own,
but for the failing rank's, whose time is checked and which runs with nothing beside it.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tiered.engine.engine import LAUNCHED_ENV
from tiered.policy.config import POLICY_ENV, Policy
from tiered.service import JobHold, ensure_service
from tiered.service.paths import RUNTIME_ENV

from helpers import REPO, finish, left_behind, train_reference, write_policy

SCRIPTS = REPO / "tests" / "scripts"


def start(module: str, *args: str) -> subprocess.Popen:
    """``python -m module args`` from the repository root."""
    # A clean environment: no policy or thread count inherited from whoever runs the tests.
    env = {k: v for k, v in os.environ.items()
           if k not in (POLICY_ENV, LAUNCHED_ENV, "OMP_NUM_THREADS")}
    return subprocess.Popen([sys.executable, "-m", module, *map(str, args)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def launch(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return finish(start("tiered.launch.launcher", *args), timeout)


def assert_refused(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if "tiered-launch: error:" in line]
    assert len(errors) == 1 and result.stderr.strip() == errors[0], result.stderr
    for fragment in fragments:
        assert fragment in errors[0], (fragment, errors[0])
    assert "[rank" not in result.stdout + result.stderr  # no rank was started


@pytest.fixture
def nvme(tmp_path) -> Path:
    folder = tmp_path / "nvme"
    folder.mkdir()
    return folder


# -- the launches, side by side ------------------------------------------------------------------

AT_ONCE = 6
"""The launches ``launched`` runs at once: on 2 cores, more only wait for a core (and finish all
together, late), fewer leave one idle while a launch waits on its ranks' rendezvous."""


def beside(arguments, service: bool = True):
    """Mark a test whose launch is ``tiered-launch arguments(where, **params)`` (``where``: a
    folder of the test's own, with an empty ``nvme`` folder in it, as tmp_path and the nvme
    fixture were; ``params``: the test's parameters): ``launched`` runs it beside the other
    selected tests' launches. ``service``: it gets as far as holding its job at the node's
    service (refused input does not)."""
    def mark(test):
        test.launch_arguments, test.launch_holds = arguments, service
        return test
    return mark


class Launched:
    """Each launch started by ``launched``: its future (CompletedProcess), by test name or key."""

    def __init__(self):
        self.runs: dict = {}
        self.folders: dict[str, Path] = {}
        """Each test's folder (``where``), by test name."""
        self.hold: JobHold | None = None
        self._settling = threading.Lock()

    def settle(self) -> None:
        """Wait until every launch has ended; then let go of the session's service."""
        with self._settling:
            for run in self.runs.values():
                run.exception()
            if self.hold is not None:
                self.hold.end(clean=True)
                self.hold = None


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    """The launches of the selected tests here (``beside``, and ``refused``'s commands), AT_ONCE
    at a time, each started and waited for in a thread of its own.

    Those that get to the node's service share the session's (as the tests' launches always
    did); a launcher finds it running, or starts one that exits once its jobs are gone. A job of
    this process holds it meanwhile: run side by side, a launcher must not find the service as it
    exits because the jobs of the others it was serving have just ended."""
    items = [item for item in request.session.items
             if getattr(item, "module", None) is request.module]
    marked = [item for item in items
              if hasattr(getattr(item, "function", None), "launch_arguments")]
    flags = any("refused" in getattr(item, "fixturenames", ()) for item in items)
    root = tmp_path_factory.mktemp("launched")
    done = Launched()
    pool = ThreadPoolExecutor(max_workers=AT_ONCE)
    try:
        # (torchrun refuses the bad flags after the launcher has held its job)
        if flags or any(item.function.launch_holds for item in marked):
            folder = os.environ[RUNTIME_ENV]
            ensure_service(folder, until_idle=True)  # as a launcher would start it
            done.hold = JobHold(folder, f"test-launch-{os.getpid()}")
        # The longer launches (those that start ranks) first, the refused ones after them.
        for number, item in enumerate(sorted(marked, key=lambda item: not
                                             item.function.launch_holds)):
            where = root / str(number)
            (where / "nvme").mkdir(parents=True)
            params = item.callspec.params if hasattr(item, "callspec") else {}
            arguments = item.function.launch_arguments(where, **params)
            done.folders[item.name] = where
            done.runs[item.name] = pool.submit(launch, *arguments)
        if flags:
            folder = request.getfixturevalue("flags_folder")
            for key, command in refused_commands(folder).items():
                done.runs[key] = pool.submit(lambda command: finish(start(*command)), command)
        threading.Thread(target=done.settle, daemon=True).start()
        yield done
    finally:
        pool.shutdown(wait=True)  # each launch ends within its timeout
        done.settle()


@pytest.fixture
def ran(request, launched) -> tuple[Path, subprocess.CompletedProcess]:
    """This test's folder (``where``) and its launch (``beside``)."""
    return launched.folders[request.node.name], launched.runs[request.node.name].result()


@pytest.fixture
def alone(launched):
    """No launch of the other tests runs beside this one."""
    launched.settle()


# -- bad input: refused before any rank starts ---------------------------------------------------

def malformed_yaml(where: Path):
    policy = where / "bad.yaml"
    policy.write_text("compute_dtype: bf16\nparams: {tier: nvme\noptimizer: {tier: nvme}\n")
    return "--nvme", where / "nvme", "--policy", policy, SCRIPTS / "launch_train.py", where


@beside(malformed_yaml, service=False)
def test_malformed_yaml_policy_is_refused(ran):
    tmp_path, result = ran
    nvme, policy = tmp_path / "nvme", tmp_path / "bad.yaml"
    assert_refused(result, str(policy), "malformed YAML at line")
    assert os.listdir(nvme) == []


def unknown_key(where: Path):
    policy = write_policy(where / "typo.yaml", "nvme", optimizer={"lrr": 1e-3})
    return "--nvme", where / "nvme", "--policy", policy, SCRIPTS / "launch_train.py", where


@beside(unknown_key, service=False)
def test_unknown_policy_key_is_refused(ran):
    tmp_path, result = ran
    nvme, policy = tmp_path / "nvme", tmp_path / "typo.yaml"
    assert_refused(result, str(policy), "optimizer.lrr", "allowed here: tier, lr")
    assert os.listdir(nvme) == []


def bad_tier(where: Path):
    policy = write_policy(where / "tier.yaml", "nvme", params={"tier": "ssd"})
    return "--nvme", where / "nvme", "--policy", policy, SCRIPTS / "launch_train.py", where


@beside(bad_tier, service=False)
def test_bad_tier_is_refused(ran):
    tmp_path, result = ran
    nvme, policy = tmp_path / "nvme", tmp_path / "tier.yaml"
    assert_refused(result, str(policy), "params.tier", "'ssd'", "hbm | dram | nvme")
    assert os.listdir(nvme) == []


def missing_nvme(where: Path):
    return ("--nvme", where / "no-such-nvme", "--policy", "configs/nvme.yaml",
            SCRIPTS / "launch_train.py", where)


@beside(missing_nvme, service=False)
def test_missing_nvme_folder_is_refused(ran):
    tmp_path, result = ran
    missing = tmp_path / "no-such-nvme"
    assert_refused(result, f"NVMe path {missing} does not exist")
    assert not missing.exists()


def no_nvme_path(where: Path):
    return "--policy", "configs/nvme.yaml", SCRIPTS / "launch_train.py", where


@beside(no_nvme_path, service=False)
def test_nvme_policy_without_a_path_is_refused(ran):
    _, result = ran
    assert_refused(result, "configs/nvme.yaml", "nvme.path is required", "--nvme")


def missing_script(where: Path):
    return "--nvme", where / "nvme", "--policy", "configs/nvme.yaml", where / "no_such_train.py"


@beside(missing_script, service=False)
def test_missing_training_script_is_refused(ran):
    tmp_path, result = ran
    nvme, script = tmp_path / "nvme", tmp_path / "no_such_train.py"
    assert_refused(result, f"training script {script} does not exist")
    assert os.listdir(nvme) == []


# torchrun's own refusals were tracebacks, for --nproc-per-node 0 a bare AssertionError.
BAD_LAUNCH_FLAGS = [
    ("--nproc-per-node", "0", "--nproc-per-node must be a number >= 1, or auto, cpu, gpu or xpu "
                              "for one rank per device, got '0'"),
    ("--nproc-per-node", "abc", "--nproc-per-node 'abc': "),
    ("--nnodes", "0", "--nnodes must be N or MIN:MAX with 1 <= MIN <= MAX, got '0'"),
    ("--max-restarts", "-1", "--max-restarts must be >= 0, got -1"),
    ("--rdzv-backend", "bogus", "torchrun refused --rdzv-backend=bogus: The rendezvous backend "
                                "'bogus' is not registered"),
]
BENCH_SIZE_FLAGS = ["--size", "--sweep-size"]
TORCH_LOG_LINE = re.compile(r"^[DIWEF]\d{4} \d\d:\d\d:\d\d\.\d+ .*\n", re.MULTILINE)
"""A line of torch's own logging: ``W1123 05:05:18.673000 9714 .../run.py:855] ...``."""
JOB_LINE = re.compile(r"^tiered-launch: job [-\w.#]+\n", re.MULTILINE)
"""The launcher's first line, naming its job."""


@pytest.fixture(scope="module")
def flags_folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("flags")


def refused_commands(flags_folder: Path) -> dict[tuple[str, str], tuple]:
    """The command line of each bad flag above (by flag and value): ``start``'s arguments."""
    commands = {(flag, value): ("tiered.launch.launcher", flag, value, SCRIPTS / "launch_train.py",
                                flags_folder) for flag, value, _ in BAD_LAUNCH_FLAGS}
    commands.update({(flag, "0"): ("tiered.launch.cli", "bench-io", "--nvme", flags_folder, flag, "0")
                     for flag in BENCH_SIZE_FLAGS})
    return commands


@pytest.fixture(scope="module")
def refused(launched, flags_folder) -> dict[tuple[str, str], subprocess.CompletedProcess]:
    """What each bad flag's command line (refused_commands) did, run side by side with the
    other launches (``launched``): each spends a second or more starting Python and torch,
    mostly on one core."""
    return {key: launched.runs[key].result() for key in refused_commands(flags_folder)}


@pytest.mark.parametrize("flag, value, fragment", BAD_LAUNCH_FLAGS,
                         ids=[f"{flag}={value}" for flag, value, _ in BAD_LAUNCH_FLAGS])
def test_bad_torchrun_flag_is_refused(refused, flags_folder, flag, value, fragment):
    result = refused[(flag, value)]
    # Without the static backend torchrun first warns that master_addr is unused, as it does
    # in every such run, and the launcher has named its job before torchrun checks its own
    # flags; the error must be the one line besides.
    stderr = JOB_LINE.sub("", TORCH_LOG_LINE.sub("", result.stderr))
    assert_refused(subprocess.CompletedProcess(result.args, result.returncode, result.stdout,
                                               stderr), fragment)
    assert os.listdir(flags_folder) == []


@pytest.mark.parametrize("flag", BENCH_SIZE_FLAGS)
def test_bench_io_refuses_a_size_of_zero(refused, flags_folder, flag):
    # The benchmark used to fail at its temporary file: "cannot reserve 0 B".
    result = refused[(flag, "0")]
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert result.stderr == f"tiered: error: {flag} must be > 0, got 0\n"
    assert os.listdir(flags_folder) == []


def nvme_not_used(where: Path):
    script = where / "hello.py"
    script.write_text("print('the script ran')\n")
    return "--nvme", where / "no-such-nvme", "--policy", "configs/cpu.yaml", script


@beside(nvme_not_used)
def test_nvme_path_of_a_policy_without_nvme_is_warned_of_and_the_run_goes_on(ran):
    tmp_path, result = ran
    missing = tmp_path / "no-such-nvme"
    assert result.returncode == 0, result.stderr
    assert "the script ran" in result.stdout
    warnings = [line for line in result.stderr.splitlines() if "warning" in line]
    assert warnings == [f"tiered-launch: warning: the policy places nothing on NVMe (params.tier, "
                        f"optimizer.tier and dram.spill are not nvme), so --nvme {missing} is "
                        f"not used"], result.stderr
    assert not missing.exists()


# -- a budget that cannot fit: BudgetError in the rank ---------------------------------------------

def tight_budget(where: Path, base: str, tier: str, budget: dict):
    policy = write_policy(where / "tight.yaml", base, compute_dtype="fp32", **budget)
    out = where / "out"
    out.mkdir()
    return "--nvme", where / "nvme", "--policy", policy, SCRIPTS / "launch_train.py", out


@pytest.mark.parametrize("base, tier, budget", [
    ("cpu", "dram", {"dram": {"budget": 4096}}),
    ("nvme", "dram", {"dram": {"budget": 4096}}),
    ("nvme", "nvme", {"nvme": {"budget": "8KiB"}}),
], ids=["cpu-dram", "nvme-dram", "nvme-nvme"])
@beside(tight_budget)
def test_budget_that_cannot_fit_fails_in_initialize(ran, base, tier, budget):
    tmp_path, result = ran
    nvme, policy, out = tmp_path / "nvme", tmp_path / "tight.yaml", tmp_path / "out"
    assert result.returncode != 0
    # The rank's refusal in one line, no traceback: BudgetError from tiered.initialize.
    assert "Traceback" not in result.stderr, result.stderr
    assert re.search(r"^tiered rank 0: error: the policy does not fit its tier budgets:$",
                     result.stderr, re.M), result.stderr
    assert "(TIERED_TRACEBACK=1 shows where)" in result.stderr
    match = re.search(rf"\b{tier}: needs .*?\((\d+) bytes\), .*?\((\d+) bytes\) available",
                      result.stderr)
    assert match, result.stderr
    needed, available = int(match.group(1)), int(match.group(2))
    assert available == Policy.from_yaml(policy, {"nvme": {"path": str(nvme)}}).to_dict()[tier]["budget"]
    assert needed > available
    assert "tiered-launch: " in result.stderr and "failed on 1 rank(s)" in result.stderr
    assert os.listdir(out) == []      # it never got to train
    assert left_behind(nvme) == []  # the rank's NVMe folder is gone, or kept with the job


# -- good runs -----------------------------------------------------------------------------------

def two_ranks(where: Path):
    # fp32 so a single-process torch run is a reference to 1e-5. eps of the order of the
    # gradients breaks Adam's invariance to the gradient's scale, so a sum over ranks instead
    # of the mean would show; the other non-defaults show that the launcher's policy reached the
    # optimizer (each alone moves some weight by > 5e-3, against 2.4e-7 of rounding measured).
    policy_file = write_policy(where / "train.yaml", "nvme", compute_dtype="fp32", device="cpu",
                               optimizer={"lr": 1e-2, "betas": [0.8, 0.99], "eps": 1e-3,
                                          "weight_decay": 0.1})
    out = where / "out"
    out.mkdir()
    return ("--nproc-per-node", 2, "--nvme", where / "nvme", "--policy", policy_file,
            SCRIPTS / "launch_train.py", out)


@beside(two_ranks)
def test_two_ranks_on_cpu_train_to_equal_weights_and_clean_up(ran):
    tmp_path, result = ran
    nvme, policy_file, out = tmp_path / "nvme", tmp_path / "train.yaml", tmp_path / "out"
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    # The service may close a rank's connection as soon as it has answered the host's end:
    # that is no failure of the last update.
    assert "failed" not in result.stderr, result.stderr

    policy = Policy.from_yaml(policy_file, {"nvme": {"path": str(nvme)}})
    seen = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, info in enumerate(seen):
        assert (info["rank"], info["world"]) == (rank, 2)
        assert Policy.from_dict(info["policy"]) == policy  # what tiered-launch handed the rank
        assert info["nvme_run_dir"].startswith(str(nvme) + os.sep)
    assert seen[0]["losses"] != seen[1]["losses"]  # each rank saw its own half of the batch
    # Through the node's service (the launcher's default): both ranks' DRAM under one job.
    assert seen[0]["service_job"] is not None
    assert seen[0]["service_job"] == seen[1]["service_job"]

    # torchrun would give each of several ranks 1 thread; tiered-launch gives each its share.
    cores = len(os.sched_getaffinity(0))
    assert {info["omp_num_threads"] for info in seen} == {str(max(1, cores // 2))}

    final = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    initial = torch.load(out / "init0.pt")
    assert list(final[0]) == list(final[1]) == list(initial)
    for key in initial:
        assert torch.equal(final[0][key], final[1][key]), key
        assert not torch.equal(final[0][key], initial[key]), f"{key} did not train"

    reference = train_reference(policy)
    for key, expected in reference.items():
        torch.testing.assert_close(final[0][key], expected, rtol=0, atol=1e-5, msg=key)

    assert os.listdir(nvme) == []  # both ranks' run folders removed at a clean exit


def test_failing_rank_stops_the_others_and_no_nvme_folder_is_left_but_the_kept_jobs(alone, nvme):
    # Alone: its time is checked.
    start = time.monotonic()
    result = launch("--nproc-per-node", 2, "--nvme", nvme, "--policy", "configs/nvme.yaml",
                    SCRIPTS / "launch_fail_rank1.py")
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    assert "rank 1 fails on purpose" in result.stderr
    assert "failed on 2 rank(s)" in result.stderr
    assert "rank 0 was never stopped" not in result.stderr
    # torchrun SIGKILLs a rank that ignores SIGTERM after 30 s; rank 0 must have exited on it.
    assert elapsed < 30, elapsed
    assert left_behind(nvme) == []


def exit_after_step(where: Path):
    return "--nproc-per-node", "2", SCRIPTS / "exit_after_step.py", where / "nvme"


@beside(exit_after_step)
def test_ranks_that_end_while_their_update_runs_exit_cleanly(ran):
    """Each rank's worker finishes its update, all-reduce of the norm included, before the
    process group goes at exit; then the NVMe folders go."""
    tmp_path, result = ran
    nvme = tmp_path / "nvme"
    assert result.returncode == 0, result.stderr[-3000:]
    assert os.listdir(nvme) == []
