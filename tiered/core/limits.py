"""What this process may use of the node: cores and memory as its CPU affinity and its cgroups
allow, not what the machine has.

In a container psutil sees the host: every core and all of the host's free memory. The cgroup's
limits are what the kernel enforces (throttling past the CPU quota, the OOM killer past the
memory limit), so sizing threads or pinned memory from the host's figures oversubscribes them.
Limits are hierarchical: every cgroup from this process's own up to the hierarchy's root binds
it, so the tightest one counts. Both cgroup v2 (one unified hierarchy) and v1 (a hierarchy per
controller) are read.
"""
from __future__ import annotations

import os
from pathlib import Path

import psutil

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
V1_UNLIMITED = 1 << 62
"""cgroup v1 writes "no memory limit" as a page-rounded LONG_MAX."""


def usable_cores(root: Path = CGROUP_ROOT, proc: Path = PROC_CGROUP) -> int:
    """Cores this process may run on: its CPU affinity, capped by its cgroups' CPU quotas."""
    try:
        cores = len(psutil.Process().cpu_affinity())
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    for quota in _cpu_quotas(root, proc):
        cores = min(cores, max(1, int(quota)))
    return max(1, cores)


def available_memory(root: Path = CGROUP_ROOT, proc: Path = PROC_CGROUP) -> int:
    """Bytes this process could still take: the host's available memory, capped by what each of
    its cgroups' memory limits leaves (page cache the kernel can drop counts as free)."""
    return memory_bound(root, proc)[0]


def memory_bound(root: Path = CGROUP_ROOT, proc: Path = PROC_CGROUP) -> tuple[int, str]:
    """:func:`available_memory`, and what sets it (for messages): the host's available memory
    or the tightest of its cgroups' memory limits."""
    bound = psutil.virtual_memory().available, "the host's available memory"
    for folder, headroom in _memory_headrooms(root, proc):
        if headroom < bound[0]:
            bound = max(0, headroom), f"the memory limit of cgroup {folder}, less its usage"
    return bound


def total_memory(root: Path = CGROUP_ROOT, proc: Path = PROC_CGROUP) -> int:
    """The node's memory as this process sees it: the host's, capped by its cgroups' memory
    limits. Unlike :func:`available_memory` it does not move with what others use, so a plan
    made from it is the same each time it is asked."""
    total = psutil.virtual_memory().total
    for version, folder in _cgroup_folders("memory", root, proc):
        limit = _read(folder / ("memory.max" if version == 2 else "memory.limit_in_bytes"), int)
        if limit is not None and limit < V1_UNLIMITED:  # v2's "max" reads as None
            total = min(total, limit)
    return total


def _cpu_quotas(root: Path, proc: Path) -> list[float]:
    """Cores' worth of CPU time each cgroup allows per period."""
    quotas = []
    for version, folder in _cgroup_folders("cpu", root, proc):
        if version == 2:
            fields = (_read(folder / "cpu.max", str) or "").split()
            if len(fields) == 2 and fields[0] != "max":
                quotas.append(int(fields[0]) / int(fields[1]))
        else:
            quota = _read(folder / "cpu.cfs_quota_us", int)
            period = _read(folder / "cpu.cfs_period_us", int)
            if quota is not None and period and quota > 0:
                quotas.append(quota / period)
    return quotas


def _memory_headrooms(root: Path, proc: Path) -> list[tuple[Path, int]]:
    """Per limited cgroup: its folder, and its limit less what it uses, reclaimable page cache
    not counted."""
    headrooms = []
    for version, folder in _cgroup_folders("memory", root, proc):
        if version == 2:
            limit = _read(folder / "memory.max", str)
            if limit is None or limit.strip() == "max":
                continue
            usage = _read(folder / "memory.current", int)
            cache = _stat(folder / "memory.stat", "inactive_file")
        else:
            limit = _read(folder / "memory.limit_in_bytes", int)
            if limit is None or limit >= V1_UNLIMITED:
                continue
            usage = _read(folder / "memory.usage_in_bytes", int)
            cache = _stat(folder / "memory.stat", "total_inactive_file")
        if usage is not None:
            headrooms.append((folder, int(limit) - (usage - cache)))
    return headrooms


def _cgroup_folders(controller: str, root: Path, proc: Path) -> list[tuple[int, Path]]:
    """(cgroup version, folder) of every cgroup that binds this process for ``controller``:
    its own and each ancestor up to the hierarchy's mount. Inside a cgroup namespace the own
    cgroup reads as "/", which is the mount itself."""
    try:
        lines = proc.read_text().splitlines()
    except OSError:
        return []
    folders: list[tuple[int, Path]] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            version, mount = 2, root if (root / "cgroup.controllers").exists() else root / "unified"
        elif controller in controllers.split(","):
            version, mount = 1, root / controller
        else:
            continue
        folder = mount / path.lstrip("/")
        while True:
            if folder.is_dir():
                folders.append((version, folder))
            if folder == mount or mount not in folder.parents:
                break
            folder = folder.parent
    return folders


def _read(path: Path, kind: type):
    try:
        text = path.read_text().strip()
        return kind(text)
    except (OSError, ValueError):
        return None


def _stat(path: Path, key: str) -> int:
    """One counter of a cgroup's memory.stat (0 when absent)."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0
