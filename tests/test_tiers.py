"""The tier layer on real memory, real files and real mounts: HBM (the CPU plays it), DRAM slabs,
NVMe files with O_DIRECT, and the tier manager as a real engine drives it."""
from __future__ import annotations

import errno
import os
import re
import resource
import stat
import subprocess
import warnings
from contextlib import contextmanager

import pytest
import torch
from torch import nn

import tiered
from tiered.sizes import align_up, format_size
from tiered.tiers import DramTier, HbmTier, NvmeTier, PinnedSlabSource
from tiered.tiers import dram as dram_module
from tiered.tiers import nvme as nvme_module
from tiered.tiers.nvme import check_nvme_path, free_bytes

from gpt import GPT

BLOCK = 4096
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NVME_YAML = os.path.join(REPO, "configs", "nvme.yaml")
NVME_KINDS = ("param", "master", "exp_avg", "exp_avg_sq")


# -- helpers ------------------------------------------------------------------------------------

def dram_blocks(sizes: dict) -> tuple[DramTier, dict]:
    tier = DramTier(budget=None, source=PinnedSlabSource(pin=False))
    return tier, tier.reserve(sizes)


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
def mounted(tmp_path, fstype: str, options: str | None = None):
    where = tmp_path / fstype
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


# -- HBM ----------------------------------------------------------------------------------------

def test_hbm_counts_frees_tracks_peak_and_refuses_over_budget():
    tier = HbmTier(torch.device("cpu"), budget=10_000)
    a = tier.empty(1000, torch.float32, "a")
    b = tier.empty(1000, torch.bfloat16, "b")
    assert a.numel() == 1000 and a.dtype is torch.float32 and a.device.type == "cpu"
    assert (tier.usage.current, tier.usage.peak) == (6000, 6000)
    tier.free(a)
    assert (tier.usage.current, tier.usage.peak) == (2000, 6000)

    with pytest.raises(tiered.BudgetError) as info:
        tier.empty(3000, torch.float32, "too big")
    assert info.value.shortfalls == {"hbm": (14_000, 10_000)}
    message = str(info.value)
    assert "hbm" in message and "too big" in message and format_size(10_000) in message
    assert (tier.usage.current, tier.usage.peak) == (2000, 6000)

    c = tier.empty(2000, torch.float32, "exactly the rest")  # the budget itself is allowed
    assert (tier.usage.current, tier.usage.peak) == (10_000, 10_000)
    tier.free(c)
    tier.free(b)
    assert (tier.usage.current, tier.usage.peak) == (0, 10_000)


def test_hbm_default_budget_is_the_device_capacity():
    import psutil

    assert HbmTier(torch.device("cpu"), None).usage.budget == psutil.virtual_memory().total


def test_hbm_failed_allocation_holds_nothing():
    # Within the budget, but no allocator can give 2**58 bytes: the refusal must not stay counted.
    tier = HbmTier(torch.device("cpu"), budget=1 << 62)
    with pytest.raises(RuntimeError):
        tier.empty(1 << 58, torch.uint8, "impossible")
    assert tier.usage.current == 0


# -- DRAM ---------------------------------------------------------------------------------------

def check_blocks(tier: DramTier, requests: dict, blocks: dict) -> None:
    assert set(blocks) == set(requests)
    ranges = []
    for key, nbytes in requests.items():
        block = blocks[key]
        assert block.dtype is torch.uint8 and block.device.type == "cpu" and block.dim() == 1
        assert block.is_contiguous()
        assert block.data_ptr() % BLOCK == 0, (key, block.data_ptr())
        assert block.numel() == align_up(max(nbytes, 1), BLOCK), (key, nbytes, block.numel())
        ranges.append((block.data_ptr(), block.data_ptr() + block.numel(), key))
    ranges.sort()
    for (_, end, k1), (start, _, k2) in zip(ranges, ranges[1:]):
        assert end <= start, f"blocks {k1} and {k2} overlap"
    # Each block is distinct memory: fill each with its own value, then all must still hold it.
    for i, key in enumerate(requests):
        blocks[key].fill_(i + 1)
    for i, key in enumerate(requests):
        assert bool((blocks[key] == i + 1).all()), f"block {key} was overwritten"


