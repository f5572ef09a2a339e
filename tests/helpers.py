"""What the tests share beyond models and data: where things are, the environment a run of
tiered's commands gets, the example's tiny size, how a run or a thread is waited for, a small
file system mounted for a test, and the check every refused checkpoint load makes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import yaml

import tiered
from tiered.engine.engine import LAUNCHED_ENV
from tiered.policy.config import POLICY_ENV, Policy
from tiered.service.client import JOB_ENV, SERVICE_ENV
from tiered.tiers.aio import inject_faults

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
EXAMPLE = "examples/train_gpt.py"
SMALL = ["--dim", "32", "--layers", "2", "--heads", "2", "--vocab", "64", "--seq", "16",
         "--batch", "4"]
"""The example's model and data at a size that trains 20 steps in about a second."""


def left_behind(nvme) -> list[str]:
    """What is in the NVMe folder ``nvme`` other than the folders of failed jobs that the
    session's service keeps (they are the jobs' state, removed with it at its keep time:
    tests/service/test_service_parity.py, test_reattach.py)."""
    from tiered.service import ServiceError, service_status
    from tiered.service.paths import RUNTIME_ENV

    try:
        jobs = service_status(os.environ[RUNTIME_ENV])["jobs"]
    except ServiceError:  # none runs: it keeps nothing
        jobs = []
    kept = {os.path.basename(rank["folder"]) for job in jobs if job["state"] == "failed"
            for rank in job["ranks"] if rank.get("folder")}
    return sorted(set(os.listdir(nvme)) - kept)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, but that a NaN may be any NaN (which payload an operation passes on is the
    instruction's choice of operand)."""
    if a.dtype is torch.uint8:  # codes: one NaN code
        return torch.equal(a, b)
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.uint8),
                                                       b[~nan].view(torch.uint8))


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without what a launcher or a run sets, and with no GPU: the CPU plays
    the device, so that two ranks need no two GPUs."""
    env = {k: v for k, v in os.environ.items()
           if k not in (POLICY_ENV, LAUNCHED_ENV, "OMP_NUM_THREADS", "TIERED_TRACE", SERVICE_ENV,
                        JOB_ENV)}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.update(extra)
    return env


@contextmanager
def own_service(tmp_path_factory, **options):
    """A service of a test module's own (a module fixture's body), started with ``options``
    (start_service's) and stopped after."""
    from tiered.service import start_service, stop_service

    folder = str(tmp_path_factory.mktemp("service") / "here")
    start_service(folder, **options)
    try:
        yield folder
    finally:
        stop_service(folder)


def finish(process: subprocess.Popen, timeout: float = 120) -> subprocess.CompletedProcess:
    """Wait for ``process`` (killed if it outlasts ``timeout``) and return what it printed."""
    with process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def run_with_deadline(fn, seconds: float = 60.0):
    """Run ``fn`` on a thread; fail the test (instead of hanging it) if it does not finish."""
    outcome: dict = {}

    def target():
        try:
            outcome["value"] = fn()
        except BaseException as error:  # handed to the test thread below
            outcome["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s: a wait that never ends"
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


@contextmanager
def mounted(tmp_path, fstype: str, options: str | None = None, name: str | None = None):
    """A fresh ``fstype`` file system (``mount -o options``) at ``tmp_path/name`` (``name``:
    the type by default), unmounted after; the test is skipped where this process may not
    mount (not root)."""
    where = tmp_path / (name or fstype)
    where.mkdir()
    cmd = ["mount", "-t", fstype] + (["-o", options] if options else []) + [fstype, str(where)]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        pytest.skip(f"cannot run mount: {e}")
    if result.returncode != 0:
        pytest.skip(f"cannot mount {fstype} here: {result.stderr.strip() or result.returncode}")
    try:
        yield str(where)
    finally:
        subprocess.run(["umount", str(where)], check=True)


def rewrite_manifest(folder: str, change) -> None:
    """Edit a saved checkpoint's manifest in place: ``change(manifest)``."""
    path = os.path.join(folder, "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    change(manifest)
    with open(path, "w") as f:
        json.dump(manifest, f)


def assert_same(actual: dict, expected: dict, what: str = "") -> None:
    """The same keys in the same order, every tensor bit for bit."""
    assert list(actual) == list(expected), what
    changed = [name for name in expected if not torch.equal(actual[name], expected[name])]
    assert not changed, f"{what}: changed {changed}"


def refused(engine, load, *in_message: str, one_line: bool = False) -> str:
    """``load()`` raises a CheckpointError whose message holds each of ``in_message`` (and is
    one line, with ``one_line``), and leaves the engine's weights bit for bit as they were."""
    before = engine.full_state_dict()
    with pytest.raises(tiered.CheckpointError) as error:
        load()
    message = str(error.value)
    for part in in_message:
        assert part in message, f"{part!r} not in the message: {message}"
    if one_line:
        assert "\n" not in message, message
    assert_same(engine.full_state_dict(), before, f"half-loaded by a refused load ({message})")
    return message


def update_failing_with(engine, optimizer, idx: torch.Tensor, fault, message: str) -> None:
    """A backward on ``idx``, then the update with ``fault`` (aio.inject_faults') injected into
    its I/O: it must raise a TieredError matching ``message``."""
    from gpt import next_token_loss

    next_token_loss(engine(idx), idx).backward()
    with inject_faults(fault):
        with pytest.raises(tiered.TieredError, match=message):
            optimizer.step()
            optimizer.synchronize()


def write_policy(path: Path, base: str | None = None, **overrides) -> Path:
    """A policy file: ``configs/<base>.yaml`` (or nothing) with schema overrides merged in."""
    data = yaml.safe_load((CONFIGS / f"{base}.yaml").read_text()) if base else {}
    for key, value in overrides.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def train_reference(policy: Policy) -> dict[str, torch.Tensor]:
    """What the ranks of tests/scripts/launch_train.py together must compute: the same model,
    the whole batch, one process, torch.optim.AdamW with the policy's settings."""
    sys.path.insert(0, str(REPO / "tests" / "scripts"))
    try:
        import launch_train as spec
    finally:
        sys.path.remove(str(REPO / "tests" / "scripts"))
    from gpt import next_token_loss

    model = spec.build_model()
    opt = policy.optimizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt.lr, betas=opt.betas, eps=opt.eps,
                                  weight_decay=opt.weight_decay)
    for step in range(spec.STEPS):
        idx = spec.global_batch(step)
        next_token_loss(model(idx), idx).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}


def run_script(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter, from the repository: what it finds may be a crash of
    the process."""
    paths = [str(REPO), str(REPO / "tests"), str(REPO / "examples")]
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
                              paths + [os.environ.get("PYTHONPATH", "")])))
