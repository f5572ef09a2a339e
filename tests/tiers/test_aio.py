"""The NVMe I/O engine on real O_DIRECT files: requests split by block size, many in flight at once
on separate read and write pools, and failures (injected through ``inject_faults``, the seam
for I/O errors) that name the file, offset and size and never cost a shard its last good
version: on the tier, and through a real engine's optimizer step."""
from __future__ import annotations

import errno
import json
import os
import random
import subprocess
import sys
import threading
import time

import pytest
import torch

import tiered
from tiered.core.liveness import LOCK_NAME
from tiered.core.sizes import align_up
from tiered.device import CpuAccelerator
from tiered.placement.plan import OPTIMIZER_STATES, StateKind
from tiered.tiers import DramTier, NvmeTier, PinnedSlabSource
from tiered.tiers.aio import IoEngine, IoQueue, IoSettings, host_buffer, inject_faults
from tiered.tiers.nvme import SPARE_EXTENTS

from gpt import GPT, next_token_loss
from helpers import REPO

BLOCK = 4096
NVME_YAML = os.path.join(REPO, "configs", "nvme.yaml")


def aligned_blocks(sizes: dict) -> dict:
    """Page-aligned DRAM blocks (O_DIRECT buffers), each ``align_up(size, 4096)`` bytes."""
    return DramTier(None, PinnedSlabSource(CpuAccelerator())).reserve(sizes)


def random_bytes(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)


def direct_file(path, nbytes: int) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    os.posix_fallocate(fd, 0, nbytes)
    return fd


def view(block: torch.Tensor) -> memoryview:
    return host_buffer(block, block.numel())


def hold_writes(go: threading.Event):
    """A fault function that holds every write request until ``go`` is set."""
    def fault(verb, path, offset, size):
        if verb == "write":
            assert go.wait(10), "never released"
        return None
    return fault


def split(verb: str, path: str, offset: int, nbytes: int, step: int) -> list[tuple]:
    """The requests a transfer of ``nbytes`` at ``offset`` must become."""
    return [(verb, path, offset + start, min(step, nbytes - start))
            for start in range(0, nbytes, step)]


class Observer:
    """A fault function that injects nothing: it records each request and the thread it ran on."""

    def __init__(self):
        self.requests: list[tuple] = []
        self.threads: dict[str, set[str]] = {"read": set(), "write": set()}

    def __call__(self, verb, path, offset, size):
        self.requests.append((verb, path, offset, size))  # list.append is atomic
        self.threads[verb].add(threading.current_thread().name)
        return None


# -- the engine on its own ------------------------------------------------------------------------

FILES, FILE_BYTES = 4, 1 << 20


@pytest.mark.parametrize("seed,block_size,queue_depth", [
    (0, BLOCK, 8), (1, 3 * BLOCK, 4), (2, 5 * BLOCK, 3), (3, 16 * BLOCK, 16)])
