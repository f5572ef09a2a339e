"""Training through the node's service (issue 18) is training: an engine whose DRAM tier lives
in a real service's shared memory ends bit for bit where the same engine in-process does, and
matches plain PyTorch + torch.optim.AdamW as the parity tests ask, at one and two ranks; what
the service counts for each rank is what that rank's DRAM tier holds.
"""
from __future__ import annotations

import os
import re
import signal
import time

import pytest
import torch

import tiered
from tiered.launch.cli import main as tiered_cli
from tiered.service import remote, service_status, start_service, stop_service
from tiered.service.client import JOB_ENV, SERVICE_ENV
from tiered.service.paths import RUNTIME_ENV

from distributed import run_ranks
from gpt import next_token_loss
from helpers import CONFIGS, assert_same, own_service, run_with_deadline
from helpers_models import OPTIM, assert_parity, make_model, run_engine, token_batches, train_torch
from helpers_quantized import qlora_model

CASES = {
    "cpu": ("cpu", {}),
    # A LoRA model's frozen base kept as nf4 records: their bytes on NVMe through the service.
    "nf4 base": ("nvme", {"sub_group_size": 1024}),
    "nvme": ("nvme", {}),
    "clipped": ("cpu", {"max_grad_norm": 0.5}),
    "delayed update": ("cpu", {"delayed_update": {"enabled": True, "warmup_steps": 1}}),
    "accumulation declared": ("nvme", {"accumulation_steps": 2}),
    "int8 moments": ("nvme", {"moments": "int8"}),  # compact states, stepped in the service
}


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    with own_service(tmp_path_factory, keep_seconds=0.0) as folder:
        yield folder


def train(case: str, nvme: str, rank: int = 0, world: int = 1,
          status_to: str | None = None) -> dict:
    policy, optimizer = CASES[case]
    quantized = case == "nf4 base"
    engine, opt = tiered.initialize(qlora_model() if quantized else make_model(),
                                    os.path.join(CONFIGS, f"{policy}.yaml"),
                                    compute_dtype="fp32", device="cpu", nvme={"path": nvme},
                                    optimizer=dict(OPTIM, **optimizer),
                                    params={"frozen_dtype": "nf4" if quantized else "compute"})
    assert any(flat.record is not None for flat in engine.runtime.flats) == quantized
    if status_to is not None:
        job = next(job for job in service_status(os.environ[SERVICE_ENV])["jobs"]
                   if job["name"] == engine.service_job)
        mine = next(r for r in job["ranks"] if r["rank"] == rank)
        torch.save({"job": engine.service_job, "world": job["world"], "held": mine["dram_bytes"],
                    "dram": engine.memory_report()["dram"]["current"],
                    "nvme": engine.memory_report()["nvme"]["current"],
                    "nvme_held": mine.get("nvme_bytes"), "nvme_folder": mine.get("folder"),
                    "host": type(engine.runtime.host).__name__,
                    "status_host": mine["host"]}, status_to)
    state = run_engine(engine, opt, rank=rank, world=world)
    engine.close()
    return state


def test_an_end_answered_before_the_sender_ties_it_to_its_reply_is_a_clean_end(
        service, tmp_path, monkeypatch):
    """The service answers the host's end and closes the connection at once; the rank's
    sender thread, descheduled right after sending (as on a loaded machine), ties the answer to
    its reply only later. The loss of the connection meanwhile is no failure: the end was
    answered (before, under load, a clean run ended saying its last update had failed)."""
    relay = remote._relay

    def late(source, target):
        source.result(timeout=30)  # the reply is in, and the reader may read the close next
        time.sleep(0.5)
        relay(source, target)

    monkeypatch.setattr(remote, "_relay", late)
    monkeypatch.setenv(SERVICE_ENV, service)
    monkeypatch.setenv(JOB_ENV, "late-relay")
    engine, optimizer = tiered.initialize(make_model(), os.path.join(CONFIGS, "cpu.yaml"),
                                          compute_dtype="fp32", device="cpu",
                                          optimizer=dict(OPTIM))
    run_engine(engine, optimizer, steps=slice(1))
    worker = engine.runtime.worker
    engine.close()
    assert not worker.failed, worker.error