def test_dram_blocks_aligned_disjoint_and_counted_exactly():
    requests = {"one": 1, "page": 4096, "odd": 5000, "zero": 0, ("unit", 3): 3 * 4096 + 7}
    tier, blocks = dram_blocks(requests)
    check_blocks(tier, requests, blocks)
    expected = sum(align_up(max(n, 1), BLOCK) for n in requests.values())
    assert tier.usage.current == tier.usage.peak == expected
    assert sum(s.numel() for s in tier._slabs) == expected  # what is allocated is what is counted
    tier.close()
    assert tier.usage.current == 0 and tier._slabs == []


def test_dram_packs_many_blocks_into_several_slabs(monkeypatch):
    slab = 64 << 10
    monkeypatch.setattr(dram_module, "SLAB_BYTES", slab)
    requests = {f"b{i}": (i * 3001) % 20000 + 1 for i in range(40)}
    requests["huge"] = 3 * slab + 123  # larger than a slab: a slab of its own
    requests["exact"] = slab
    tier, blocks = dram_blocks(requests)
    check_blocks(tier, requests, blocks)
    expected = sum(align_up(max(n, 1), BLOCK) for n in requests.values())
    assert tier.usage.current == expected
    huge = align_up(requests["huge"], BLOCK)
    assert len(tier._slabs) >= 1 + -(-(expected - huge) // slab) >= 3
    assert sum(s.numel() for s in tier._slabs) == expected
    for s in tier._slabs:
        assert s.data_ptr() % BLOCK == 0
        assert s.numel() <= max(slab, align_up(requests["huge"], BLOCK))
    # A second reservation adds to the first, disjoint from it.
    more = {"late": 10_000}
    blocks2 = tier.reserve(more)
    assert tier.usage.current == expected + align_up(10_000, BLOCK)
    everything = {**requests, **more}
    check_blocks(tier, everything, {**blocks, **blocks2})


def test_dram_over_budget_names_needed_and_available_and_holds_nothing():
    tier = DramTier(budget=3 * BLOCK, source=PinnedSlabSource(pin=False))
    tier.reserve({"a": BLOCK, "b": 100})
    slabs = list(tier._slabs)
    with pytest.raises(tiered.BudgetError) as info:
        tier.reserve({"c": BLOCK, "d": 1})
    assert info.value.shortfalls == {"dram": (4 * BLOCK, 3 * BLOCK)}
    message = str(info.value)
    assert message.startswith("dram")
    assert format_size(2 * BLOCK) in message and format_size(3 * BLOCK) in message
    assert tier.usage.current == 2 * BLOCK and tier._slabs == slabs
    tier.reserve({"e": 1})  # exactly up to the budget still works
    assert tier.usage.current == 3 * BLOCK


def test_dram_reservation_is_all_or_nothing_when_a_slab_cannot_be_had(monkeypatch):
    monkeypatch.setattr(dram_module, "SLAB_BYTES", 2 * BLOCK)

    class FailingSecondSlab(PinnedSlabSource):
        """The second slab fails, as pinning does when memory runs out."""

        def __init__(self):
            super().__init__(pin=False)
            self.made, self.released = [], []

        def __call__(self, nbytes):
            if len(self.made) == 1:
                raise RuntimeError("cannot pin memory")
            self.made.append(super().__call__(nbytes))
            return self.made[-1]

        def release(self, slab):
            self.released.append(slab)

    source = FailingSecondSlab()
    tier = DramTier(budget=None, source=source)
    with pytest.raises(RuntimeError, match="cannot pin"):
        tier.reserve({"a": 2 * BLOCK, "b": 2 * BLOCK, "c": BLOCK})
    assert len(source.made) == 1 and source.released == source.made, "first slab kept pinned"
    assert tier.usage.current == 0 and tier._slabs == []


# -- NVMe: files --------------------------------------------------------------------------------

@pytest.fixture
def nvme_tier(tmp_path):
    tier = NvmeTier(str(tmp_path), budget=None, rank=0)
    yield tier
    tier.close()


def test_nvme_run_folder_and_files(tmp_path):
    tier = NvmeTier(str(tmp_path), budget=None, rank=3)
    try:
        assert os.path.dirname(tier.run_dir) == str(tmp_path)
        assert "rank3" in os.path.basename(tier.run_dir)
        st = os.stat(tier.run_dir)
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
        assert tier.direct is True  # ext4
        assert os.listdir(tier.run_dir) == []  # the O_DIRECT probe is gone

        sizes = {"a.bin": 1, "b.bin": 4096, "c.bin": 5000, "d.bin": 70_000}
        files = {name: tier.create(name, n) for name, n in sizes.items()}
        assert sorted(os.listdir(tier.run_dir)) == sorted(sizes)
        for name, n in sizes.items():
            f = files[name]
            assert f.path == os.path.join(tier.run_dir, name)
            st = os.stat(f.path)
            assert stat.S_IMODE(st.st_mode) == 0o600
            assert st.st_size == f.nbytes == align_up(n, BLOCK)
            assert st.st_blocks * 512 >= st.st_size  # preallocated, not sparse
            assert fd_flags(f._fd) & os.O_DIRECT, f"{name} was not opened with O_DIRECT"
        assert tier.usage.current == sum(align_up(n, BLOCK) for n in sizes.values())

        # A second tier in the same root (another rank) gets a folder of its own.
        other = NvmeTier(str(tmp_path), budget=None, rank=4)
        assert other.run_dir != tier.run_dir and "rank4" in other.run_dir
        other.close()
        assert not os.path.exists(other.run_dir) and os.path.isdir(tier.run_dir)
    finally:
        tier.close()
    assert not os.path.exists(tier.run_dir)
    assert os.listdir(tmp_path) == []
    assert tier.usage.current == 0
    assert all(f._fd == -1 for f in files.values())
    tier.close()  # idempotent
    assert os.listdir(tmp_path) == [] and tier.usage.current == 0


def round_trip(tier: NvmeTier, sizes: list[int]) -> None:
    keys = {}
    for i, n in enumerate(sizes):
        keys[("src", i)] = n
        keys[("dst", i)] = n
    _, blocks = dram_blocks(keys)
    gen = torch.Generator().manual_seed(1234)
    for i, n in enumerate(sizes):
        f = tier.create(f"rt{i}.bin", n)
        src, dst = blocks[("src", i)], blocks[("dst", i)]
        assert src.numel() == f.nbytes == align_up(n, BLOCK)
        dst.fill_(0xAB)
        f.read_into(dst)  # a fresh file reads back as zeros (the optimizer moments rely on it)
        assert not dst.any(), f"fresh file of {n} bytes is not zeros"
        src.copy_(torch.randint(0, 256, (src.numel(),), dtype=torch.uint8, generator=gen))
        f.write_from(src)
        dst.fill_(0)
        f.read_into(dst)
        assert torch.equal(src, dst), f"round trip of {n} bytes differs"
        with open(f.path, "rb") as raw:  # and the bytes really are in the file
            assert raw.read() == bytes(src.tolist())
        # Overwriting replaces the contents.
        src.copy_(torch.flip(src, [0]))
        f.write_from(src)
        f.read_into(dst)
        assert torch.equal(src, dst)


IO_SIZES = [1, 4096, 5000, 3 * 4096 + 7, 8192, 40_000]


def test_nvme_round_trip_over_several_chunks(nvme_tier, monkeypatch):
    monkeypatch.setattr(nvme_module, "IO_CHUNK_BYTES", 8192)
    round_trip(nvme_tier, IO_SIZES)


def test_nvme_close_removes_everything_and_is_idempotent(tmp_path):
    tier = NvmeTier(str(tmp_path), budget=None, rank=0)
    f = tier.create("x.bin", 10_000)
    _, blocks = dram_blocks({"b": 10_000})
    f.write_from(blocks["b"])
    tier.close()
    assert os.listdir(tmp_path) == [] and tier.usage.current == 0 and f._fd == -1
    tier.close()
    assert os.listdir(tmp_path) == [] and tier.usage.current == 0


def test_check_nvme_path_errors(tmp_path):
    missing = str(tmp_path / "nowhere")
    with pytest.raises(tiered.NvmeError) as info:
        check_nvme_path(missing)
    assert missing in str(info.value) and info.value.path == missing
    assert info.value.errno == errno.ENOENT
    with pytest.raises(tiered.NvmeError, match=re.escape(missing)):
        NvmeTier(missing, budget=None, rank=0)

    a_file = tmp_path / "a_file"
    a_file.write_bytes(b"x")
    with pytest.raises(tiered.NvmeError) as info:
        check_nvme_path(str(a_file))
    assert str(a_file) in str(info.value) and info.value.path == str(a_file)
    assert info.value.errno == errno.ENOTDIR
    with pytest.raises(tiered.NvmeError, match=re.escape(str(a_file))):
        NvmeTier(str(a_file), budget=None, rank=0)
    assert sorted(os.listdir(tmp_path)) == ["a_file"]

    check_nvme_path(str(tmp_path))  # a writable folder passes
    assert isinstance(info.value, tiered.TieredError) and isinstance(info.value, OSError)


def test_nvme_budget(tmp_path):
    tier = NvmeTier(str(tmp_path), budget=3 * BLOCK, rank=0)
    try:
        tier.create("first.bin", 5000)  # 8 KiB
        with pytest.raises(tiered.BudgetError) as info:
            tier.create("second.bin", 5000)
        assert info.value.shortfalls == {"nvme": (4 * BLOCK, 3 * BLOCK)}
        assert str(info.value).startswith("nvme") and "second.bin" in str(info.value)
        assert os.listdir(tier.run_dir) == ["first.bin"]
        assert tier.usage.current == 2 * BLOCK
        tier.create("third.bin", 1)  # what is left still fits
        assert tier.usage.current == 3 * BLOCK
    finally:
        tier.close()
    assert os.listdir(tmp_path) == []


def test_nvme_default_budget_is_the_free_space(tmp_path):
    before = free_bytes(str(tmp_path))
    tier = NvmeTier(str(tmp_path), budget=None, rank=0)
    try:
        # Another process may write meanwhile; the budget is a statvfs reading, within 1%.
        assert abs(tier.usage.budget - before) <= before // 100
    finally:
        tier.close()


def test_nvme_existing_name_is_an_nvme_error(nvme_tier):
    nvme_tier.create("same.bin", 100)
    with pytest.raises(tiered.NvmeError) as info:
        nvme_tier.create("same.bin", 100)
    assert info.value.path == os.path.join(nvme_tier.run_dir, "same.bin")
    assert info.value.path in str(info.value) and info.value.errno == errno.EEXIST
    assert nvme_tier.usage.current == BLOCK


def test_nvme_out_of_file_descriptors_is_an_nvme_error(nvme_tier):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
    created = []
    error = None
    resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 4, hard))
    try:
        for i in range(highest + 8):  # fds are numbered below the limit: this must run out
            try:
                created.append(nvme_tier.create(f"f{i}.bin", 100))
            except tiered.NvmeError as e:
                error = e
                break
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert error is not None, "never ran out of file descriptors"
    assert error.errno == errno.EMFILE and "ulimit" in str(error)
    assert error.path == os.path.join(nvme_tier.run_dir, f"f{len(created)}.bin")
    assert error.path in str(error)
    assert sorted(os.listdir(nvme_tier.run_dir)) == sorted(
        os.path.basename(f.path) for f in created)
    assert nvme_tier.usage.current == len(created) * BLOCK


