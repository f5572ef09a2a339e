"""bench/gpu_check.sh's result: one JSON of every stage (status, time, what it measured) and the
table a person reads.

    python bench/gpu_check_summary.py OUT      (OUT: the folder gpu_check.sh wrote)
"""
from __future__ import annotations

import json
import os
import re
import sys

EXPECTED = {"gpu": 0.32, "fsdp2_offload": 1.30, "tiered:cpu+dpu+service": 0.69,
            "tiered:auto": 0.34}
"""Seconds per step the H200 should show at batch 8 (bench/RESULTS.md's GPU plan): the H100's
figures (gpu 0.317, FSDP2 1.30, cpu.yaml with the delayed update 0.693), the arithmetic rate
being the same; tier: auto's target 0.32-0.36 s (everything fits in HBM at 2.78 B)."""


def pytest_counts(log: str) -> dict:
    """The closing line's counts (passed, failed, skipped, errors)."""
    counts = {}
    for number, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", log):
        counts[word.rstrip("s") if word.startswith("error") else word] = int(number)
    return counts


def summary(folder: str) -> dict:
    stages = {}
    with open(os.path.join(folder, "stages.jsonl")) as f:
        for line in f:
            stage = json.loads(line)
            stages[stage["stage"]] = stage
    for name in ("tests", "kernels", "sanitizer"):
        if name in stages:
            with open(os.path.join(folder, f"{name}.log")) as f:
                stages[name]["counts"] = pytest_counts(f.read())
    if "node" in stages and stages["node"]["rc"] == 0:
        with open(os.path.join(folder, "node.log")) as f:
            text = f.read()
        stages["node"]["rates"] = json.loads(text[text.index("{"):])
    for name, stage in stages.items():
        measured = os.path.join(folder, f"{name}.json")
        if name.startswith("step_") and os.path.exists(measured):
            with open(measured) as f:
                stage["steps"] = [{"mode": r["mode"], "batch": r["batch"],
                                   "step_s": r.get("step_s"),
                                   "expected_s": EXPECTED.get(r["mode"]),
                                   "error": r.get("error")} for r in json.load(f)]
    return stages


RATES = ("cpu_one_pass_params_per_s", "gpu_adamw_params_per_s", "h2d_gbps", "d2h_gbps",
         "both_gbps", "nvme_write_gbps", "nvme_read_gbps")
"""The node's rates the table shows (the JSON keeps them all)."""


def table(stages: dict) -> str:
    lines = [f"{'stage':<13} {'exit':>4} {'time':>8}  what"]
    for name, stage in stages.items():
        said = ", ".join(f"{n} {w}" for w, n in stage.get("counts", {}).items())
        said += ", ".join(f"{key} {stage['rates'][key]:.3g}" for key in RATES
                          if stage.get("rates", {}).get(key))
        timed_out = " (past its limit)" if stage.get("rc") in (124, 137) else ""
        lines.append(f"{name:<13} {stage.get('rc', '?'):>4} {stage.get('seconds', 0):>6} s  "
                     f"{said}{timed_out}")
    for stage in stages.values():
        for step in stage.get("steps", []):
            measured = (f"{step['step_s']:.3f} s/step" if step["step_s"] is not None
                        else step["error"])
            lines.append(f"  {step['mode']:<24} batch {step['batch']}: {measured} "
                         f"(expected about {step['expected_s']} s)")
    return "\n".join(lines)


def main() -> None:
    folder = sys.argv[1]
    stages = summary(folder)
    with open(os.path.join(folder, "gpu_check.json"), "w") as f:
        json.dump(stages, f, indent=1)
    print(table(stages))


if __name__ == "__main__":
    main()