@pytest.mark.parametrize("case", CASES)
def test_one_rank_through_the_service_equals_in_process_bit_for_bit(case, service, tmp_path,
                                                                    monkeypatch):
    in_process = train(case, str(tmp_path))
    monkeypatch.setenv(SERVICE_ENV, service)
    monkeypatch.setenv(JOB_ENV, f"parity-{case.replace(' ', '-').replace(',', '')}")
    through = train(case, str(tmp_path), status_to=str(tmp_path / "status.pt"))
    assert_same(through, in_process, case)
    status = torch.load(tmp_path / "status.pt")
    assert status["job"] == os.environ[JOB_ENV] and status["world"] == 1
    assert status["held"] == status["dram"] > 0  # the service counts what the tier holds
    # The service runs the rank's host, over its NVMe files too.
    assert (status["host"], status["status_host"]) == ("RemoteHost", "service")
    assert status["nvme_held"] == (status["nvme"] if CASES[case][0] == "nvme" else None)
    if CASES[case][0] == "nvme":
        assert status["nvme"] > 0 and status["nvme_folder"].startswith(str(tmp_path))
        assert not os.path.exists(status["nvme_folder"])  # removed with the job
    if case == "cpu":  # and training is training: PyTorch's, to the bit
        model = make_model()
        reference = train_torch(model, torch.optim.AdamW(model.parameters(), fused=True, **OPTIM))
        assert_same(through, reference)
    assert service_status(service)["jobs"] == []  # engine.close() freed it at once


def _two_ranks(rank: int, world: int, folder: str, out: str) -> None:
    os.environ[SERVICE_ENV] = folder
    os.environ[JOB_ENV] = "parity-two-ranks"
    results = {case: train(case, out, rank, world,
                           status_to=os.path.join(out, f"status-{case}-{rank}.pt"))
               for case in ("cpu", "nvme", "clipped")}
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


def test_two_ranks_through_the_service_match_pytorch(service, tmp_path):
    """Two ranks, their hosts in the service (the clipped run's norm summed there over both),
    over its NVMe files for the NVMe policy."""
    run_ranks(2, _two_ranks, service, str(tmp_path))
    references = {}
    for clip in (None, 0.5):  # the service sums the clipped case's norm over both ranks
        model = make_model()
        references[clip] = train_torch(model, torch.optim.AdamW(model.parameters(), **OPTIM),
                                       max_grad_norm=clip)
    for rank in range(2):
        for case, state in torch.load(tmp_path / f"rank{rank}.pt").items():
            assert_parity(state, references[CASES[case][1].get("max_grad_norm")])
            status = torch.load(tmp_path / f"status-{case}-{rank}.pt")
            assert (status["job"], status["world"]) == ("parity-two-ranks", 2)
            assert status["held"] == status["dram"] > 0
            assert status["status_host"] == "service"
            assert status["nvme_held"] == (status["nvme"] if case == "nvme" else None)
    assert service_status(service)["jobs"] == []
    assert not [p for p in os.listdir(tmp_path) if p.startswith("tiered-")]