def test_many_concurrent_transfers_read_back_what_was_written(tmp_path, seed, block_size,
                                                              queue_depth):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    paths = [str(tmp_path / f"f{i}.bin") for i in range(FILES)]
    fds = [direct_file(p, FILE_BYTES) for p in paths]
    model = [bytearray(FILE_BYTES) for _ in paths]  # what each file must hold
    # Disjoint regions at random aligned offsets in every file, each a random unaligned logical
    # size rounded up to whole 4 KiB pages (what O_DIRECT transfers), alternately for the two
    # rounds of writes below.
    regions = []
    for f in range(FILES):
        offset = rng.randrange(4) * BLOCK
        while True:
            logical = rng.randrange(1, 40_000)
            if offset + align_up(logical, BLOCK) > FILE_BYTES:
                break
            regions.append((f, offset, logical))
            offset += align_up(logical, BLOCK) + rng.randrange(3) * BLOCK
    rng.shuffle(regions)
    rounds = (regions[0::2], regions[1::2])
    assert min(len(r) for r in rounds) >= 64
    sizes = {("data", r): align_up(r[2], BLOCK) for r in regions}
    sizes.update({("back", r): align_up(r[2], BLOCK) for r in regions})
    blocks = aligned_blocks(sizes)
    for r in regions:
        data = blocks[("data", r)]
        data[:r[2]] = random_bytes(r[2], gen)
        data[r[2]:] = 0xEE  # the unaligned tail of the last page is written too
        blocks[("back", r)].fill_(0xAB)

    engine = IoEngine(IoSettings(block_size, queue_depth))
    observer = Observer()
    expected = []

    def start(verb: str, chosen: list) -> list:
        """Start ``verb`` on every region: writes from its data, reads into its read-back."""
        move, which = (engine.write, "data") if verb == "write" else (engine.read, "back")
        transfers = []
        for f, offset, logical in chosen:
            block = blocks[(which, (f, offset, logical))]
            transfers.append(move(fds[f], paths[f], offset, view(block)))
            expected.extend(split(verb, paths[f], offset, block.numel(), block_size))
        return transfers

    try:
        with inject_faults(observer):
            # Round 1: every write of the first half in flight at once.
            transfers = start("write", rounds[0])
            for t in transfers:
                t.wait()
            assert all(t.done() for t in transfers)
            # Round 2: read all of round 1 back while the second half is written, the same
            # files by both pools at once.
            for t in start("read", rounds[0]) + start("write", rounds[1]):
                t.wait()
            # Round 3: the second half read back, many reads in flight.
            for t in start("read", rounds[1]):
                t.wait()
    finally:
        engine.close()
        for fd in fds:
            os.close(fd)

    for f, offset, logical in regions:
        data, back = blocks[("data", (f, offset, logical))], blocks[("back", (f, offset, logical))]
        assert torch.equal(back, data), f"file {f} at {offset}: {logical} bytes read back differ"
        model[f][offset:offset + data.numel()] = bytes(view(data))
    for f, path in enumerate(paths):  # and the files hold it, with nothing else touched
        with open(path, "rb") as raw:
            assert raw.read() == model[f], f"{path} differs from what was written"
    # Every transfer became exactly its block_size requests, reads on the read pool and writes
    # on the write pool, each pool at most queue_depth threads.
    assert sorted(observer.requests) == sorted(expected)
    for verb in ("read", "write"):
        threads = observer.threads[verb]
        assert 1 <= len(threads) <= queue_depth, (verb, threads)
        assert all(name.startswith(f"tiered-nvme-{verb}") for name in threads), threads
    # The engine's byte counts are those of the requests it ran.
    assert engine.bytes_moved() == {
        verb: sum(size for v, _, _, size in expected if v == verb) for verb in ("read", "write")}


@pytest.mark.parametrize("queue_depth", [1, 4])
def test_queue_depth_requests_in_flight_in_each_direction(tmp_path, queue_depth):
    # The first 2 * queue_depth requests meet at a barrier: it opens only if each pool runs
    # queue_depth requests at the same time.
    barrier = threading.Barrier(2 * queue_depth, timeout=10)
    entered = []
    lock = threading.Lock()

    def meet(verb, path, offset, size):
        with lock:
            entered.append(verb)
            waits = len(entered) <= 2 * queue_depth
        if waits:
            barrier.wait()

    nbytes = 2 * queue_depth * BLOCK
    reading, writing = str(tmp_path / "r.bin"), str(tmp_path / "w.bin")
    fds = [direct_file(reading, nbytes), direct_file(writing, nbytes)]
    blocks = aligned_blocks({"in": nbytes, "out": nbytes})
    engine = IoEngine(IoSettings(BLOCK, queue_depth))
    try:
        with inject_faults(meet):
            reads = engine.read(fds[0], reading, 0, view(blocks["in"]))
            writes = engine.write(fds[1], writing, 0, view(blocks["out"]))
            reads.wait()
            writes.wait()
    finally:
        engine.close()
        for fd in fds:
            os.close(fd)
    assert sorted(entered[:2 * queue_depth]) == ["read"] * queue_depth + ["write"] * queue_depth
    assert len(entered) == 4 * queue_depth


