"""The NVMe tier on real files and real mounts: extents (files with O_DIRECT), file systems
without O_DIRECT, full disks. HBM and DRAM are in test_memory_tiers.py; the NVMe I/O engine
itself, and failures injected into it, in test_aio.py; the tier manager as a real engine drives
it in test_nvme_engine.py."""
from __future__ import annotations

import errno
import os
import re
import resource
import stat
import warnings
from collections import Counter
from contextlib import contextmanager

import pytest
import torch

import tiered
from tiered.core.liveness import LOCK_NAME
from tiered.core.sizes import align_up, format_size
from tiered.tiers import NvmeTier
from tiered.tiers.aio import IoSettings, inject_faults
from tiered.tiers.nvme import SPARE_EXTENTS, check_nvme_path, free_bytes, nvme_bytes

from helpers import mounted
from helpers_tiers import BLOCK, EXTENT_NAME, dram_blocks

# -- helpers ------------------------------------------------------------------------------------

def fd_flags(fd: int) -> int:
    with open(f"/proc/self/fdinfo/{fd}") as f:
        for line in f:
            if line.startswith("flags:"):
                return int(line.split()[1], 8)
    raise AssertionError(f"no flags line in /proc/self/fdinfo/{fd}")


def tree(path: str) -> list[str]:
    """Every file and folder under ``path``, relative to it."""
    out = []
    for root, dirs, files in os.walk(path):
        out += [os.path.relpath(os.path.join(root, n), path) for n in dirs + files]
    return sorted(out)


def accepts_o_direct(folder: str) -> bool:
    """Whether the file system of ``folder`` lets a file be opened with O_DIRECT (checked here,
    independently of the tier: tmpfs accepts it since Linux 6.6, ramfs never does)."""
    probe = os.path.join(folder, ".test-probe")
    try:
        os.close(os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600))
        return True
    except OSError as e:
        assert e.errno == errno.EINVAL, e
        return False
    finally:
        if os.path.exists(probe):
            os.unlink(probe)


@contextmanager
def expect_direct_fallback_warning(folder: str, expected: bool):
    """A UserWarning naming ``folder`` when the tier falls back to buffered I/O, none otherwise."""
    if expected:
        with pytest.warns(UserWarning, match=re.escape(folder)):
            yield
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            yield

# -- NVMe: extents ------------------------------------------------------------------------------

SMALL_IO = IoSettings(block_size=2 * BLOCK, queue_depth=4)
"""Small requests, so that every transfer of more than 8 KiB is split into several."""


def make_tier(root, budget: int | None = None, rank: int = 0, io: IoSettings = SMALL_IO):
    return NvmeTier(str(root), budget=budget, rank=rank, io=io)


def extents_in(run_dir: str) -> list[str]:
    """The names in a run folder but its owner's lock file (which the run holds open)."""
    return [name for name in os.listdir(run_dir) if name != LOCK_NAME]


def open_files_under(folder: str) -> dict[str, int]:
    """Every file under ``folder`` this process holds open (path -> descriptor), read from /proc,
    so independent of what the tier says it opened, but a run folder's lock file. A path open
    twice fails the check."""
    out: dict[str, int] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except FileNotFoundError:  # the descriptor of the listing itself, closed since
            continue
        if target.startswith(folder + os.sep) and os.path.basename(target) != LOCK_NAME:
            assert target not in out, f"{target} is open twice"
            out[target] = int(name)
    return out


@pytest.fixture
def nvme_tier(tmp_path):
    tier = make_tier(tmp_path)
    yield tier
    tier.close()


