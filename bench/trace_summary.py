"""What a tiered timeline (TIERED_TRACE, or bench_offload.py --trace) says about a run: where
setup went, and per training iteration how long each track was busy with each kind of work.

    python bench/trace_summary.py trace.json [--skip 2]

An iteration starts at each forward of the unit the run's first forward computes; the first
``--skip`` iterations (warm-up, compiling) are left out. A track's busy time is the union of its
spans, for each kind of work and for all of them ("all"): spans nest (the root unit's backward
encloses its layers') and a time covered twice is busy once, so a track at 100% of the iteration
is what limits the step. Last comes the CPU update's rate, from its AdamW spans (each says how
many parameters it stepped).
"""
from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

from tiered.core.report import format_table


def covered_us(spans: list[tuple[float, float]]) -> float:
    """The time inside at least one of the (start, end) spans: their union's length."""
    covered, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            covered += end - max(start, reach)
            reach = end
    return covered


def busy_ms(spans: dict[tuple[str, str], list[tuple[float, float]]],
            iterations: int) -> dict[str, tuple[float, dict[str, float]]]:
    """Per track, the ms per iteration that its spans cover: in all, and for each kind of work.
    ``spans`` holds each (track, kind)'s spans as (start, end) in microseconds."""
    tracks = defaultdict(lambda: ([], {}))
    for (track, kind), of_kind in spans.items():
        every, kinds = tracks[track]
        every.extend(of_kind)
        kinds[kind] = covered_us(of_kind) / 1e3 / iterations
    return {track: (covered_us(every) / 1e3 / iterations, kinds)
            for track, (every, kinds) in tracks.items()}


def summarize(events: list[dict], skip: int) -> str:
    setup = [e for e in events if e["cat"] == "setup"]
    work = sorted((e for e in events if e["cat"] != "setup"), key=lambda e: e["ts"])
    lines = []
    if setup:
        total = defaultdict(float)
        for e in setup:  # "build unit blocks.3" and its like add up as "build units"
            name = "build units" if e["name"].startswith("build unit ") else e["name"]
            total[name] += e["dur"] / 1e6
        lines.append("setup: " + ", ".join(f"{name} {s:.1f} s" for name, s in total.items()))
    forwards = [e for e in work if e["name"].startswith("forward ")]
    if not forwards:
        return "\n".join(lines + ["no forward spans: nothing to summarize"])
    starts = [e["ts"] for e in forwards if e["name"] == forwards[0]["name"]]
    if len(starts) <= skip:
        return "\n".join(lines + [f"only {len(starts)} iterations; nothing after --skip {skip}"])
    begin = starts[skip]
    end = max(e["ts"] + e["dur"] for e in work)
    iterations = len(starts) - skip
    per_iteration_ms = (end - begin) / 1e3 / iterations
    spans = defaultdict(list)  # (track, kind) -> (start, end) of each span
    for e in work:
        if e["ts"] >= begin:
            spans[(e["tid"], e["name"].split(" ")[0])].append((e["ts"], e["ts"] + e["dur"]))
    lines.append(f"{iterations} iterations after the first {skip}: {per_iteration_ms:.1f} ms each")
    rows = [("track", "work", "ms/iteration", "% of iteration")]
    for track, (total, kinds) in sorted(busy_ms(spans, iterations).items(),
                                        key=lambda item: -item[1][0]):
        # A track's total first, where it does more than one kind of work (else it is the one).
        shown = [("all", total)] if len(kinds) > 1 else []
        shown += sorted(kinds.items(), key=lambda item: -item[1])
        rows += [(track, kind, f"{ms:.1f}", f"{100 * ms / per_iteration_ms:.0f}")
                 for kind, ms in shown]
    lines.append(format_table(rows))
    steps = [e for e in work if e["ts"] >= begin and e["name"].startswith("adamw ")
             and "params" in e.get("args", {})]
    if steps:  # the CPU update's own rate: what a step that waits for it is made of
        ms = sorted(e["dur"] / 1e3 for e in steps)
        rate = sum(e["args"]["params"] for e in steps) / sum(ms) / 1e6
        lines.append(f"adamw: {len(steps) / iterations:.0f} pieces per iteration, "
                     f"{ms[len(ms) // 10]:.1f} / {statistics.median(ms):.1f} / "
                     f"{ms[len(ms) * 9 // 10]:.1f} ms (p10 / median / p90), {rate:.2f} G params/s")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("trace")
    parser.add_argument("--skip", type=int, default=2, help="warm-up iterations to leave out")
    args = parser.parse_args()
    with open(args.trace) as f:
        print(summarize(json.load(f)["traceEvents"], args.skip))


if __name__ == "__main__":
    main()
