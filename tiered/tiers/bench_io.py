"""``tiered bench-io``: what the NVMe tier's I/O engine moves on a file system, against the
simplest alternative, and across queue depths and request sizes (to choose the defaults; each
sweep point is the median of several interleaved runs).

Every figure is sequential O_DIRECT traffic through one file of the given size in a folder of
its own under the path, removed afterwards: the engine at the policy's settings, a plain loop of
8 MiB requests with one in flight, and a sweep of queue depth x block size over a smaller file.
"""
from __future__ import annotations

import os
import secrets
import shutil
import statistics
import time
from dataclasses import dataclass

import torch

from ..core.report import format_table
from ..core.sizes import align_up, format_size
from .aio import IoEngine, IoSettings, host_buffer
from .dram import BLOCK_ALIGN, PinnedSlabSource
from .nvme import Extent, check_nvme_path

SINGLE_STREAM_REQUEST = 8 << 20
SWEEP_DEPTHS = (1, 2, 4, 8, 16, 32)
SWEEP_BLOCKS = (1 << 20, 4 << 20, 16 << 20)
TRANSFER_BYTES = 256 << 20
"""Bytes handed to the engine per call (one pinned buffer, reused)."""


@dataclass(frozen=True)
class Point:
    label: str
    block_size: int
    queue_depth: int
    write_gbps: float
    read_gbps: float


def run(path: str, size: int, sweep_size: int, settings: IoSettings, repeats: int = 3) -> dict:
    check_nvme_path(path)
    folder = os.path.join(path, f"tiered-bench-io-{secrets.token_hex(3)}")
    os.mkdir(folder, 0o700)
    try:
        source = PinnedSlabSource()
        buffer = source(min(align_up(size, BLOCK_ALIGN), TRANSFER_BYTES))
        buffer.copy_(torch.randint(0, 256, (buffer.numel(),), dtype=torch.uint8))
        engine = measure(folder, "engine (policy settings)", settings, size, buffer)
        single = _measure_single_stream(folder, size, buffer)
        # The policy's own point is measured again among the sweep, under the same conditions.
        # A disk's speed drifts and jitters by tens of percent from one run to the next, and
        # the best of many single samples is biased upwards, so every point is measured
        # ``repeats`` times, in interleaved rounds, and its median kept.
        points = [(f"qd {depth}, {block >> 20} MiB", IoSettings(block, depth))
                  for block in SWEEP_BLOCKS for depth in SWEEP_DEPTHS]
        points.append(("policy settings, in the sweep", settings))
        rounds = [[measure(folder, label, point_settings, sweep_size, buffer)
                   for label, point_settings in points] for _ in range(repeats)]
        *sweep, policy_point = [_median(samples) for samples in zip(*rounds)]
        source.release(buffer)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    best_write = max(p.write_gbps for p in sweep)
    best_read = max(p.read_gbps for p in sweep)
    return {
        "path": path, "size": size, "sweep_size": sweep_size, "repeats": repeats,
        "engine": engine.__dict__, "single_stream": single.__dict__,
        "sweep": [p.__dict__ for p in [*sweep, policy_point]],
        "engine_vs_best_sweep": {"write": policy_point.write_gbps / best_write,
                                 "read": policy_point.read_gbps / best_read},
        "engine_vs_single_stream": {"write": engine.write_gbps / single.write_gbps,
                                    "read": engine.read_gbps / single.read_gbps},
    }


def _median(samples: tuple[Point, ...]) -> Point:
    """The point with each direction's median bandwidth over its samples."""
    first = samples[0]
    return Point(first.label, first.block_size, first.queue_depth,
                 statistics.median(p.write_gbps for p in samples),
                 statistics.median(p.read_gbps for p in samples))


def measure(folder: str, label: str, settings: IoSettings, size: int,
            buffer: torch.Tensor) -> Point:
    """The engine at ``settings`` writing then reading a new O_DIRECT file of ``size`` bytes
    in ``folder``, ``buffer`` (pinned) at a time."""
    extent = Extent(os.path.join(folder, f"{secrets.token_hex(4)}.bin"),
                    align_up(size, BLOCK_ALIGN), direct=True)
    engine = IoEngine(settings)
    try:
        chunk = buffer.numel()

        def sweep(move) -> float:
            start = time.perf_counter()
            for offset in range(0, extent.nbytes, chunk):
                length = min(chunk, extent.nbytes - offset)
                move(extent.fd, extent.path, offset, host_buffer(buffer, length)).wait()
            return extent.nbytes / (time.perf_counter() - start) / 1e9

        write = sweep(engine.write)
        read = sweep(engine.read)
    finally:
        engine.close()
        extent.close()
        os.unlink(extent.path)
    return Point(label, settings.block_size, settings.queue_depth, write, read)


def _measure_single_stream(folder: str, size: int, buffer: torch.Tensor) -> Point:
    extent = Extent(os.path.join(folder, "single.bin"), align_up(size, BLOCK_ALIGN), direct=True)
    try:
        request = min(SINGLE_STREAM_REQUEST, buffer.numel())

        def sweep(syscall) -> float:
            start = time.perf_counter()
            for offset in range(0, extent.nbytes, request):
                length = min(request, extent.nbytes - offset)
                syscall(extent.fd, [host_buffer(buffer, length)], offset)
            return extent.nbytes / (time.perf_counter() - start) / 1e9

        write = sweep(os.pwritev)
        read = sweep(os.preadv)
    finally:
        extent.close()
        os.unlink(extent.path)
    return Point(f"single stream, {format_size(request)}, 1 in flight", request, 1, write, read)


def table(result: dict) -> str:
    rows = [("setting", "write GB/s", "read GB/s")]
    for point in [result["engine"], result["single_stream"], *result["sweep"]]:
        rows.append((point["label"], f"{point['write_gbps']:.2f}", f"{point['read_gbps']:.2f}"))
    lines = [format_table(rows)]
    best, single = result["engine_vs_best_sweep"], result["engine_vs_single_stream"]
    lines.append(f"policy settings / best of sweep: write {best['write']:.2f}, read "
                 f"{best['read']:.2f}; "
                 f"engine / single stream: write {single['write']:.2f}, read {single['read']:.2f}")
    return "\n".join(lines)