def test_wait_raises_the_first_failure_after_every_request_finished(tmp_path):
    step = 2 * BLOCK
    path = str(tmp_path / "f.bin")
    fd = direct_file(path, 5 * step)
    block = aligned_blocks({"b": 5 * step})["b"]
    engine = IoEngine(IoSettings(step, 4))

    def fault(verb, path, offset, size):
        if offset == step:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        if offset == 3 * step:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if offset == 4 * step:
            time.sleep(0.3)  # the last request is still running when the first ones failed
        return None

    try:
        for verb, start in (("write", engine.write), ("read", engine.read)):
            with inject_faults(fault):
                transfer = start(fd, path, 0, view(block))
                with pytest.raises(tiered.NvmeError) as info:
                    transfer.wait()
            assert transfer.done(), "wait() returned while a request still used the buffer"
            e = info.value
            assert (e.path, e.offset, e.size, e.errno) == (path, step, step, errno.EIO), verb
            assert (f"NVMe {verb} failed on {path} at offset {step}, size {step}"
                    in str(e)), str(e)
            assert isinstance(e, tiered.TieredError) and isinstance(e, OSError)

        # A request that moves fewer bytes than asked is a failure too, naming what it moved.
        with inject_faults(lambda verb, path, offset, size:
                           size - 512 if offset == 4 * step else None):
            with pytest.raises(tiered.NvmeError) as info:
                engine.write(fd, path, 0, view(block)).wait()
        e = info.value
        assert (e.path, e.offset, e.size, e.errno) == (path, 4 * step, step, errno.EIO)
        assert path in str(e) and f"offset {4 * step}" in str(e) and f"size {step}" in str(e)
        assert f"moved only {step - 512} bytes" in str(e)
    finally:
        engine.close()
        os.close(fd)


# -- faults on an NVMe shard ----------------------------------------------------------------------

STEP = 2 * BLOCK
SHARD_BYTES = 5 * STEP + 100  # 11 pages: five 8 KiB requests and a last one of 4 KiB


@pytest.fixture
def tier(tmp_path):
    tier = NvmeTier(str(tmp_path), budget=None, rank=0, io=IoSettings(STEP, 4))
    assert tier.direct
    yield tier
    tier.close()
    assert os.listdir(tmp_path) == []


def extents(run_dir: str) -> list[str]:
    """The files of a run folder but its owner's lock file."""
    return sorted(set(os.listdir(run_dir)) - {LOCK_NAME})


def spares(tier: NvmeTier, nbytes: int) -> set[int]:
    """The spare extents of that size (by identity)."""
    return {id(extent) for extent in tier._spares[nbytes]}


