"""Edges of tiling, the CPU worker's thread count and the timeline, each checked against plain
PyTorch, a formula or the file a viewer reads."""
from __future__ import annotations

import json
import os
import tracemalloc

import psutil
import pytest
import torch
from torch import nn

import tiered
from tiered.core.limits import usable_cores
from tiered.core.timeline import Timeline
from tiered.ops.tiled_linear import TiledLinear, tile_large_linears

from distributed import run_ranks
from gpt import GPT, next_token_loss
from helpers import REPO



# --- tiling -----------------------------------------------------------------------------------

@pytest.mark.parametrize("in_features, out_features, bias, itemsize, limit", [
    (64, 100, True, 4, 64 * 4 * 7 + 3),  # seven rows fit, but not with their bias elements
    (256, 4, True, 4, 1024),             # one row is the whole limit: its bias is over it
    (1001, 3, False, 4, 1001),           # a limit that is no whole number of elements
    (10, 5, False, 2, 3),                # the smallest the policy allows (one bf16 element)
])
def test_every_tile_unit_is_within_max_unit_bytes(in_features, out_features, bias, itemsize,
                                                  limit):
    """TilingPolicy: "tiles are units of at most this size": a tile's unit is its weight and,
    for the first column of tiles, its bias."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(in_features, out_features, bias=bias))
    reference = nn.Linear(in_features, out_features, bias=bias)
    reference.load_state_dict(model[0].state_dict())
    tile_large_linears(model, limit, itemsize)
    tiled = model[0]
    assert isinstance(tiled, TiledLinear)
    for k, tile in enumerate(tiled.tiles):
        unit_bytes = sum(p.numel() for p in tile.parameters()) * itemsize
        assert unit_bytes <= limit, f"tile {k} holds {unit_bytes} bytes, limit {limit}"
    x = torch.randn(3, in_features)
    torch.testing.assert_close(tiled(x), reference(x), rtol=1e-5, atol=1e-6)


def _relative_error(value: torch.Tensor, truth: torch.Tensor) -> float:
    return ((value.float() - truth).norm() / truth.norm()).item()


# Each tile's product leaves F.linear rounded to the compute dtype: rounding errors of pieces
# that sum to the result, worth one more rounding of it, so at most sqrt(2) times nn.Linear's
# error (1.17x measured) whatever the number of tiles. Rounding each partial sum as well
# made it grow as sqrt(tiles): 3.5x at 64.
ONE_MORE_ROUNDING = 2 ** 0.5


@pytest.mark.parametrize("tiles", [4, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_partial_sums_over_input_tiles_round_once_as_nn_linear_does(dtype, tiles):
    """nn.Linear in bf16/fp16 sums its products in fp32 and rounds once; a TiledLinear that
    rounds each input tile's partial sum to the compute dtype loses precision with every tile
    (bf16: 1.0e-2 relative error at 64 tiles against nn.Linear's 2.8e-3, the design's whole
    bf16 parity budget spent in one layer's forward)."""
    torch.manual_seed(0)
    linear = nn.Linear(4096, 64)
    x = torch.randn(256, 4096)
    with torch.no_grad():
        truth = linear(x)
        low = linear.to(dtype)
        tiled = TiledLinear.from_linear(low, in_splits=tiles, out_splits=1)
        x_low = x.to(dtype)
        plain, error = _relative_error(low(x_low), truth), _relative_error(tiled(x_low), truth)
    assert tiled(x_low).dtype == dtype
    assert error <= ONE_MORE_ROUNDING * plain, f"tiled {error:.2e}, nn.Linear {plain:.2e}"


@pytest.mark.parametrize("tiles", [4, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_input_gradient_over_output_tiles_rounds_once_as_nn_linear_does(dtype, tiles):
    """The input's gradient is a sum over the output tiles that read it; autograd sums it in
    the input's dtype, so a bf16 layer cut into 64 output tiles (the default way to cut, rows
    first) gives its input a gradient 3.6x less precise than nn.Linear's."""
    torch.manual_seed(0)
    linear = nn.Linear(256, 4096)
    x = torch.randn(64, 256, requires_grad=True)
    upstream = torch.randn(64, 4096)
    linear(x).backward(upstream)
    truth = x.grad.clone()
    linear.zero_grad(set_to_none=True)
    low = linear.to(dtype)
    tiled = TiledLinear.from_linear(low, in_splits=1, out_splits=tiles)
    x_plain = x.detach().to(dtype).requires_grad_()
    x_tiled = x.detach().to(dtype).requires_grad_()
    low(x_plain).backward(upstream.to(dtype))
    out = tiled(x_tiled)
    out.backward(upstream.to(dtype))
    assert x_tiled.grad.dtype == dtype and out.dtype == dtype
    plain, error = _relative_error(x_plain.grad, truth), _relative_error(x_tiled.grad, truth)
    assert error <= ONE_MORE_ROUNDING * plain, f"tiled {error:.2e}, nn.Linear {plain:.2e}"
    # The weights' gradients have no sum across tiles: each is nn.Linear's, bit for bit.
    weight_grad, _ = tiled.merge([t.weight.grad for t in tiled.tiles],
                                 [t.bias.grad for t in tiled.tiles])
    assert torch.equal(weight_grad, low.weight.grad)


def test_fp32_tiles_keep_nn_linears_gradients_with_4d_noncontiguous_and_empty_input():
    """The fp32 path (no change of dtype anywhere) on inputs of other shapes; the summation
    order over input tiles differs from one matmul's, so equal within rounding only."""
    torch.manual_seed(0)
    linear = nn.Linear(13, 11)
    tiled = TiledLinear.from_linear(linear, in_splits=3, out_splits=4)
    for x in (torch.randn(2, 3, 4, 13), torch.randn(13, 6).t(), torch.randn(0, 5, 13)):
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        upstream = torch.randn(*x.shape[:-1], 11)
        out_linear, out_tiled = linear(a), tiled(b)
        assert out_tiled.shape == out_linear.shape
        torch.testing.assert_close(out_tiled, out_linear, rtol=1e-5, atol=1e-6)
        out_linear.backward(upstream)
        out_tiled.backward(upstream)
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6)


# --- the CPU worker's threads -----------------------------------------------------------------

def _threads_main(rank: int, world: int, out_dir: str, cores: list[int]) -> None:
    os.sched_setaffinity(0, cores)  # both ranks share the same cores, as on an unbound node
    torch.manual_seed(0)
    engine, _ = tiered.initialize(GPT(64, 32, 2, 2, max_seq=16),
                                  os.path.join(REPO, "configs", "cpu.yaml"),
                                  compute_dtype="fp32", device="cpu")
    seen = []
    engine.runtime.worker.submit(lambda: seen.append(torch.get_num_threads()))
    engine.runtime.worker.drain()
    engine.close()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"threads": seen[0], "usable": usable_cores()}, f)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or usable_cores() < 2,
                    reason="needs two usable cores and sched_setaffinity")