def test_a_service_killed_mid_run_is_an_error_naming_it_and_the_next_removes_its_files(
        tmp_path, monkeypatch):
    """The rank's host and NVMe files are the service's: when the service dies, whatever waits
    for it (the next forward's weights, a drain) wakes with an error that says so, and the
    engine closes. The dead service's files are removed by the next service that makes files
    there, which says so."""
    folder, nvme = str(tmp_path / "service"), tmp_path / "nvme"
    nvme.mkdir()
    pid = start_service(folder, keep_seconds=0.0)
    monkeypatch.setenv(SERVICE_ENV, folder)
    monkeypatch.setenv(JOB_ENV, "killed-service")
    engine, optimizer = tiered.initialize(make_model(), os.path.join(CONFIGS, "nvme.yaml"),
                                          compute_dtype="fp32", device="cpu",
                                          nvme={"path": str(nvme)}, optimizer=dict(OPTIM))
    assert type(engine.runtime.host).__name__ == "RemoteHost"
    idx = token_batches(1)[0]
    next_token_loss(engine(idx), idx).backward()
    optimizer.step()
    optimizer.zero_grad()
    optimizer.synchronize()
    os.kill(pid, signal.SIGKILL)

    def next_step():
        next_token_loss(engine(idx), idx).backward()
        optimizer.step()
        optimizer.synchronize()

    with pytest.raises(tiered.TieredError, match="the node's service is gone"):
        run_with_deadline(next_step, seconds=60)  # the weights' read from NVMe
    # The update the last step() queued never finished: close() says so, and closes.
    with pytest.raises(tiered.TieredError, match="CPU worker failed: the node's service is gone"):
        run_with_deadline(engine.close, seconds=60)
    engine.close()
    [left] = os.listdir(nvme)
    assert f"-{pid}-" in left  # the dead service's

    start_service(folder, keep_seconds=0.0)
    try:
        monkeypatch.setenv(JOB_ENV, "after-it")
        with pytest.warns(UserWarning, match=f"service removed {nvme / left}, the NVMe folder "
                                             f"of a run that is gone, freeing "):
            engine, _ = tiered.initialize(make_model(), os.path.join(CONFIGS, "nvme.yaml"),
                                          compute_dtype="fp32", device="cpu",
                                          nvme={"path": str(nvme)})
        assert left not in os.listdir(nvme)
        engine.close()
    finally:
        stop_service(folder)
    assert os.listdir(nvme) == []


def test_the_ranks_hosted_on_a_node_never_run_more_threads_than_its_cores(tmp_path):
    """Two ranks whose updates ask for 2 threads each, on a service given one core: each gets
    one thread (its share, at least one), and the node's pool lets one run at a time, so the
    cores are never oversubscribed; a rank that waits for the other's share of the clipped
    norm gives its core back meanwhile (else neither could go on), and both train as torch."""
    folder = str(tmp_path / "service")
    start_service(folder, keep_seconds=0.0, cores="0")
    try:
        run_ranks(2, _report_threads, folder, str(tmp_path))
        seen = [torch.load(tmp_path / f"threads{rank}.pt") for rank in range(2)]
        service = service_status(folder)["service"]
    finally:
        stop_service(folder)
    assert all(s["cores"] == [0] and s["usable_cores"] == 1 for s in seen)
    assert [s["threads"][rank] for rank, s in enumerate(seen)] == [1, 1]
    assert (service["threads_peak"], service["threads_running"]) == (1, 0)
    model = make_model()
    reference = train_torch(model, torch.optim.AdamW(model.parameters(), **OPTIM),
                            max_grad_norm=0.5)
    for s in seen:
        assert_parity(s["state"], reference)


def _report_threads(rank: int, world: int, folder: str, out: str) -> None:
    os.environ[SERVICE_ENV] = folder
    os.environ[JOB_ENV] = "threads"
    engine, optimizer = tiered.initialize(make_model(), os.path.join(CONFIGS, "cpu.yaml"),
                                          compute_dtype="fp32", device="cpu",
                                          cpu={"optimizer_threads": 2},
                                          optimizer=dict(OPTIM, max_grad_norm=0.5))
    status = service_status(folder)
    job = next(job for job in status["jobs"] if job["name"] == "threads")
    state = run_engine(engine, optimizer, rank=rank, world=world)
    torch.save({"cores": status["service"]["cores"],
                "usable_cores": status["service"]["usable_cores"],
                "threads": {r["rank"]: r["threads"] for r in job["ranks"]}, "state": state},
               os.path.join(out, f"threads{rank}.pt"))
    engine.close()