def test_nvme_run_folder_and_extents(tmp_path):
    tier = make_tier(tmp_path, rank=3)
    shards = {}
    try:
        assert os.path.dirname(tier.run_dir) == str(tmp_path)
        assert "rank3" in os.path.basename(tier.run_dir)
        st = os.stat(tier.run_dir)
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
        assert tier.direct is True  # ext4
        assert extents_in(tier.run_dir) == []  # the O_DIRECT probe is gone
        assert open_files_under(tier.run_dir) == {}

        sizes = {"a": 1, "b": 4096, "c": 5000, "d": 70_000, "e": 4000}  # a, b, e: one 4 KiB size
        shards = {what: tier.create(what, n) for what, n in sizes.items()}
        extent_sizes = Counter(align_up(n, BLOCK) for n in sizes.values())
        names = sorted(extents_in(tier.run_dir))
        assert len(names) == len(sizes) + SPARE_EXTENTS * len(extent_sizes)
        assert all(EXTENT_NAME.fullmatch(n) for n in names), names
        for what, n in sizes.items():
            shard = shards[what]
            assert shard.nbytes == shard.extent.nbytes == align_up(n, BLOCK)
            assert shard.path == shard.extent.path
            assert os.path.dirname(shard.path) == tier.run_dir
            assert os.path.samefile(f"/proc/self/fd/{shard.extent.fd}", shard.path)
        assert len({s.path for s in shards.values()}) == len(shards)

        # Every extent, the shards' and the spares', is a preallocated private file, open once,
        # with O_DIRECT; each extent size has its shards' extents and SPARE_EXTENTS spares.
        paths = {os.path.join(tier.run_dir, n) for n in names}
        opened = open_files_under(tier.run_dir)
        assert set(opened) == paths
        found = Counter()
        for path in paths:
            st = os.stat(path)
            assert stat.S_IMODE(st.st_mode) == 0o600
            assert st.st_blocks * 512 >= st.st_size  # preallocated, not sparse
            assert fd_flags(opened[path]) & os.O_DIRECT, f"{path} was not opened with O_DIRECT"
            found[st.st_size] += 1
        assert found == {size: count + SPARE_EXTENTS for size, count in extent_sizes.items()}
        on_disk = sum(os.path.getsize(p) for p in paths)
        assert tier.usage.current == on_disk == nvme_bytes(list(sizes.values()))

        # A second tier in the same root (another rank) gets a folder of its own.
        other = make_tier(tmp_path, rank=4)
        assert other.run_dir != tier.run_dir and "rank4" in other.run_dir
        other.close()
        assert not os.path.exists(other.run_dir) and os.path.isdir(tier.run_dir)
    finally:
        tier.close()
    assert not os.path.exists(tier.run_dir)
    assert os.listdir(tmp_path) == []
    assert tier.usage.current == 0
    assert all(s.extent.fd == -1 for s in shards.values())
    assert open_files_under(tier.run_dir) == {}  # the spares are closed too
    tier.close()  # idempotent
    assert os.listdir(tmp_path) == [] and tier.usage.current == 0


def round_trip(tier: NvmeTier, sizes: list[int]) -> None:
    keys = {}
    for i, n in enumerate(sizes):
        keys[("src", i)] = n
        keys[("dst", i)] = n
    _, blocks = dram_blocks(keys)
    gen = torch.Generator().manual_seed(1234)
    step = tier.io.settings.block_size
    for i, n in enumerate(sizes):
        shard = tier.create(f"round trip {i}", n)
        src, dst = blocks[("src", i)], blocks[("dst", i)]
        assert src.numel() == shard.nbytes == align_up(n, BLOCK)
        dst.fill_(0xAB)
        shard.read_into(dst)  # a fresh extent reads as zeros (the optimizer moments rely on it)
        assert not dst.any(), f"fresh extent of {n} bytes is not zeros"
        for version in range(2):  # the second write replaces the first
            src.copy_(torch.randint(0, 256, (src.numel(),), dtype=torch.uint8, generator=gen))
            before = shard.path
            requests = []
            with inject_faults(lambda *request: requests.append(request)):  # observes only
                shard.write_from(src)
            # The new version went to what was a spare, in requests of at most block_size that
            # cover the extent exactly once.
            assert shard.path != before and os.path.dirname(shard.path) == tier.run_dir
            assert sorted(requests) == [
                ("write", shard.path, offset, min(step, shard.nbytes - offset))
                for offset in range(0, shard.nbytes, step)]
            dst.fill_(0)
            shard.read_into(dst)
            assert torch.equal(src, dst), f"round trip {version} of {n} bytes differs"
            with open(shard.path, "rb") as raw:  # and the bytes really are in the file
                assert raw.read() == bytes(src.tolist())


IO_SIZES = [1, 4096, 5000, 3 * 4096 + 7, 8192, 40_000]


