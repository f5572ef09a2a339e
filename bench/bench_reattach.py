"""Going on after a crash: a relaunch reattached to the node's service against the same relaunch
resuming from a checkpoint on local disk, same model and state, measured in one run.

    python bench/bench_reattach.py [--layers 16 --dim 1280] [--dir DIR]

A first process trains the benchmark GPT (``configs/cpu.yaml``: every state in DRAM, the update
in the service) for two steps through a service this script starts, saves a checkpoint into DIR
(default: a temporary folder) and is SIGKILLed. Then, each in a fresh
process and each timed from before ``tiered.initialize`` until the engine is ready to train:
- ``checkpoint``: the model built under ``tiered.init``, ``tiered.initialize`` (every unit
  initialized: the weights the checkpoint then replaces) and ``engine.load_checkpoint(DIR)``,
  without a service (as ``--no-daemon``: the in-process tiers, compiling the CPU update);
- ``checkpoint+service``: the same through the service, as a new job (the service has the CPU
  update compiled: what is left is the checkpoint's own cost);
- ``reattach``: the same model, ``tiered.initialize`` under the killed run's job: the service's
  kept segments mapped again, nothing built or read.
All end at the same step with the same parameters (checked: the first 4096 elements of every
unit's master weights, bit for bit). The checkpoint was just written, so its files are in the
page cache: ``checkpoint`` reads them at DRAM's pace here, faster than from a cold disk.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from bench_offload import REPO, VOCAB, build_model  # the benchmark GPT (examples/ on the path)

JOB = "bench-reattach"


def train_and_die(args) -> None:
    import torch

    import tiered

    with tiered.init(os.path.join(REPO, "configs", "cpu.yaml")):
        model = build_model(args)
    engine, optimizer = tiered.initialize(model)
    for step in range(2):
        idx = torch.randint(0, VOCAB, (2, args.seq), generator=torch.Generator()
                            .manual_seed(step)).to("cuda" if torch.cuda.is_available() else "cpu")
        engine.backward(engine(idx).float().square().mean())
        optimizer.step()
        optimizer.zero_grad()
    engine.save_checkpoint(args.dir)
    os.kill(os.getpid(), signal.SIGKILL)


def resume(args) -> None:
    import tiered

    with tiered.init(os.path.join(REPO, "configs", "cpu.yaml")):
        model = build_model(args)
    start = time.perf_counter()
    engine, optimizer = tiered.initialize(model)
    if args.mode.startswith("checkpoint"):
        engine.load_checkpoint(args.dir)
    seconds = time.perf_counter() - start
    head = [engine.manager.load(flat.spec.index, tiered.placement.plan.StateKind.MASTER)[:4096].clone()
            for flat in engine.runtime.flats]
    print(json.dumps({"mode": args.mode, "seconds": seconds, "reattached": engine.reattached,
                      "steps_taken": optimizer.steps_taken,
                      "checksum": float(sum(h.double().sum() for h in head)),
                      "params": sum(f.numel for f in engine.runtime.flats)}))
    engine.close()


def child(args, mode: str, env: dict) -> subprocess.CompletedProcess:
    command = [sys.executable, __file__, "--child", mode, "--dir", args.dir,
               "--layers", str(args.layers), "--dim", str(args.dim), "--seq", str(args.seq)]
    return subprocess.run(command, env=env, text=True, capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--dim", type=int, default=1280)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--dir", default=None, help="the checkpoint folder (on local disk)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--mode", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.lora = 0
    if args.child is not None:
        args.mode = args.child
        (train_and_die if args.child == "train" else resume)(args)
        return

    from tiered.service import start_service, stop_service
    from tiered.service.client import JOB_ENV, SERVICE_ENV

    work = tempfile.mkdtemp(prefix="bench-reattach-")
    args.dir = args.dir or os.path.join(work, "checkpoints")
    folder = os.path.join(work, "service")
    os.mkdir(folder, 0o700)
    start_service(folder, keep_seconds=600.0)
    try:
        env = dict(os.environ, **{SERVICE_ENV: folder, JOB_ENV: JOB})
        killed = child(args, "train", env)
        assert killed.returncode == -signal.SIGKILL, killed.stderr
        plain = {k: v for k, v in env.items() if k not in (SERVICE_ENV, JOB_ENV)}
        results = {}
        for mode, mode_env in (("checkpoint", plain),
                               ("checkpoint+service", dict(env, **{JOB_ENV: JOB + "-ckpt"})),
                               ("reattach", env)):
            run = child(args, mode, mode_env)
            assert run.returncode == 0, run.stderr
            results[mode] = json.loads(run.stdout.strip().splitlines()[-1])
    finally:
        stop_service(folder)
        subprocess.run(["rm", "-rf", work])
    ckpt, attach = results["checkpoint"], results["reattach"]
    assert attach["reattached"] and attach["steps_taken"] == ckpt["steps_taken"] == 2
    assert attach["checksum"] == ckpt["checksum"] == results["checkpoint+service"]["checksum"]
    print(f"GPT {ckpt['params'] / 1e9:.2f} B parameters, both at step 2, same master weights")
    print(f"{'mode':<20}{'seconds':>10}{'checkpoint / mode':>20}")
    for mode in ("checkpoint", "checkpoint+service", "reattach"):
        seconds = results[mode]["seconds"]
        print(f"{mode:<20}{seconds:>10.2f}{ckpt['seconds'] / seconds:>19.1f}x")


if __name__ == "__main__":
    main()
