"""The tier manager's NVMe placement as a real engine drives it: each state of each unit in
its extent at the planned offset and size (bf16 parameters half the bytes), and a full disk
refused cleanly at ``initialize``. The NVMe tier alone is test_tiers.py."""
from __future__ import annotations

import os
import stat
import warnings
from collections import Counter

import pytest
import torch
from torch import nn

import tiered
from tiered.core.liveness import LOCK_NAME
from tiered.core.sizes import align_up
from tiered.placement.plan import StateKind
from tiered.tiers import NvmeShard
from tiered.tiers.nvme import SPARE_EXTENTS, free_bytes, nvme_bytes

from gpt import GPT
from helpers import CONFIGS, mounted
from helpers_tiers import BLOCK, EXTENT_NAME

NVME_YAML = str(CONFIGS / "nvme.yaml")
NVME_KINDS = ("param", "master", "exp_avg", "exp_avg_sq")


# -- the tier manager through a real engine ------------------------------------------------------

def init_engine(model, root: str, **overrides):
    overrides.setdefault("compute_dtype", "fp32")
    nvme = {"path": root, **overrides.pop("nvme", {})}
    return tiered.initialize(model, NVME_YAML, nvme=nvme, device="cpu", **overrides)


def nvme_shards(engine) -> dict[tuple[int, str], NvmeShard]:
    """Each (unit, kind) NVMe shard state of the engine; nothing else of it is on NVMe."""
    shards = {(i, kind): engine.manager.shards[(i, StateKind(kind))].file
              for i in range(len(engine.runtime.flats)) for kind in NVME_KINDS}
    on_nvme = {key for key, shard in engine.manager.shards.items() if shard.file is not None}
    assert on_nvme == {(i, StateKind(kind)) for i, kind in shards}
    return shards


def expected_nvme_sizes(engine, param_itemsize: int) -> dict[tuple[int, str], int]:
    sizes = {}
    for i, flat in enumerate(engine.runtime.flats):
        assert flat.spec.index == i
        for kind in NVME_KINDS:
            itemsize = param_itemsize if kind == "param" else 4
            sizes[(i, kind)] = align_up(flat.shard_numel * itemsize, BLOCK)
    return sizes


def only_run_dir(root) -> str:
    entries = os.listdir(root)
    assert len(entries) == 1 and "rank0" in entries[0], entries
    return os.path.join(root, entries[0])


def check_run_folder(engine, run_dir: str, expected: dict[tuple[int, str], int]) -> None:
    """The run folder holds each shard state's extent, of its expected size, and
    SPARE_EXTENTS spares per extent size: nothing else (but its owner's lock file), all of it
    counted."""
    shards = nvme_shards(engine)
    assert shards.keys() == expected.keys()
    for key, size in expected.items():
        assert os.path.dirname(shards[key].path) == run_dir, key
        assert os.path.getsize(shards[key].path) == size, key
    names = set(os.listdir(run_dir))
    assert LOCK_NAME in names  # the run's own lock: its folder is removed if the run dies
    paths = {os.path.join(run_dir, name) for name in names - {LOCK_NAME}}
    in_use = {shard.path for shard in shards.values()}
    assert len(in_use) == len(shards) and in_use <= paths
    spares = Counter(os.path.getsize(p) for p in paths - in_use)
    assert spares == {size: SPARE_EXTENTS for size in set(expected.values())}
    for path in paths:
        assert EXTENT_NAME.fullmatch(os.path.basename(path)), path
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
    on_disk = sum(os.path.getsize(p) for p in paths)
    assert engine.memory_report()["nvme"]["current"] == on_disk
    assert on_disk == nvme_bytes(list(expected.values()))


def file_tensor(path: str, dtype: torch.dtype) -> torch.Tensor:
    with open(path, "rb") as f:
        return torch.frombuffer(bytearray(f.read()), dtype=dtype)


@pytest.mark.parametrize("dtype,itemsize", [("fp32", 4), ("bf16", 2)])
def test_engine_places_states_in_extents(tmp_path, dtype, itemsize):
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
        check_run_folder(engine, run_dir, expected_nvme_sizes(engine, itemsize))

        # The extents hold the model: the master extent is this rank's fp32 shard, and the
        # param extent its compute-dtype copy.
        shards = nvme_shards(engine)
        flat = engine.runtime.flats[0]
        master = file_tensor(shards[(0, "master")].path, torch.float32)
        param = file_tensor(shards[(0, "param")].path, flat.full.dtype)
        shard = master[:flat.shard_numel]
        assert shard.abs().sum() > 0
        assert torch.equal(param[:flat.shard_numel], shard.to(flat.full.dtype))
        with open(shards[(0, "exp_avg")].path, "rb") as f:
            moments = f.read()
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


def test_engine_bf16_param_extents_are_half_the_size(tmp_path):
    sizes = {}
    for dtype, itemsize in (("fp32", 4), ("bf16", 2)):
        root = tmp_path / dtype
        root.mkdir()
        # Root unit: embedding + head (2 * 63 * 64) + final norm (128) = 8192 numbers.
        engine, _ = init_engine(GPT(63, 64, 2, 2, block=Square), str(root), compute_dtype=dtype)
        try:
            assert [f.shard_numel for f in engine.runtime.flats] == [4096, 4096, 8192]
            check_run_folder(engine, only_run_dir(root), expected_nvme_sizes(engine, itemsize))
            sizes[dtype] = {key: os.path.getsize(shard.path)
                            for key, shard in nvme_shards(engine).items()}
        finally:
            engine.close()
        assert os.listdir(root) == []
    assert sizes["fp32"].keys() == sizes["bf16"].keys() and len(sizes["fp32"]) == 12
    for key, size in sizes["fp32"].items():
        if key[1] == "param":
            assert sizes["bf16"][key] * 2 == size, key
        else:
            assert sizes["bf16"][key] == size, key


def big_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(64, 64, 2, 2)  # about 2.4 MiB of NVMe extents in fp32, spares included


def test_engine_full_disk_fails_cleanly(tmp_path):
    reference_root = tmp_path / "reference"
    reference_root.mkdir()
    engine, _ = init_engine(big_gpt(), str(reference_root))
    needed = engine.memory_report()["nvme"]["current"]
    assert needed == nvme_bytes(list(expected_nvme_sizes(engine, 4).values()))
    engine.close()
    assert needed > 1 << 20

    with mounted(tmp_path, "tmpfs", "size=1M") as root:
        free = free_bytes(root)
        # A budget above the free space that the plan would need is refused before any extent
        # exists, naming the key (a disk that fills up while extents are created is
        # test_nvme_full_disk's).
        with pytest.raises(tiered.BudgetError, match=r"nvme\.budget 64\.00 MiB is more than "
                                                     r"this rank may use, 10\d\d\.00 KiB"):
            init_engine(big_gpt(), root, nvme={"budget": "64MiB"})
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
