"""The warm start: a job's start-up on a service that served jobs before, against the first job on
a freshly started one, measured in one run.

    python bench/bench_warm_start.py [--layers 4 --dim 512] [--jobs 3]

Starts a service of its own, then runs ``--jobs`` jobs one after the other, each a fresh process
that builds the benchmark GPT under ``tiered.init`` (``configs/cpu.yaml``, bf16: every state in
the service's DRAM, the update in the service) and times ``tiered.initialize`` to an engine
ready to train, with the setup spans of its timeline: allocating the tiers (the service's
segments reserved, mapped and, on a GPU, registered), building the units, and the wait for the
service's host (its compile of the one-pass AdamW, on the first job only). Each job then trains
one step (untimed: every page of its tiers touched, as in a real job) and ends cleanly, so its
segments go back to the service for the next.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from bench_offload import REPO, VOCAB, build_model  # the benchmark GPT (examples/ on the path)

SPANS = {"allocate": "allocate tiers", "build": "build unit"}
"""Columns of the table: a setup span's name starts with the value."""


def start_up(args) -> None:
    import torch

    import tiered

    with tiered.init(os.path.join(REPO, "configs", "cpu.yaml")):
        model = build_model(args)
    start = time.perf_counter()
    engine, optimizer = tiered.initialize(model)
    seconds = time.perf_counter() - start
    assert type(engine.runtime.host).__name__ == "RemoteHost", "the update is not in the service"
    idx = torch.randint(0, VOCAB, (2, 64), device="cuda" if torch.cuda.is_available() else "cpu")
    engine.backward(engine(idx).float().square().mean())
    optimizer.step()
    engine.close()
    with open(os.environ["TIERED_TRACE"]) as trace:
        events = json.load(trace)
    events = events["traceEvents"] if isinstance(events, dict) else events
    spans = {column: sum(e.get("dur", 0) for e in events
                         if e.get("cat") == "setup" and e.get("name", "").startswith(prefix)) / 1e6
             for column, prefix in SPANS.items()}
    print(json.dumps({"seconds": seconds, **spans}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--jobs", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.lora = 0
    if args.child:
        start_up(args)
        return

    from tiered.service import start_service, stop_service
    from tiered.service.client import JOB_ENV, SERVICE_ENV

    work = tempfile.mkdtemp(prefix="bench-warm-")
    folder = os.path.join(work, "service")
    os.mkdir(folder, 0o700)
    start_service(folder)
    rows = []
    try:
        for job in range(args.jobs):
            env = dict(os.environ, **{SERVICE_ENV: folder, JOB_ENV: f"warm-{job}",
                                      "TIERED_TRACE": os.path.join(work, f"trace-{job}.json")})
            run = subprocess.run([sys.executable, __file__, "--child", "--layers",
                                  str(args.layers), "--dim", str(args.dim)], env=env, text=True,
                                 capture_output=True)
            assert run.returncode == 0, run.stderr
            rows.append(json.loads(run.stdout.strip().splitlines()[-1]))
    finally:
        stop_service(folder)
        subprocess.run(["rm", "-rf", work])
    cold = rows[0]["seconds"]
    print(f"GPT {args.layers} x {args.dim}, configs/cpu.yaml, one service, {args.jobs} jobs")
    print(f"{'job':<16}{'initialize s':>14}{'allocate s':>12}{'build s':>10}{'of cold':>10}")
    for job, row in enumerate(rows):
        name = "first (cold)" if job == 0 else f"job {job + 1}"
        print(f"{name:<16}{row['seconds']:>14.2f}{row['allocate']:>12.2f}{row['build']:>10.2f}"
              f"{row['seconds'] / cold:>10.0%}")


if __name__ == "__main__":
    main()