def test_ranks_sharing_a_nodes_cores_split_them_between_their_workers(tmp_path):
    """Two ranks on one node, started without LOCAL_WORLD_SIZE (as torch.multiprocessing
    starts them): each worker took every core, so the node ran twice as many optimizer threads
    as it has cores (tiered-launch gives each rank usable_cores() // ranks for OMP, and the
    DRAM budget is split between the ranks of a node the same way)."""
    cores = sorted(psutil.Process().cpu_affinity())[:2]
    run_ranks(2, _threads_main, str(tmp_path), cores)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    usable = results[0]["usable"]
    assert sum(r["threads"] for r in results) <= usable, results


# --- the timeline -----------------------------------------------------------------------------

def _traced_bytes(snapshot: tracemalloc.Snapshot) -> int:
    timeline_file = tiered.core.timeline.__file__
    return sum(stat.size for stat in snapshot.filter_traces(
        [tracemalloc.Filter(True, timeline_file)]).statistics("filename"))


def test_a_long_run_keeps_the_timeline_on_disk_not_in_memory(tmp_path):
    """Spans of every iteration were kept in a list until close(): memory grew with the run's
    length (hundreds of spans per step for a real model), and a process killed mid-run (the OOM
    killer, SIGKILL) left no timeline at all. Each iteration's end (flush) must put them in the
    file, which stays a valid trace between flushes."""
    path = tmp_path / "trace.json"
    timeline = Timeline(str(path), torch.device("cpu"))
    spans_per_iteration = 200

    def iteration(step: int) -> None:
        for k in range(spans_per_iteration):
            with timeline.span(f"forward unit {k}", "compute", {"step": step}):
                pass
        timeline.flush()  # what UnitRuntime.end_iteration calls

    tracemalloc.start()
    try:
        for step in range(20):
            iteration(step)
        early = _traced_bytes(tracemalloc.take_snapshot())
        for step in range(20, 200):
            iteration(step)
        late = _traced_bytes(tracemalloc.take_snapshot())
    finally:
        tracemalloc.stop()
    assert late < early + (64 << 10), f"the timeline grew from {early} to {late} bytes"
    # Mid-run, the file already holds every flushed span and loads as a trace.
    events = json.loads(path.read_text())["traceEvents"]
    assert len(events) == 200 * spans_per_iteration
    timeline.close()
    events = json.loads(path.read_text())["traceEvents"]
    assert len(events) == 200 * spans_per_iteration
    assert all(e["ph"] == "X" and e["dur"] >= 0 and e["ts"] >= 0 and "pid" in e and "tid" in e
               for e in events)
    assert [e["args"]["step"] for e in events[::spans_per_iteration]] == list(range(200))


def test_an_engine_timeline_is_a_valid_trace_after_each_iteration(tmp_path, monkeypatch):
    """Through a real engine: after some steps and before close, the trace file loads; close
    adds the rest."""
    path = tmp_path / "trace.json"
    monkeypatch.setenv("TIERED_TRACE", str(path))
    torch.manual_seed(0)
    engine, optimizer = tiered.initialize(GPT(64, 32, 2, 2), "configs/cpu.yaml", device="cpu",
                                          compute_dtype="fp32")
    for _ in range(3):
        idx = torch.randint(0, 64, (2, 8))
        next_token_loss(engine(idx), idx).backward()
        optimizer.step()
        optimizer.zero_grad()
    optimizer.synchronize()
    mid = json.loads(path.read_text())["traceEvents"]
    assert sum(e["name"] == "forward blocks.0" for e in mid) >= 2
    engine.close()
    final = json.loads(path.read_text())["traceEvents"]
    assert len(final) >= len(mid) and final[:len(mid)] == mid
    assert sum(e["name"] == "forward blocks.0" for e in final) == 3