@pytest.mark.parametrize("block_size", [2 * BLOCK, 3 * BLOCK])
def test_nvme_round_trip_in_several_requests(tmp_path, block_size):
    # 40 KiB in 8 KiB requests, or in 12 KiB requests and a last one of 4 KiB.
    tier = make_tier(tmp_path, io=IoSettings(block_size=block_size, queue_depth=4))
    try:
        round_trip(tier, IO_SIZES)
    finally:
        tier.close()
    assert os.listdir(tmp_path) == []


def test_nvme_close_removes_everything_and_is_idempotent(tmp_path):
    tier = make_tier(tmp_path)
    shard = tier.create("x", 10_000)
    _, blocks = dram_blocks({"b": 10_000})
    shard.write_from(blocks["b"])
    assert len(open_files_under(tier.run_dir)) == 1 + SPARE_EXTENTS
    tier.close()
    assert os.listdir(tmp_path) == [] and tier.usage.current == 0 and shard.extent.fd == -1
    assert open_files_under(tier.run_dir) == {}
    tier.close()
    assert os.listdir(tmp_path) == [] and tier.usage.current == 0


def test_check_nvme_path_errors(tmp_path):
    missing = str(tmp_path / "nowhere")
    with pytest.raises(tiered.NvmeError) as info:
        check_nvme_path(missing)
    assert missing in str(info.value) and info.value.path == missing
    assert info.value.errno == errno.ENOENT
    with pytest.raises(tiered.NvmeError, match=re.escape(missing)):
        make_tier(missing)

    a_file = tmp_path / "a_file"
    a_file.write_bytes(b"x")
    with pytest.raises(tiered.NvmeError) as info:
        check_nvme_path(str(a_file))
    assert str(a_file) in str(info.value) and info.value.path == str(a_file)
    assert info.value.errno == errno.ENOTDIR
    with pytest.raises(tiered.NvmeError, match=re.escape(str(a_file))):
        make_tier(a_file)
    assert sorted(os.listdir(tmp_path)) == ["a_file"]

    check_nvme_path(str(tmp_path))  # a writable folder passes
    assert isinstance(info.value, tiered.TieredError) and isinstance(info.value, OSError)


def test_nvme_budget(tmp_path):
    # A shard of a new extent size takes its extent and SPARE_EXTENTS spares of that size.
    assert nvme_bytes([5000]) == 4 * 2 * BLOCK
    budget = 14 * BLOCK
    tier = make_tier(tmp_path, budget=budget)
    try:
        tier.create("first", 5000)  # 4 x 8 KiB; 24 KiB left
        held = sorted(extents_in(tier.run_dir))
        assert len(held) == 1 + SPARE_EXTENTS and tier.usage.current == 8 * BLOCK

        # 28 KiB: not even its first spare fits.
        with pytest.raises(tiered.BudgetError) as info:
            tier.create("second", 7 * BLOCK)
        assert info.value.shortfalls == {"nvme": (15 * BLOCK, budget)}
        assert str(info.value).startswith("nvme") and "second" in str(info.value)
        assert sorted(extents_in(tier.run_dir)) == held and tier.usage.current == 8 * BLOCK

        # 12 KiB: two spares fit, the third does not; what was made for it is not kept.
        with pytest.raises(tiered.BudgetError) as info:
            tier.create("third", 3 * BLOCK)
        assert info.value.shortfalls == {"nvme": (17 * BLOCK, budget)}
        assert "third" in str(info.value)
        assert sorted(extents_in(tier.run_dir)) == held and tier.usage.current == 8 * BLOCK

        tier.create("fourth", 5000)  # a size with spares already: its own extent only
        assert tier.usage.current == 10 * BLOCK
        tier.create("fifth", 1)  # a new size, 4 x 4 KiB: exactly what is left
        assert tier.usage.current == budget == nvme_bytes([5000, 5000, 1])
        assert len(extents_in(tier.run_dir)) == 2 + 2 * SPARE_EXTENTS + 1
    finally:
        tier.close()
    assert os.listdir(tmp_path) == []


def test_nvme_default_budget_is_the_free_space(tmp_path):
    before = free_bytes(str(tmp_path))
    tier = make_tier(tmp_path)
    try:
        # Another process may write meanwhile; the budget is a statvfs reading, within 1%.
        assert abs(tier.usage.budget - before) <= before // 100
    finally:
        tier.close()


