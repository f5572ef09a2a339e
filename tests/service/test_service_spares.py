"""A job on spares trains as one on fresh memory (issue 30, item 3): the service hands a job the
segments of one that ended with the same sizes (the warm start, service/segments.py's
SpareSegments) as they are, with what the last job left in them; a new segment reads as zeros.
So only a run on spares that the last job filled shows whether every state the tiers read
before writing is set at allocation (the Adam moments zeroed, manager.allocate).
"""
from __future__ import annotations

import os

import pytest
import torch

import tiered
from tiered.service import client, service_status
from tiered.service.client import JOB_ENV, SERVICE_ENV

from helpers import CONFIGS, assert_same, own_service
from helpers_models import OPTIM, make_model, run_engine, states_by_name, train_torch

CASES = {  # all with their moments in DRAM, where spares are
    "fp32 moments": {},
    "int8 moments": {"moments": "int8"},  # codes and per-block scales, both zeroed
    "clipped": {"max_grad_norm": 0.5},  # its norm reads the gradient buffers, spares too
}
LEFT = 0xFF
"""What job A leaves in every byte of its segments: NaN in fp32 and bf16; in an int8 moment,
every block's scale NaN (its codes the second moment's NaN, the first's largest negative). Any
of it read as a state poisons the run."""


def train(case: str, nvme: str) -> tuple[dict, dict]:
    """A run of ``case`` (through the service when the environment names one): its weights and
    every state of every parameter, once it ends."""
    engine, optimizer = tiered.initialize(make_model(), os.path.join(CONFIGS, "cpu.yaml"),
                                          compute_dtype="fp32", device="cpu", nvme={"path": nvme},
                                          optimizer=dict(OPTIM, **CASES[case]))
    weights = run_engine(engine, optimizer)
    states = {key: values for key, (_, values) in states_by_name(engine).items()}
    engine.close()
    return weights, states


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """The module's own service: no other module's spares, and none kept after."""
    with own_service(tmp_path_factory, keep_seconds=0.0) as folder:
        yield folder


@pytest.mark.parametrize("case", CASES)
def test_a_job_on_the_spares_of_one_that_ended_trains_as_one_on_fresh_memory(
        case, service, tmp_path, monkeypatch):
    # Each segment a trainer maps: whether as a spare (populated), whether it held what A
    # left in every byte then, before any tier wrote to it, and the mapping.
    mapped: list[tuple[bool, bool, torch.Tensor]] = []
    map_segment = client.map_segment

    def recording(fd: int, nbytes: int, populate: bool = False) -> torch.Tensor:
        slab = map_segment(fd, nbytes, populate)
        mapped.append((populate, bool(slab.eq(LEFT).all()), slab))
        return slab

    monkeypatch.setattr(client, "map_segment", recording)
    fresh = train(case, str(tmp_path))  # in-process, its own memory: no spares
    assert not mapped

    monkeypatch.setenv(SERVICE_ENV, service)
    monkeypatch.setenv(JOB_ENV, "spares-a")
    engine, optimizer = tiered.initialize(
        make_model(), os.path.join(CONFIGS, "cpu.yaml"), compute_dtype="fp32", device="cpu",
        nvme={"path": str(tmp_path)}, optimizer=dict(OPTIM, **CASES[case]))
    run_engine(engine, optimizer)
    engine.runtime.worker.drain()  # the last update writes no more into the segments
    for _, _, slab in mapped:
        slab.fill_(LEFT)
    left = sum(slab.numel() for _, _, slab in mapped)
    engine.close()
    # A clean end: A's segments are spares (beside an earlier case's of other sizes).
    assert left > 0 and service_status(service)["dram"]["spare"] >= left

    mapped.clear()
    monkeypatch.setenv(JOB_ENV, "spares-b")
    on_spares = train(case, str(tmp_path))
    # B mapped A's segments, as A left them: every one a spare (populated), all of A's.
    assert [(populate, held) for populate, held, _ in mapped] == [(True, True)] * len(mapped)
    assert sum(slab.numel() for _, _, slab in mapped) == left

    for got, expected, what in zip(on_spares, fresh, ("weights", "states")):
        assert_same(got, expected, f"{case} on spares, {what}")
    if case == "fp32 moments":  # and both are PyTorch's, to the bit (test_service_parity.py)
        model = make_model()
        reference = train_torch(model, torch.optim.AdamW(model.parameters(), fused=True, **OPTIM))
        assert_same(on_spares[0], reference)