def test_nvme_io_errors_name_file_offset_and_size(nvme_tier, tmp_path, monkeypatch):
    monkeypatch.setattr(nvme_module, "IO_CHUNK_BYTES", BLOCK)
    f = nvme_tier.create("broken.bin", 4 * BLOCK)
    _, blocks = dram_blocks({"b": 4 * BLOCK})
    own_fd = f._fd

    # The descriptor is closed behind the file's back: every request fails with EBADF.
    os.close(own_fd)
    try:
        for transfer, verb in ((f.read_into, "read"), (f.write_from, "write")):
            with pytest.raises(tiered.NvmeError) as info:
                transfer(blocks["b"])
            e = info.value
            assert (e.path, e.offset, e.size, e.errno) == (f.path, 0, BLOCK, errno.EBADF)
            assert verb in str(e) and f.path in str(e)
            assert "offset 0" in str(e) and f"size {BLOCK}" in str(e)
    finally:
        f._fd = -1  # already closed: keep close() from closing a reused number

    # The descriptor reaches a file shorter than expected: the read stops at its end, and the
    # error names that offset. Writes through a read-only descriptor fail at the first request.
    short = tmp_path / "short"
    short.write_bytes(b"\1" * (2 * BLOCK))
    f._fd = os.open(short, os.O_RDONLY)
    try:
        with pytest.raises(tiered.NvmeError) as info:
            f.read_into(blocks["b"])
        e = info.value
        assert (e.path, e.offset, e.size, e.errno) == (f.path, 2 * BLOCK, BLOCK, errno.EIO)
        assert f"offset {2 * BLOCK}" in str(e) and f"size {BLOCK}" in str(e)
        assert f.path in str(e)
        assert bool((blocks["b"][:2 * BLOCK] == 1).all())
        with pytest.raises(tiered.NvmeError) as info:
            f.write_from(blocks["b"])
        assert (info.value.offset, info.value.size, info.value.errno) == (0, BLOCK, errno.EBADF)
    finally:
        os.close(f._fd)
        f._fd = -1


