"""A rank with device streams, its CPU update in the node's service, trains (issue 31, item 1).

On a GPU the engine has streams, and whatever orders its device work against the CPU update must
work with the update in the service, which takes commands, never Python callables, and never
touches the device. Here the CPU takes a GPU's branches: ``TIERED_DEVICE=sim`` gives the
engine's ``Streams`` the simulated accelerator's streams and events (tiered/device/sim.py), with
CUDA's ordering. Through the service the first ``optimizer.step()`` raised; now it trains as
plain PyTorch does, as the same rank in-process (``--no-daemon``) does, and its
``full_state_dict()`` and ``eval()`` see the last update; so does the delayed update, whose
``step()`` swaps in weights the service wrote while the next forward ran. In-process the
training thread orders the gathers after the worker's device work itself, once it has drained
the worker, and the simulated accelerator finds the race when it does not.
"""
from __future__ import annotations

import logging
import os

import pytest
import torch

import tiered
from tiered.device import DEVICE_ENV
from tiered.device.sim import OrderingError, SimAccelerator
from tiered.engine.streams import Streams
from tiered.optim.workers import CpuWorker
from tiered.service import service_status
from tiered.service.client import JOB_ENV, SERVICE_ENV

from helpers import CONFIGS, assert_same, own_service
from helpers_delayed import assert_matches, reference, train_engine as train_delayed
from helpers_models import OPTIM, assert_parity, make_model, run_engine, token_batches, train_torch

CASES = {
    "cpu": ("cpu", {}),
    "nvme": ("nvme", {}),  # the weights' read-ahead ring goes back with the copies' events
}


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    with own_service(tmp_path_factory, keep_seconds=0.0) as folder:
        yield folder


@pytest.fixture
def streams_as_on_a_gpu(monkeypatch):
    """The engine's streams and events are the simulated accelerator's (a GPU's branches)."""
    monkeypatch.setenv(DEVICE_ENV, "sim")


def train(case: str, nvme: str, host: str) -> tuple[dict, torch.Tensor]:
    """The engine's state after the parity steps, and its logits in eval mode after them; its
    CPU update runs in ``host`` (LocalHost: in-process, RemoteHost: in the service)."""
    policy, optimizer = CASES[case]
    engine, opt = tiered.initialize(make_model(), os.path.join(CONFIGS, f"{policy}.yaml"),
                                    compute_dtype="fp32", device="cpu", nvme={"path": nvme},
                                    optimizer=dict(OPTIM, **optimizer))
    try:
        assert engine.runtime.streams.gather is not None  # the branches a GPU takes
        assert type(engine.runtime.host).__name__ == host
        state = run_engine(engine, opt)
        with torch.no_grad():
            logits = engine.eval()(token_batches(1, seed=7)[0])
        return state, logits
    finally:
        engine.close()


def torch_eval_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(token_batches(1, seed=7)[0])


@pytest.mark.parametrize("case", CASES)
def test_a_rank_with_streams_trains_through_the_service_as_in_process(
        case, service, tmp_path, monkeypatch, streams_as_on_a_gpu):
    in_process, in_process_logits = train(case, str(tmp_path), "LocalHost")
    monkeypatch.setenv(SERVICE_ENV, service)
    monkeypatch.setenv(JOB_ENV, f"streams-{case}")
    through, logits = train(case, str(tmp_path), "RemoteHost")
    assert_same(through, in_process, case)
    assert torch.equal(logits, in_process_logits)
    model = make_model()
    assert_parity(through, train_torch(model, torch.optim.AdamW(model.parameters(), **OPTIM)))
    # Logits sum many products of weights that agree to 1e-6: their rounding, no more.
    torch.testing.assert_close(logits, torch_eval_logits(model), rtol=1e-4, atol=1e-5)
    assert service_status(service)["jobs"] == []  # engine.close() freed it


def test_the_delayed_update_with_streams_through_the_service_follows_its_rule(
        service, tmp_path, monkeypatch, streams_as_on_a_gpu):
    """Each ``step()`` after warm-up makes current the weights the service wrote during the
    forward and backward before it; every step's loss says the forward used the weights the
    rule names."""
    monkeypatch.setenv(SERVICE_ENV, service)
    monkeypatch.setenv(JOB_ENV, "streams-delayed-update")
    state, losses = train_delayed("cpu", 0, 1, str(tmp_path), None)
    assert_matches(state, losses, *reference(None), world=1)
    assert service_status(service)["jobs"] == []


@pytest.mark.parametrize("ordered", [True, False])
def test_gathers_after_a_drain_wait_for_the_device_work_the_worker_queued(ordered):
    """What ``synchronize()`` does in-process on a GPU: the worker writes new weights on its own
    stream (LocalHost.device_stream); once it is drained, the gather stream waits for that
    stream, and a gather that reads the weights is ordered after the write. Without the wait
    it would race on a GPU (a drained worker has queued its work, not run it)."""
    sim = SimAccelerator()
    streams = Streams(sim)
    device_stream = sim.Stream("the CPU worker's stream")
    weights = torch.zeros(64)

    def write_new_weights():
        with sim.tracking(), sim.stream(device_stream):
            weights.add_(1.0)

    worker = CpuWorker(1)
    try:
        worker.submit(write_new_weights)
        worker.drain()
    finally:
        worker.close()
    if ordered:
        streams.gather_after(device_stream)

    def gather():
        with sim.tracking(), streams.on_gather():
            return weights * 2

    if ordered:
        assert torch.equal(gather(), torch.full((64,), 2.0))
    else:
        with pytest.raises(OrderingError, match="not ordered after the write"):
            gather()


def test_initialize_says_it_runs_on_the_simulated_device_and_the_worker_has_its_stream(
        tmp_path, caplog, streams_as_on_a_gpu):
    """What a GPU's in-process rank has: the worker's own stream for its device work
    (LocalHost.device_stream), and a log line naming the device."""
    with caplog.at_level(logging.INFO, logger="tiered"):
        engine, _ = tiered.initialize(make_model(), os.path.join(CONFIGS, "cpu.yaml"),
                                      compute_dtype="fp32", device="cpu")
    try:
        assert "tiered: device cpu (simulated)" in caplog.text
        assert engine.runtime.host.device_stream is not None
    finally:
        engine.close()