def raw(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def fail_on_write(at: int, how):
    def fault(verb, path, offset, size):
        if verb == "write" and offset == at:
            return how(size)
        return None
    return fault


def raise_errno(code: int):
    def how(size):
        raise OSError(code, os.strerror(code))
    return how


FAULTS = {  # name: (fault, errno, offset, size)
    "ENOSPC": (fail_on_write(2 * STEP, raise_errno(errno.ENOSPC)), errno.ENOSPC, 2 * STEP, STEP),
    "EIO": (fail_on_write(0, raise_errno(errno.EIO)), errno.EIO, 0, STEP),
    "short write": (fail_on_write(5 * STEP, lambda size: size - 1), errno.EIO, 5 * STEP, BLOCK),
}


def test_failed_writes_keep_the_previous_version(tier):
    shard = tier.create("faulty", SHARD_BYTES)
    size = shard.nbytes
    assert size == 11 * BLOCK
    gen = torch.Generator().manual_seed(7)
    blocks = aligned_blocks({"v1": size, "bad": size, "v2": size, "back": size})
    for name in ("v1", "bad", "v2"):
        blocks[name].copy_(random_bytes(size, gen))
    shard.write_from(blocks["v1"])
    good, bad = bytes(view(blocks["v1"])), bytes(view(blocks["bad"]))
    files = extents(tier.run_dir)
    usage = tier.usage.current
    assert len(files) == 1 + SPARE_EXTENTS

    for name, (fault, code, offset, nbytes) in FAULTS.items():
        extent, before = shard.extent, spares(tier, size)
        spare_paths = {e.path for e in tier._spares[size]}
        with inject_faults(fault):
            with pytest.raises(tiered.NvmeError) as info:
                shard.write_from(blocks["bad"])
        e = info.value
        # The error names the extent written (a spare), the request's offset and size.
        assert e.path in spare_paths and e.path != shard.path, name
        assert (e.offset, e.size, e.errno) == (offset, nbytes, code), name
        assert "write" in str(e) and e.path in str(e), name
        assert f"offset {offset}" in str(e) and f"size {nbytes}" in str(e), name
        # The rest of the new version did reach that spare: a torn write, never made current.
        torn = raw(e.path)
        assert (torn[:offset], torn[offset + nbytes:]) == (bad[:offset], bad[offset + nbytes:])
        # The shard is still on its extent, which holds the previous version; no extent leaked.
        assert shard.extent is extent and raw(shard.path) == good, name
        blocks["back"].fill_(0)
        shard.read_into(blocks["back"])
        assert torch.equal(blocks["back"], blocks["v1"]), name
        assert spares(tier, size) == before and len(before) == SPARE_EXTENTS, name
        assert id(shard.extent) not in before
        assert extents(tier.run_dir) == files and tier.usage.current == usage, name

    # A failed read changes nothing either.
    with inject_faults(lambda verb, path, offset, size:
                       size - 1 if verb == "read" and offset == STEP else None):
        with pytest.raises(tiered.NvmeError) as info:
            shard.read_into(blocks["back"])
    assert (info.value.path, info.value.offset, info.value.size) == (shard.path, STEP, STEP)
    assert raw(shard.path) == good

    # A later write works, and switches the shard to what was a spare.
    extent, before = shard.extent, spares(tier, size)
    shard.write_from(blocks["v2"])
    assert id(shard.extent) in before and id(extent) in spares(tier, size)
    assert len(spares(tier, size)) == SPARE_EXTENTS and id(shard.extent) not in spares(tier, size)
    shard.read_into(blocks["back"])
    assert torch.equal(blocks["back"], blocks["v2"])
    assert raw(shard.path) == bytes(view(blocks["v2"]))
    assert extents(tier.run_dir) == files and tier.usage.current == usage


def test_a_write_in_flight_is_not_read_and_wait_settles_once(tier):
    shard = tier.create("pending", SHARD_BYTES)
    size = shard.nbytes
    gen = torch.Generator().manual_seed(8)
    blocks = aligned_blocks({"v1": size, "v2": size, "back": size})
    blocks["v1"].copy_(random_bytes(size, gen))
    blocks["v2"].copy_(random_bytes(size, gen))
    shard.write_from(blocks["v1"])

    go = threading.Event()
    with inject_faults(hold_writes(go)):
        pending = shard.start_write(blocks["v2"])
        # Until the write is waited for, readers get the previous version.
        shard.read_into(blocks["back"])
        assert torch.equal(blocks["back"], blocks["v1"])
        go.set()
        pending.wait()
    shard.read_into(blocks["back"])
    assert torch.equal(blocks["back"], blocks["v2"])
    # Waiting again changes nothing (it must not give the current extent back as a spare).
    extent, before = shard.extent, spares(tier, size)
    pending.wait()
    assert shard.extent is extent and spares(tier, size) == before
    assert id(extent) not in before

    # Nor does waiting again for a failed write (it must not give its spare back twice).
    with inject_faults(FAULTS["EIO"][0]):
        failed = shard.start_write(blocks["v1"])
        for _ in range(2):
            with pytest.raises(tiered.NvmeError):
                failed.wait()
    assert shard.extent is extent and spares(tier, size) == before
    assert len(tier._spares[size]) == SPARE_EXTENTS
    shard.read_into(blocks["back"])
    assert torch.equal(blocks["back"], blocks["v2"])


def test_writes_beyond_the_spares_wait_for_one(tier):
    shards = [tier.create(f"s{i}", SHARD_BYTES) for i in range(SPARE_EXTENTS + 1)]
    size = shards[0].nbytes
    gen = torch.Generator().manual_seed(9)
    blocks = aligned_blocks({i: size for i in range(len(shards))} | {"back": size})
    for b in blocks.values():
        b.copy_(random_bytes(size, gen))
    go = threading.Event()
    late = {}
    with inject_faults(hold_writes(go)):
        pending = [s.start_write(blocks[i]) for i, s in enumerate(shards[:SPARE_EXTENTS])]
        assert tier._spares[size] == []
        last = threading.Thread(target=lambda: late.setdefault(
            "write", shards[-1].start_write(blocks[SPARE_EXTENTS])), daemon=True)
        last.start()
        last.join(0.3)
        assert last.is_alive(), "a write started with no spare extent left"
        go.set()
        pending[0].wait()  # gives back the first shard's old extent
        last.join(10)
        assert not last.is_alive()
        for p in [*pending[1:], late["write"]]:
            p.wait()
    assert len({id(s.extent) for s in shards}) == len(shards)
    assert len(tier._spares[size]) == SPARE_EXTENTS
    for i, s in enumerate(shards):
        s.read_into(blocks["back"])
        assert torch.equal(blocks["back"], blocks[i]), i


# -- faults through a real engine -----------------------------------------------------------------

def read_state(manager, unit: int, kind) -> torch.Tensor:
    """A shard state's current contents, wherever it lives."""
    shard = manager.shards[(unit, kind)]
    out = torch.empty(shard.numel, dtype=shard.dtype)
    manager.copy_out(unit, kind, out)
    return out


def test_a_failed_write_in_optimizer_step_keeps_the_last_good_state(tmp_path):
    torch.manual_seed(0)
    # One write thread and 4 KiB requests: the requests of a step run in a known order.
    engine, optimizer = tiered.initialize(
        GPT(64, 32, 2, 2), NVME_YAML, device="cpu", compute_dtype="fp32",
        nvme={"path": str(tmp_path), "block_size": BLOCK, "queue_depth": 1})
    run_dir = os.path.join(tmp_path, os.listdir(tmp_path)[0])
    units = range(len(engine.runtime.flats))
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 64, (4, 16), generator=g) for _ in range(2)]
    try:
        next_token_loss(engine(batches[0]), batches[0]).backward()
        optimizer.step()
        optimizer.zero_grad()
        optimizer.synchronize()
        manager = engine.manager
        good = {(i, kind): read_state(manager, i, kind) for i in units for kind in OPTIMIZER_STATES}
        extents = {(i, kind): manager.shards[(i, kind)].file.extent
                   for i in units for kind in OPTIMIZER_STATES}
        assert any(bool(good[(i, StateKind.EXP_AVG)].any()) for i in units)  # a step was taken

        # Each unit writes master, exp_avg, exp_avg_sq, then its weights: the first unit's four
        # writes go through, the fifth write (the second unit's master) fails at its second
        # request.
        started = []
        failed = []

        def fault(verb, path, offset, size):
            if verb != "write":
                return None
            if offset == 0:
                started.append(path)
            if len(started) == 5 and offset == BLOCK and not failed:
                failed.append((path, offset, size))
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return None

        next_token_loss(engine(batches[1]), batches[1]).backward()
        with inject_faults(fault):
            with pytest.raises(tiered.TieredError) as info:
                optimizer.step()  # returns at once; the update's failure surfaces here:
                optimizer.synchronize()
        assert len(failed) == 1 and len(started) >= 5
        path, offset, size = failed[0]
        assert path in str(info.value) and os.path.dirname(path) == run_dir
        cause = info.value.__cause__
        assert isinstance(cause, tiered.NvmeError)
        assert (cause.path, cause.offset, cause.size, cause.errno) == (path, offset, size,
                                                                       errno.EIO)

        # A unit's master weights and moments switch together or not at all: the unit whose
        # write failed holds all it held, on the same extents; a unit whose writes completed
        # (the first one stepped, written before the failure) advanced in all three.
        changed = {i for i in units if not torch.equal(read_state(manager, i, StateKind.MASTER),
                                                       good[(i, StateKind.MASTER)])}
        # Units are stepped in the order the forward needs them: the first one's writes went
        # through, the second one's master write is the one that failed.
        first, failing = engine.runtime.forward_order(list(units))[:2]
        assert first in changed, "the first unit's step was lost"
        # The failing unit holds, byte for byte and on the same extents, what it held before
        # the step: a failed write (or its unit's other versions) must never become current.
        for kind in OPTIMIZER_STATES:
            assert torch.equal(read_state(manager, failing, kind).view(torch.uint8),
                               good[(failing, kind)].view(torch.uint8)), (failing, kind)
            assert manager.shards[(failing, kind)].file.extent is extents[(failing, kind)]
        assert len(changed) < len(units), "no unit kept its state"
        for i in units:
            for kind in OPTIMIZER_STATES:
                now = read_state(manager, i, kind)
                if i in changed:
                    assert not torch.equal(now, good[(i, kind)]), (i, kind)
                    assert manager.shards[(i, kind)].file.extent is not extents[(i, kind)]
                else:
                    assert torch.equal(now, good[(i, kind)]), (i, kind)
                    assert manager.shards[(i, kind)].file.extent is extents[(i, kind)]
        # The failed write's extent went back to the spares (a later unit of the same size may
        # have taken it since); the unit it was for never switched to it.
        kept = {manager.shards[(i, kind)].file.path for i in units if i not in changed
                for kind in OPTIMIZER_STATES}
        assert failed[0][0] not in kept
        assert all(len(spare) == SPARE_EXTENTS for spare in manager.nvme._spares.values())
    finally:
        # The engine still closes and removes its run folder (close may report the worker's
        # failure again on the way).
        try:
            engine.close()
        except tiered.TieredError as error:
            assert "CPU worker failed" in str(error)
    assert os.listdir(tmp_path) == []
    engine.close()
    assert os.listdir(tmp_path) == []


