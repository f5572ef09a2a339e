"""Traced prefetch: units gathered ahead of need in the recorded order, within the byte limits."""
from __future__ import annotations

import copy
import functools

import pytest
import torch

import tiered

from gpt import next_token_loss
from helpers_models import SkippingGPT, assert_parity, make_gpt, reference_optimizer, train_both

VOCAB, SEQ = 64, 16
four_blocks = functools.partial(make_gpt, 4, qkv_bias=False)


class Recorder:
    """Every need, every gather issued and every prefetch, in order, per iteration."""

    def __init__(self, engine):
        self.events: list[tuple] = []
        runtime = engine.runtime
        need = runtime.prefetcher.need

        def recording_need(unit):
            self.events.append(("need", unit))
            need(unit)

        runtime.prefetcher.need = recording_need
        runtime.prefetcher.on_fetch = lambda unit, ahead: self.events.append(
            ("prefetch", unit, ahead))
        runtime.gatherer.on_gather = lambda unit: self.events.append(("gather", unit))

    def iteration(self):
        events, self.events = self.events, []
        return events


def step(engine, optimizer, seed):
    idx = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(seed))
    next_token_loss(engine(idx), idx).backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("policy", ["cpu", "nvme"])
def test_later_steps_gather_ahead_in_trace_order_within_the_limit(policy, tmp_path):
    engine, optimizer = tiered.initialize(
        four_blocks(), f"configs/{policy}.yaml", device="cpu", compute_dtype="fp32",
        nvme={"path": str(tmp_path)})
    sizes = [f.gathered_bytes for f in engine.runtime.flats]
    limit = engine.runtime.prefetcher.limit
    assert limit == 2 * max(sizes)
    recorder = Recorder(engine)
    step(engine, optimizer, 0)
    first = recorder.iteration()
    assert not [e for e in first if e[0] == "prefetch"], "prefetch before any trace exists"
    trace = [e[1] for e in first if e[0] == "need"]
    assert trace == engine.runtime.prefetcher.trace
    # Forward: root, blocks in order; backward: root first, blocks in reverse.
    blocks = list(range(4))
    assert trace == [4] + blocks + [4] + blocks[::-1]

    for seed in (1, 2):
        events = recorder.iteration() if seed > 1 else None
        step(engine, optimizer, seed)
        events = recorder.iteration()
        needs = [e[1] for e in events if e[0] == "need"]
        assert needs == trace
        prefetched = [e[1] for e in events if e[0] == "prefetch"]
        assert prefetched, "nothing was prefetched once the trace was known"
        # Prefetches follow the trace's order (a subsequence of it).
        position = 0
        for unit in prefetched:
            position = trace.index(unit, position) + 1
        for event in events:
            if event[0] == "prefetch":
                assert event[2] <= limit, f"{event[2]} bytes ahead of need, limit {limit}"
        # Every need after the first found its unit gathered ahead (prefetched or kept).
        demand = []
        gathered_ahead: set[int] = set()
        for event in events:
            if event[0] == "prefetch":
                gathered_ahead.add(event[1])
            elif event[0] == "gather" and event[1] not in gathered_ahead:
                demand.append(event[1])
        assert demand == [trace[0]], f"gathered on demand: {demand}"
    engine.close()


def test_limit_smaller_than_two_units_prefetches_one_at_a_time():
    probe, _ = tiered.initialize(four_blocks(), "configs/cpu.yaml", device="cpu")
    block = probe.runtime.flats[0].gathered_bytes
    probe.close()
    engine, optimizer = tiered.initialize(four_blocks(), "configs/cpu.yaml", device="cpu",
                                          prefetch={"hbm_bytes": block + block // 2})
    recorder = Recorder(engine)
    for seed in range(3):
        step(engine, optimizer, seed)
    ahead = [e[2] for e in recorder.iteration() if e[0] == "prefetch"]
    assert ahead and max(ahead) <= block + block // 2
    engine.close()


def test_prefetch_off_gathers_only_on_demand():
    engine, optimizer = tiered.initialize(four_blocks(), "configs/cpu.yaml", device="cpu",
                                          prefetch={"enabled": False})
    recorder = Recorder(engine)
    for seed in range(3):
        step(engine, optimizer, seed)
    assert not [e for e in recorder.iteration() if e[0] == "prefetch"]
    engine.close()


def test_changing_control_flow_stops_prefetch_and_stays_correct():
    torch.manual_seed(0)
    model = SkippingGPT(VOCAB, 32, 2, 2, max_seq=SEQ, tied=True, qkv_bias=False)
    reference = copy.deepcopy(model)
    engine, optimizer = tiered.initialize(model, "configs/cpu.yaml", compute_dtype="fp32",
                                          device="cpu", optimizer={"lr": 1e-2,
                                                                   "weight_decay": 0.1})
    recorder = Recorder(engine)
    train_both(engine, optimizer, reference, reference_optimizer(reference), steps=6)
    assert_parity(engine.full_state_dict(), reference.state_dict())
    # Every other iteration skips block 1, so no trace ever matches a whole iteration: the
    # prefetcher stops at the first difference and the rest is gathered on demand.
    needs = [e[1] for e in recorder.iteration() if e[0] == "need"]
    assert needs.count(1) == 3 * 2  # block 1 ran (forward and backward) in 3 of 6 iterations
    engine.close()


def test_unused_prefetches_are_released_at_the_end_of_the_iteration():
    engine, optimizer = tiered.initialize(four_blocks(), "configs/cpu.yaml", device="cpu")
    for seed in range(2):
        step(engine, optimizer, seed)
    idx = torch.randint(0, VOCAB, (4, SEQ))
    with torch.no_grad():  # a forward-only iteration: a different trace, nothing left behind
        engine(idx)
    assert engine.memory_report()["hbm"]["current"] == 0
    step(engine, optimizer, 3)
    assert engine.memory_report()["hbm"]["current"] == 0
    engine.close()


def test_the_halves_of_a_split_module_count_as_one_need_ahead():
    # LoRA in every block (units.split_frozen: a frozen and a trained unit per block): the
    # look-ahead covers prefetch.depth modules, both halves of each, so split units move the
    # bytes unsplit ones move; none is released to be gathered again at once.
    from gpt import add_lora

    moved = {}
    for split in (True, False):
        engine, optimizer = tiered.initialize(
            add_lora(four_blocks(), 4), "configs/cpu.yaml", device="cpu", compute_dtype="fp32",
            units={"split_frozen": split})
        sizes = {f.spec.index: f.gathered_bytes for f in engine.runtime.flats}
        recorder = Recorder(engine)
        for seed in range(3):
            step(engine, optimizer, seed)
            events = recorder.iteration()
        moved[split] = sum(sizes[e[1]] for e in events if e[0] == "gather")
        first_need = next(e[1] for e in events if e[0] == "need")
        prefetched = {e[1] for e in events if e[0] == "prefetch"}
        demand = [e[1] for e in events if e[0] == "gather" and e[1] not in prefetched]
        assert demand == [first_need], (split, demand)
        engine.close()
    assert moved[True] == moved[False]