# -- NVMe: file systems without O_DIRECT, full disks --------------------------------------------

def test_nvme_falls_back_to_buffered_io_without_o_direct(tmp_path, monkeypatch):
    monkeypatch.setattr(nvme_module, "IO_CHUNK_BYTES", 8192)
    with mounted(tmp_path, "ramfs") as root:  # ramfs has no O_DIRECT on any kernel
        assert not accepts_o_direct(root)
        with expect_direct_fallback_warning(root, expected=True):
            tier = NvmeTier(root, budget=1 << 20, rank=0)
        try:
            assert tier.direct is False
            assert os.listdir(tier.run_dir) == []  # the failed probe left no file
            round_trip(tier, IO_SIZES)
            f = tier.create("flags.bin", 1)
            assert not fd_flags(f._fd) & os.O_DIRECT
        finally:
            tier.close()
        assert os.listdir(root) == []


def test_nvme_full_disk(tmp_path):
    with mounted(tmp_path, "tmpfs", "size=1M") as root:
        capacity = free_bytes(root)
        assert capacity == 1 << 20
        direct = accepts_o_direct(root)
        with expect_direct_fallback_warning(root, expected=not direct):
            tier = NvmeTier(root, budget=64 << 20, rank=0)
        try:
            assert tier.direct is direct
            tier.create("small.bin", 64 << 10)
            with pytest.raises(tiered.NvmeError) as info:
                tier.create("big.bin", 2 << 20)
            e = info.value
            big = os.path.join(tier.run_dir, "big.bin")
            assert (e.path, e.size, e.errno) == (big, 2 << 20, errno.ENOSPC)
            assert big in str(e) and format_size(2 << 20) in str(e)
            assert os.listdir(tier.run_dir) == ["small.bin"]  # the failed file is not left
            assert tier.usage.current == 64 << 10
        finally:
            tier.close()
        assert os.listdir(root) == []
        assert free_bytes(root) == capacity