def test_status_says_each_jobs_last_step_done_and_how_busy_its_pool_and_queue_are(
        service, monkeypatch, capsys, tmp_path):
    """Where the service runs a rank's update, ``tiered daemon status`` says the last
    ``optimizer.step()`` whose update it finished: on every rank, for the job; how much of
    the time since it started the rank's CPU worker there ran its commands; and what its NVMe
    files hold and its I/O queue moved."""
    monkeypatch.setenv(SERVICE_ENV, service)
    monkeypatch.setenv(JOB_ENV, "last-step")
    engine, optimizer = tiered.initialize(make_model(), os.path.join(CONFIGS, "nvme.yaml"),
                                          compute_dtype="fp32", device="cpu",
                                          nvme={"path": str(tmp_path)})
    for idx in token_batches(3):
        next_token_loss(engine(idx), idx).backward()
        optimizer.step()
        optimizer.zero_grad()
    optimizer.synchronize()
    job = next(job for job in service_status(service)["jobs"] if job["name"] == "last-step")
    assert job["last_step"] == job["ranks"][0]["last_step"] == optimizer.steps_taken == 3
    # The worker ran three updates and every gradient's intake, and waited between them.
    assert 0.0 < job["ranks"][0]["busy"] < 1.0
    monkeypatch.setenv(RUNTIME_ENV, service)
    assert tiered_cli(["daemon", "status"]) == 0
    said = capsys.readouterr().out
    assert "job last-step: running; world 1, 1 ranks attached, no launcher, last step done 3" \
        in said
    assert re.search(r"CPU update in the service, \d+ thread\(s\), busy \d+% since it started",
                     said), said
    assert "; one I/O queue, 16 deep each way" in said  # every rank's files share it
    rank = job["ranks"][0]
    assert rank["nvme_bytes"] == engine.memory_report()["nvme"]["current"] > 0
    assert rank["read_bytes"] > 0 and rank["written_bytes"] > 0 and rank["io_in_flight"] == 0
    assert re.search(rf"NVMe [\d.]+ \w*B in {re.escape(rank['folder'])}; I/O queue: 0 in "
                     rf"flight, [\d.]+ \w*B read, [\d.]+ \w*B written", said), said
    engine.close()


def test_a_checkpoint_crosses_the_service_both_ways_on_nvme(service, tmp_path, monkeypatch):
    """A checkpoint saved by a rank whose NVMe files the service holds (every state read through
    it) resumes in-process, and one saved in-process loads into such a rank (every state
    written through it): each run ends bit for bit where the uninterrupted run ends."""
    nvme = str(tmp_path)
    whole = train("nvme", nvme)

    def run(through_service: bool, load: str | None, save: str | None, steps: slice) -> dict:
        if through_service:
            monkeypatch.setenv(SERVICE_ENV, service)
            monkeypatch.setenv(JOB_ENV, "checkpoint-crossing")
        else:
            monkeypatch.delenv(SERVICE_ENV, raising=False)
        engine, optimizer = tiered.initialize(make_model(), os.path.join(CONFIGS, "nvme.yaml"),
                                              compute_dtype="fp32", device="cpu",
                                              nvme={"path": nvme}, optimizer=dict(OPTIM))
        assert type(engine.runtime.host).__name__ == (
            "RemoteHost" if through_service else "LocalHost")
        if load is not None:
            engine.load_checkpoint(load)
        state = run_engine(engine, optimizer, steps=steps)
        if save is not None:
            engine.save_checkpoint(save)
        engine.close()
        return state

    for first, then in ((True, False), (False, True)):
        folder = str(tmp_path / f"checkpoint-{first}")
        run(first, None, folder, slice(0, 2))
        assert_same(run(then, folder, None, slice(2, None)), whole, f"saved by service {first}")
    assert service_status(service)["jobs"] == []
