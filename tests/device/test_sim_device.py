"""The simulated accelerator (tiered/device/sim.py) finds what would race on a GPU, by CUDA's
rules, and names both sites: a read with no event after the write it needs, an event recorded
before the work it should follow, memory freed while another stream may still read it (unless
``record_stream`` named that stream), an event waited on before it was recorded, and the host
reading what a stream copies to it before synchronizing. The same programs with the ordering
right pass: each check can fail, and does only where CUDA would race."""
from __future__ import annotations

import gc

import pytest
import torch

from tiered.core.errors import PolicyError
from tiered.device import DEVICE_ENV, CpuAccelerator, accelerator_for
from tiered.device.sim import OrderingError, SimAccelerator


@pytest.fixture
def sim():
    return SimAccelerator()


def gather(sim, side, shard, record_after=True):
    """A unit's weights made on the side stream, and the event that marks them done."""
    event = sim.Event()
    side.wait_stream(sim.current_stream())  # the shard's write
    with sim.stream(side):
        if not record_after:
            event.record()
        weights = shard * 2  # the write
        if record_after:
            event.record()
    return weights, event


def test_a_gather_waited_for_is_ordered(sim):
    side = sim.Stream("the gather stream")
    with sim.tracking():
        shard = torch.ones(64)
        weights, done = gather(sim, side, shard)
        sim.current_stream().wait_event(done)
        (weights + 1).sum()


def test_a_read_with_no_wait_names_the_read_and_the_write(sim):
    side = sim.Stream("the gather stream")
    with pytest.raises(OrderingError) as found:
        with sim.tracking():
            weights, _ = gather(sim, side, torch.ones(64))
            weights + 1  # the read
    said = str(found.value)
    assert "a read on the default stream is not ordered after the write of the same memory " \
           "on the gather stream" in said, said
    assert "weights + 1  # the read" in said and "weights = shard * 2  # the write" in said, said


def test_an_event_recorded_before_the_write_orders_nothing(sim):
    side = sim.Stream("the gather stream")
    with pytest.raises(OrderingError, match="not ordered after the write"):
        with sim.tracking():
            weights, early = gather(sim, side, torch.ones(64), record_after=False)
            sim.current_stream().wait_event(early)
            weights + 1


def offload(sim, side, keep: bool):
    """A gradient made on the default stream, read on the offload stream, then let go."""
    grad = torch.ones(64) * 3
    side.wait_stream(sim.current_stream())
    with sim.stream(side):
        if keep:
            sim.record_stream(grad, side)
        grad.sum()  # the offload stream's read
    del grad  # its memory goes back to the allocator
    gc.collect()


def test_memory_freed_while_another_stream_reads_it_names_the_free_and_the_read(sim):
    side = sim.Stream("the offload stream")
    with pytest.raises(OrderingError) as found:
        with sim.tracking():
            offload(sim, side, keep=False)
    said = str(found.value)
    assert "memory went back to the allocator for the default stream while the offload " \
           "stream may still use it" in said, said
    assert "del grad  # its memory goes back" in said and "grad.sum()  # the offload" in said


def test_memory_kept_with_record_stream_or_waited_for_is_freed_safely(sim):
    side = sim.Stream("the offload stream")
    with sim.tracking():
        offload(sim, side, keep=True)
        grad = torch.ones(64) * 3
        side.wait_stream(sim.current_stream())
        with sim.stream(side):
            grad.sum()
            done = sim.Event()
            done.record()
        sim.current_stream().wait_event(done)
        del grad
        gc.collect()


def test_an_event_waited_on_before_it_was_recorded_is_an_error(sim):
    with pytest.raises(OrderingError, match="waited on before it was recorded"):
        with sim.tracking():
            sim.current_stream().wait_event(sim.Event())


@pytest.mark.parametrize("synchronized", [True, False])
def test_the_host_reads_a_copy_only_after_synchronizing(sim, synchronized):
    side = sim.Stream("the offload stream")
    landed = torch.empty(64)  # pinned host memory, in the CPU worker's hands
    with sim.tracking():
        grad = torch.ones(64)
        side.wait_stream(sim.current_stream())
        with sim.stream(side):
            landed.copy_(grad, non_blocking=True)
            copied = side.record_event()
    if synchronized:
        copied.synchronize()
    sim.host_reads(landed, what="the CPU update")
    if synchronized:
        sim.check()
    else:
        with pytest.raises(OrderingError, match="a read on the host is not ordered after the "
                                                "write of the same memory on the offload"):
            sim.check()


def test_tiered_device_chooses_the_simulated_accelerator_and_refuses_what_is_none(
        monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv(DEVICE_ENV, "sim")
    assert isinstance(accelerator_for(cpu), SimAccelerator)
    monkeypatch.delenv(DEVICE_ENV)
    assert isinstance(accelerator_for(cpu), CpuAccelerator)
    monkeypatch.setenv(DEVICE_ENV, "gpu")
    with pytest.raises(PolicyError, match="TIERED_DEVICE='gpu' is not a device: use sim"):
        accelerator_for(cpu)


def test_two_shards_of_one_slab_are_apart_and_overlapping_views_are_not(sim):
    """A slab holds many shards: a write to one orders nothing about another; a view that
    overlaps the written bytes does."""
    side = sim.Stream("the offload stream")
    slab = torch.zeros(256)
    with sim.tracking():
        with sim.stream(side):
            slab[:128].add_(1.0)  # the write
        slab[128:].sum()  # another shard: apart
        sim.check()
        with pytest.raises(OrderingError, match="not ordered after the write"):
            slab[120:136].sum()  # overlaps the written bytes
            sim.check()


def test_host_memory_is_the_hosts_and_it_waits_for_a_copy_to_it_only_when_told(sim):
    """Operators on host memory (registered, as the DRAM tier's slabs are) run on the host
    whatever thread's; a copy into it on a stream is ordered before the host's read only by a
    synchronize, which a blocking copy is."""
    host = torch.zeros(64)
    sim.register_host_memory(host)
    side = sim.Stream("the offload stream")
    with sim.tracking():
        grad = torch.ones(64)
        side.wait_stream(sim.current_stream())
        with sim.stream(side):
            host.copy_(grad)  # blocking: the host waits for it
        host.sum()
        sim.check()
        with sim.stream(side):
            host.copy_(grad, non_blocking=True)  # the copy
        done = sim.Event()
        done.record(side)
        with pytest.raises(OrderingError, match="a read on the host is not ordered after the "
                                                "write of the same memory on the offload"):
            host.sum()  # the host's read, before it waited
            sim.check()
        done.synchronize()
        host.sum()


def test_a_released_storage_still_read_by_another_stream_is_found(sim):
    """What a released unit does (``release_storage``): its memory goes back to the allocator
    for the stream that made it, and a stream that read it without ``record_stream`` may still
    be reading."""
    side = sim.Stream("the gather stream")
    for kept in (True, False):
        with sim.tracking():
            with sim.stream(side):
                weights = torch.ones(64) * 2
            done = sim.Event()
            done.record(side)
            sim.current_stream().wait_event(done)
            if kept:
                sim.record_stream(weights, sim.current_stream())
            weights.sum()  # the compute stream's read
            if kept:
                sim.release_storage(weights)
                continue
            with pytest.raises(OrderingError, match="memory went back to the allocator for the "
                                                    "gather stream while the default stream"):
                sim.release_storage(weights)
                sim.check()