def test_nvme_folder_removed_when_no_file_can_be_created(tmp_path):
    # Two inodes: the run folder takes the last one, so the O_DIRECT probe cannot be created.
    with mounted(tmp_path, "tmpfs", "size=1M,nr_inodes=2") as root:
        with pytest.raises(tiered.NvmeError) as info:
            NvmeTier(root, budget=None, rank=0)
        assert root in str(info.value) and info.value.errno == errno.ENOSPC
        assert os.listdir(root) == []


# -- the tier manager through a real engine ------------------------------------------------------

def init_engine(model, root: str, **overrides):
    overrides.setdefault("compute_dtype", "fp32")
    nvme = {"path": root, **overrides.pop("nvme", {})}
    return tiered.initialize(model, NVME_YAML, nvme=nvme, device="cpu", **overrides)


def expected_nvme_files(engine, param_itemsize: int) -> dict[str, int]:
    files = {}
    for i, flat in enumerate(engine.runtime.flats):
        assert flat.spec.index == i
        for kind in NVME_KINDS:
            itemsize = param_itemsize if kind == "param" else 4
            files[f"unit{i:05d}.{kind}.bin"] = align_up(flat.shard_numel * itemsize, BLOCK)
    return files


def only_run_dir(root) -> str:
    entries = os.listdir(root)
    assert len(entries) == 1 and "rank0" in entries[0], entries
    return os.path.join(root, entries[0])