# -- tiered bench-io ------------------------------------------------------------------------------

def bench_io_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tiered.launch.cli", "bench-io", *args],
                          capture_output=True, text=True, timeout=300)


def test_bench_io_sweeps_every_point_with_repeats_and_leaves_nothing_behind(tmp_path):
    result = bench_io_cli("--nvme", str(tmp_path), "--size", "8MiB", "--sweep-size", "4MiB",
                          "--repeats", "2", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["repeats"] == 2 and report["size"] == 8 << 20
    labels = [point["label"] for point in report["sweep"]]
    assert len(labels) == 6 * 3 + 1 and labels[-1] == "policy settings, in the sweep"
    assert all(p["write_gbps"] > 0 and p["read_gbps"] > 0 for p in report["sweep"])
    best_read = max(p["read_gbps"] for p in report["sweep"][:-1])
    assert report["engine_vs_best_sweep"]["read"] == report["sweep"][-1]["read_gbps"] / best_read
    assert list(tmp_path.iterdir()) == []  # its files and folder are removed


def test_bench_io_refuses_zero_repeats(tmp_path):
    result = bench_io_cli("--nvme", str(tmp_path), "--repeats", "0")
    assert result.returncode == 2
    assert "--repeats must be at least 1, got 0" in result.stderr
    assert "Traceback" not in result.stderr


def test_engines_sharing_a_queue_never_have_more_requests_in_flight_than_its_depth(tmp_path):
    """The node's service gives every rank's files one queue: two engines reading at once,
    each set to a depth of 4, move no more requests at a time than the shared queue's 2; and
    closing one waits for its own requests only, leaving the queue to the other."""
    active, most = [0], [0]
    lock = threading.Lock()

    def count(verb, path, offset, size):
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        time.sleep(0.02)  # long enough for the other engine's requests to pile up
        with lock:
            active[0] -= 1
        return None

    nbytes = 8 * BLOCK
    paths = [str(tmp_path / f"{name}.bin") for name in ("a", "b")]
    fds = [direct_file(path, nbytes) for path in paths]
    blocks = aligned_blocks({"a": nbytes, "b": nbytes})
    queue = IoQueue(2)
    engines = [IoEngine(IoSettings(BLOCK, 4), queue) for _ in paths]
    try:
        with inject_faults(count):
            transfers = [engine.read(fd, path, 0, view(blocks[name]))
                         for engine, fd, path, name in zip(engines, fds, paths, "ab")]
            for transfer in transfers:
                transfer.wait()
        engines[0].close()
        engines[1].read(fds[1], paths[1], 0, view(blocks["b"])).wait()  # the queue serves on
    finally:
        engines[1].close()
        queue.close()
        for fd in fds:
            os.close(fd)
    assert most[0] == 2