def test_nvme_existing_file_is_never_overwritten(nvme_tier):
    nvme_tier.create("first", 100)
    names = sorted(extents_in(nvme_tier.run_dir))
    assert names == [f"extent-{i:05d}.bin" for i in range(1 + SPARE_EXTENTS)]
    # Something else put a file where the next extent goes: creating it fails (O_EXCL).
    squatter = os.path.join(nvme_tier.run_dir, f"extent-{len(names):05d}.bin")
    with open(squatter, "wb") as f:
        f.write(b"not ours")
    with pytest.raises(tiered.NvmeError) as info:
        nvme_tier.create("second", 100)
    assert info.value.path == squatter
    assert squatter in str(info.value) and info.value.errno == errno.EEXIST
    with open(squatter, "rb") as f:
        assert f.read() == b"not ours"
    assert sorted(extents_in(nvme_tier.run_dir)) == sorted(names + [os.path.basename(squatter)])
    assert nvme_tier.usage.current == nvme_bytes([100])


def test_nvme_out_of_file_descriptors_is_an_nvme_error(nvme_tier):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
    created = []
    error = None
    # Room for at least the first shard and its spares (4 descriptors), then it runs out.
    resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 1 + 1 + SPARE_EXTENTS, hard))
    try:
        for i in range(highest + 8):  # fds are numbered below the limit: this must run out
            try:
                created.append(nvme_tier.create(f"shard {i}", 100))
            except tiered.NvmeError as e:
                error = e
                break
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert error is not None, "never ran out of file descriptors"
    assert created, "not even the first shard got its descriptors"
    assert error.errno == errno.EMFILE and "ulimit" in str(error)
    names = sorted(extents_in(nvme_tier.run_dir))
    assert len(names) == len(created) + SPARE_EXTENTS
    assert error.path == os.path.join(nvme_tier.run_dir, f"extent-{len(names):05d}.bin")
    assert error.path in str(error)
    assert set(open_files_under(nvme_tier.run_dir)) == {
        os.path.join(nvme_tier.run_dir, n) for n in names}
    assert nvme_tier.usage.current == nvme_bytes([100] * len(created))


def point_at(fd: int, path, flags: int) -> None:
    """Make descriptor number ``fd`` refer to ``path`` opened with ``flags``: the extent's own
    file is closed, and the tier still owns the number (and closes it)."""
    other = os.open(path, flags)
    try:
        os.dup2(other, fd)
    finally:
        os.close(other)


def test_nvme_io_errors_name_file_offset_and_size(tmp_path):
    # Real errors from the kernel, no fault injection (tests/tiers/test_aio.py injects ENOSPC and EIO).
    tier = make_tier(tmp_path, io=IoSettings(block_size=BLOCK, queue_depth=4))
    try:
        shard = tier.create("broken", 4 * BLOCK)
        spares = {p: fd for p, fd in open_files_under(tier.run_dir).items() if p != shard.path}
        assert len(spares) == SPARE_EXTENTS
        _, blocks = dram_blocks({"b": 4 * BLOCK})
        b = blocks["b"]
        scratch = tmp_path / "scratch"
        scratch.write_bytes(b"\1" * (2 * BLOCK))
        extent = shard.extent

        # The shard's descriptor reaches a file open for writing only: every read request fails
        # (EBADF), and the error is the first one's.
        point_at(shard.extent.fd, scratch, os.O_WRONLY)
        with pytest.raises(tiered.NvmeError) as info:
            shard.read_into(b)
        e = info.value
        assert (e.path, e.offset, e.size, e.errno) == (shard.path, 0, BLOCK, errno.EBADF)
        assert "read" in str(e) and shard.path in str(e)
        assert "offset 0" in str(e) and f"size {BLOCK}" in str(e)

        # The same file open for reading: reads stop at its end, the error names that offset,
        # and what came before it is read.
        point_at(shard.extent.fd, scratch, os.O_RDONLY)
        b.fill_(0)
        with pytest.raises(tiered.NvmeError) as info:
            shard.read_into(b)
        e = info.value
        assert (e.path, e.offset, e.size, e.errno) == (shard.path, 2 * BLOCK, BLOCK, errno.EIO)
        assert f"offset {2 * BLOCK}" in str(e) and f"size {BLOCK}" in str(e)
        assert shard.path in str(e)
        assert bool((b[:2 * BLOCK] == 1).all()) and not b[2 * BLOCK:].any()

        # A write goes to a spare: with every spare reaching a read-only file, it fails at its
        # first request (EBADF), naming the spare, and the shard stays on its extent.
        for fd in spares.values():
            point_at(fd, scratch, os.O_RDONLY)
        with pytest.raises(tiered.NvmeError) as info:
            shard.write_from(b)
        e = info.value
        assert e.path in spares
        assert (e.offset, e.size, e.errno) == (0, BLOCK, errno.EBADF)
        assert "write" in str(e) and e.path in str(e) and f"size {BLOCK}" in str(e)
        assert shard.extent is extent and shard.path == extent.path
        assert scratch.read_bytes() == b"\1" * (2 * BLOCK)
    finally:
        tier.close()
    assert os.listdir(tmp_path) == ["scratch"]


