"""What the process may use: cgroup limits (v1 and v2 layouts, written as the kernel writes
them) and the default budgets every rank agrees on."""
from __future__ import annotations

import os

import psutil
import pytest
import torch

import tiered
from tiered.core.limits import available_memory, usable_cores
from tiered.engine.collectives import ProcessGroup
from tiered.tiers.nvme import free_bytes

from distributed import run_ranks
from gpt import GPT
from helpers import REPO

GIB = 1 << 30
HOST_CORES = len(psutil.Process().cpu_affinity())


def write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def v2_tree(tmp_path, own: str, limits: dict[str, dict[str, str]]):
    """A cgroup v2 mount at tmp_path/cgroup with the process in ``own``; ``limits`` maps a
    cgroup path to the files it holds."""
    root = tmp_path / "cgroup"
    write(root / "cgroup.controllers", "cpu memory\n")
    for path, files in limits.items():
        for name, text in files.items():
            write(root / path.lstrip("/") / name, text)
    proc = tmp_path / "proc-cgroup"
    write(proc, f"0::{own}\n")
    return root, proc


def test_v2_memory_limit_less_its_usage_caps_the_available_memory(tmp_path):
    used, cache = 3 * GIB, GIB
    root, proc = v2_tree(tmp_path, "/job/step", {
        "/job": {"memory.max": f"{8 * GIB}\n", "memory.current": f"{used}\n",
                 "memory.stat": f"anon {used - cache}\ninactive_file {cache}\n"},
        "/job/step": {"memory.max": "max\n", "memory.current": "0\n"},
    })
    # The limit sits on the parent: it binds the process all the same. Reclaimable page cache
    # counts as free, as the kernel would drop it before killing anything.
    assert available_memory(root, proc) == min(psutil.virtual_memory().available,
                                               8 * GIB - (used - cache))


def test_the_tightest_limit_on_the_path_wins(tmp_path):
    root, proc = v2_tree(tmp_path, "/a/b", {
        "/a": {"memory.max": f"{4 * GIB}\n", "memory.current": f"{GIB}\n"},
        "/a/b": {"memory.max": f"{5 * GIB}\n", "memory.current": f"{GIB}\n"},
        "/": {"memory.max": f"{10 * GIB}\n", "memory.current": f"{2 * GIB}\n"},
        "/c": {"memory.max": f"{GIB}\n", "memory.current": "0\n"},  # a sibling: not binding
    })
    assert available_memory(root, proc) == min(psutil.virtual_memory().available, 3 * GIB)


def test_no_limit_leaves_the_host_figures(tmp_path):
    root, proc = v2_tree(tmp_path, "/", {"/": {"memory.max": "max\n", "cpu.max": "max 100000\n"}})
    available = available_memory(root, proc)
    assert abs(available - psutil.virtual_memory().available) < 256 << 20
    assert usable_cores(root, proc) == HOST_CORES


@pytest.mark.parametrize("quota, cores", [("250000 100000", 2), ("50000 100000", 1)])
def test_v2_cpu_quota_caps_the_cores_at_whole_cores_and_at_least_one(tmp_path, quota, cores):
    root, proc = v2_tree(tmp_path, "/job", {"/job": {"cpu.max": f"{quota}\n"}})
    assert usable_cores(root, proc) == min(HOST_CORES, cores)


def test_v1_hierarchies_per_controller(tmp_path):
    root = tmp_path / "cgroup"
    write(root / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")  # no limit
    write(root / "memory" / "docker" / "c1" / "memory.limit_in_bytes", f"{2 * GIB}\n")
    write(root / "memory" / "docker" / "c1" / "memory.usage_in_bytes", f"{GIB}\n")
    write(root / "memory" / "docker" / "c1" / "memory.stat", f"total_inactive_file {GIB // 4}\n")
    write(root / "cpu" / "docker" / "c1" / "cpu.cfs_quota_us", "100000\n")
    write(root / "cpu" / "docker" / "c1" / "cpu.cfs_period_us", "100000\n")
    proc = tmp_path / "proc-cgroup"
    write(proc, "4:memory:/docker/c1\n2:cpu,cpuacct:/docker/c1\n0::/\n")
    # cpu,cpuacct is mounted as "cpu" (a link on most systems): the controller names the folder
    assert available_memory(root, proc) == min(psutil.virtual_memory().available,
                                               2 * GIB - GIB + GIB // 4)
    assert usable_cores(root, proc) == 1


def test_this_machines_limits_are_no_more_than_the_host():
    assert 0 < available_memory() <= psutil.virtual_memory().available + (256 << 20)
    assert 1 <= usable_cores() <= HOST_CORES


def _agreement_main(rank: int, world: int, out_dir: str) -> None:
    group = ProcessGroup.current(torch.device("cpu"))
    least = group.smallest(1000 + 7 * (world - rank))
    torch.manual_seed(0)
    engine, _ = tiered.initialize(GPT(64, 32, 2, 2, max_seq=16), os.path.join(REPO, "configs",
                                  "nvme.yaml"), compute_dtype="fp32", device="cpu",
                                  nvme={"path": out_dir})
    budgets = {tier: usage["budget"] for tier, usage in engine.memory_report().items()}
    engine.close()
    torch.save({"least": least, "budgets": budgets}, os.path.join(out_dir, f"rank{rank}.pt"))


def test_ranks_agree_on_the_smallest_default_budgets(tmp_path):
    """Each rank measures its share of free memory and disk at its own moment; unset budgets
    must come out the same on every rank, so their plans are the same: all fit or all refuse."""
    free = free_bytes(str(tmp_path))
    run_ranks(2, _agreement_main, str(tmp_path))
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    assert [r["least"] for r in results] == [1007, 1007]
    assert results[0]["budgets"] == results[1]["budgets"]
    # The two ranks share the drive: each may plan on about half of its free space.
    assert abs(results[0]["budgets"]["nvme"] - free // 2) < free // 100