@pytest.mark.parametrize("dtype,itemsize", [("fp32", 4), ("bf16", 2)])
def test_engine_places_states_in_files(tmp_path, dtype, itemsize):
    torch.manual_seed(0)
    engine, _ = init_engine(GPT(64, 32, 2, 2), str(tmp_path), compute_dtype=dtype)
    try:
        placement = engine.placement()
        assert set(placement) == {"blocks.0", "blocks.1", "<root>"}
        for unit, states in placement.items():
            assert states == {"param": "nvme", "grad": "dram", "master": "nvme",
                              "exp_avg": "nvme", "exp_avg_sq": "nvme"}, unit

        run_dir = only_run_dir(tmp_path)
        assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o700
        expected = expected_nvme_files(engine, itemsize)
        found = {name: os.path.getsize(os.path.join(run_dir, name))
                 for name in os.listdir(run_dir)}
        assert found == expected
        for name in found:
            assert stat.S_IMODE(os.stat(os.path.join(run_dir, name)).st_mode) == 0o600
        assert engine.memory_report()["nvme"]["current"] == sum(expected.values())

        # The files hold the model: the master file is this rank's fp32 shard, and the param
        # file its compute-dtype copy.
        flat = engine.runtime.flats[0]
        master = torch.frombuffer(bytearray(open(os.path.join(run_dir, "unit00000.master.bin"),
                                                 "rb").read()), dtype=torch.float32)
        param = torch.frombuffer(bytearray(open(os.path.join(run_dir, "unit00000.param.bin"),
                                                "rb").read()), dtype=flat.full.dtype)
        shard = master[:flat.shard_numel]
        assert shard.abs().sum() > 0
        assert torch.equal(param[:flat.shard_numel], shard.to(flat.full.dtype))
        moments = open(os.path.join(run_dir, "unit00000.exp_avg.bin"), "rb").read()
        assert moments == bytes(len(moments))
    finally:
        engine.close()
    assert os.listdir(tmp_path) == []
    engine.close()
    assert os.listdir(tmp_path) == []


class Square(nn.Module):
    """A block of exactly 64 * 64 weights, so shard bytes are whole 4 KiB blocks in bf16."""

    def __init__(self, dim: int, heads: int, *unused):
        super().__init__()
        self.fc = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        return x + self.fc(x)


def test_engine_bf16_param_files_are_half_the_size(tmp_path):
    sizes = {}
    for dtype in ("fp32", "bf16"):
        root = tmp_path / dtype
        root.mkdir()
        # Root unit: embedding + head (2 * 63 * 64) + final norm (128) = 8192 numbers.
        engine, _ = init_engine(GPT(63, 64, 2, 2, block=Square), str(root), compute_dtype=dtype)
        try:
            assert [f.shard_numel for f in engine.runtime.flats] == [4096, 4096, 8192]
            run_dir = only_run_dir(root)
            sizes[dtype] = {n: os.path.getsize(os.path.join(run_dir, n))
                            for n in os.listdir(run_dir)}
        finally:
            engine.close()
        assert os.listdir(root) == []
    assert sizes["fp32"].keys() == sizes["bf16"].keys() and len(sizes["fp32"]) == 12
    for name, size in sizes["fp32"].items():
        if ".param." in name:
            assert sizes["bf16"][name] * 2 == size, name
        else:
            assert sizes["bf16"][name] == size, name


def big_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(64, 64, 2, 2)  # about 1.6 MiB of NVMe files in fp32


def test_engine_full_disk_fails_cleanly(tmp_path):
    reference_root = tmp_path / "reference"
    reference_root.mkdir()
    engine, _ = init_engine(big_gpt(), str(reference_root))
    needed = engine.memory_report()["nvme"]["current"]
    assert needed == sum(expected_nvme_files(engine, 4).values())
    engine.close()
    assert needed > 1 << 20

    with mounted(tmp_path, "tmpfs", "size=1M") as root:
        free = free_bytes(root)
        # A budget above the free space: the plan fits it, the disk is what runs out.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the buffered-I/O fallback, on kernels before 6.6
            with pytest.raises(tiered.NvmeError) as info:
                init_engine(big_gpt(), root, nvme={"budget": "64MiB"})
        e = info.value
        assert e.path is not None and e.path.startswith(root + os.sep)
        assert e.path in str(e) and root in str(e)
        assert os.listdir(root) == []
        assert free_bytes(root) == free

        # No budget: it is the free space, and the plan check refuses before any file exists.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(tiered.BudgetError) as info:
                init_engine(big_gpt(), root)
        assert info.value.shortfalls == {"nvme": (needed, free)}
        message = str(info.value)
        assert "nvme" in message and str(needed) in message and str(free) in message
        assert os.listdir(root) == []