# -- NVMe: file systems without O_DIRECT, full disks --------------------------------------------

def test_nvme_falls_back_to_buffered_io_without_o_direct(tmp_path):
    with mounted(tmp_path, "ramfs") as root:  # ramfs has no O_DIRECT on any kernel
        assert not accepts_o_direct(root)
        with expect_direct_fallback_warning(root, expected=True):
            tier = make_tier(root, budget=1 << 20)
        try:
            assert tier.direct is False
            assert extents_in(tier.run_dir) == []  # the failed probe left no file
            round_trip(tier, IO_SIZES)
            tier.create("flags", 1)
            opened = open_files_under(tier.run_dir)
            assert len(opened) == len(extents_in(tier.run_dir)) > 0
            for path, fd in opened.items():
                assert not fd_flags(fd) & os.O_DIRECT, path
        finally:
            tier.close()
        assert os.listdir(root) == []


def test_nvme_full_disk(tmp_path):
    with mounted(tmp_path, "tmpfs", "size=1M") as root:
        capacity = free_bytes(root)
        assert capacity == 1 << 20
        direct = accepts_o_direct(root)
        with expect_direct_fallback_warning(root, expected=not direct):
            tier = make_tier(root, budget=64 << 20)
        try:
            capacity -= os.lstat(os.path.join(tier.run_dir, LOCK_NAME)).st_blocks * 512
            assert tier.direct is direct
            small = 64 << 10
            tier.create("small", small)  # with its spares: 256 KiB
            held = sorted(extents_in(tier.run_dir))
            assert len(held) == 1 + SPARE_EXTENTS
            assert free_bytes(root) == capacity - nvme_bytes([small])

            # 2 MiB: not even the first spare fits. 200 KiB: its spares fit, its own extent does
            # not. Either way nothing made for it is left, on disk or counted.
            medium = 200 << 10
            assert nvme_bytes([small]) + SPARE_EXTENTS * medium <= capacity
            assert nvme_bytes([small, medium]) > capacity
            for what, nbytes in (("big", 2 << 20), ("medium", medium)):
                with pytest.raises(tiered.NvmeError) as info:
                    tier.create(what, nbytes)
                e = info.value
                assert (e.size, e.errno) == (nbytes, errno.ENOSPC), what
                assert os.path.dirname(e.path) == tier.run_dir
                assert EXTENT_NAME.fullmatch(os.path.basename(e.path))
                assert e.path in str(e) and format_size(nbytes) in str(e)
                assert sorted(extents_in(tier.run_dir)) == held, what
                assert tier.usage.current == nvme_bytes([small]), what
                assert free_bytes(root) == capacity - nvme_bytes([small]), what

            tier.create("small again", small)  # what fits still works
            assert tier.usage.current == nvme_bytes([small, small])
        finally:
            tier.close()
        assert os.listdir(root) == []
        assert free_bytes(root) == 1 << 20


def test_nvme_folder_removed_when_no_file_can_be_created(tmp_path):
    # Two inodes: the run folder takes the last one, so the O_DIRECT probe cannot be created.
    with mounted(tmp_path, "tmpfs", "size=1M,nr_inodes=2") as root:
        with pytest.raises(tiered.NvmeError) as info:
            make_tier(root)
        assert root in str(info.value) and info.value.errno == errno.ENOSPC
        assert os.listdir(root) == []
