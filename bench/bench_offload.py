"""Step time of a GPT trained with tiered against its peers, measured in one run on one GPU.

    python bench/bench_offload.py [--layers 32 --dim 2560 --seq 1024 --batch 8]
        [--modes gpu,fsdp2_offload,tiered:cpu] [--steps 6] [--lora RANK]

Each mode runs in its own process (so one mode's memory cannot help or hurt another), which
measures every batch size in turn after one setup (on the GPU box a tiered setup takes over a
minute: pinning, initialization, compiling) and prints a JSON line; the parent prints a table
per batch size with every mode's ratio to each baseline:
- ``gpu``: everything on the GPU, autocast bf16, fused AdamW (the speed of light for the model);
- ``fsdp2_offload``: FSDP2 with ``CPUOffloadPolicy`` (params, grads, optimizer on the CPU) and
  bf16 compute, what a PyTorch user would pick instead of us;
- ``tiered:<policy>``: tiered with ``configs/<policy>.yaml`` (``--nvme`` for NVMe policies).
``--lora RANK`` fine-tunes instead, in every mode: adapters of that rank on the blocks' linear
layers, every other parameter frozen (TFLOPS then counts 6 FLOPs per trained parameter and
token, 4 per frozen one, whose weight gradient nobody computes).
The step time is the median of the steps after the first ``--warmup`` (default 2). With the
delayed update (``+dpu``, 2 ordinary warm-up steps) the first delayed step still finishes the
ordinary update before it, so steady state starts at step 4: use ``--warmup 3``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "examples"))

VOCAB = 50304


def build_model(args):
    from gpt import GPT, add_lora

    model = GPT(VOCAB, args.dim, args.layers, args.dim // 128)
    return add_lora(model, args.lora) if args.lora else model


def _run_gpu(args):
    model = build_model(args).cuda()
    return model, _plain_step(model, autocast=True)


def _run_fsdp2_offload(args):
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    with torch.device("meta"):
        model = build_model(args)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=True)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp, offload_policy=offload)
    fully_shard(model, mp_policy=mp, offload_policy=offload)
    model.to_empty(device="cpu")
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    return model, _plain_step(model, autocast=False)


def _plain_step(model, autocast: bool):
    """A PyTorch training step: bf16 autocast or not, fused AdamW."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step(idx):
        with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
            loss = _loss(model(idx), idx)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()
    return step


def _run_tiered(args, variant):
    """``variant`` is a policy name with optional ``+dpu`` (the delayed update after 2 warm-up
    steps), ``+arrive`` (accumulation_steps 1: units stepped as their gradients arrive),
    ``+depth1`` (prefetch one need ahead instead of two), ``+nosplit`` (units.split_large
    off: embedding and head stay in the root unit), ``+thp`` (DRAM slabs on transparent huge
    pages), ``+threadsN`` (N CPU optimizer threads) and ``+service`` (DRAM from a node's
    service started for this mode, as under tiered-launch); ``--set`` adds keys for every
    mode."""
    import tiered

    policy, *extras = variant.split("+")
    overrides = json.loads(args.set) if args.set else {}
    if args.nvme:
        overrides.setdefault("nvme", {})["path"] = args.nvme
    optimizer = overrides.setdefault("optimizer", {})
    if "dpu" in extras:
        optimizer["delayed_update"] = {"enabled": True, "warmup_steps": 2}
    if "arrive" in extras:
        optimizer["accumulation_steps"] = 1
    if "depth1" in extras:
        overrides.setdefault("prefetch", {})["depth"] = 1
    if "nosplit" in extras:
        overrides.setdefault("units", {})["split_large"] = False
    if "thp" in extras:
        overrides.setdefault("dram", {})["huge_pages"] = True
    for extra in extras:
        if extra.startswith("threads"):
            overrides.setdefault("cpu", {})["optimizer_threads"] = int(extra[len("threads"):])
    if "service" in extras:
        _through_a_service()
    if args.trace:
        name = variant.replace("+", "-")
        batches = "-".join(str(b) for b in args.batch_sizes)
        overrides["trace"] = {"path": os.path.join(args.trace, f"trace_{name}_b{batches}.json")}
    path = os.path.join(REPO, "configs", f"{policy}.yaml")
    with tiered.init(path, **overrides):
        model = build_model(args)
    engine, optimizer = tiered.initialize(model)

    def step(idx):
        loss = _loss(engine(idx), idx)
        engine.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()
    return engine, step


def _through_a_service() -> None:
    """Have this process's engine take its DRAM from a service of its own, which exits once
    the engine is gone (at this process's exit: kept for no time)."""
    import tempfile

    from tiered.service import ensure_service
    from tiered.service.client import JOB_ENV, SERVICE_ENV

    folder = tempfile.mkdtemp(prefix="tiered-bench-service-")
    ensure_service(folder, keep_seconds=0.0, until_idle=True)
    os.environ[SERVICE_ENV] = folder
    os.environ[JOB_ENV] = "bench"


def _loss(logits, idx):
    import torch.nn.functional as F

    return F.cross_entropy(logits.flatten(0, 1).float(), idx.flatten())


def run_mode(args) -> None:
    """Set the mode up once, then measure each batch size, printing a JSON line for each."""
    import torch

    from tiered.tiers.dram import huge_page_bytes

    torch.manual_seed(0)
    start = time.perf_counter()
    if args.run == "gpu":
        model, step = _run_gpu(args)
    elif args.run == "fsdp2_offload":
        model, step = _run_fsdp2_offload(args)
    else:
        model, step = _run_tiered(args, args.run.split(":", 1)[1])
    setup_s = time.perf_counter() - start
    if hasattr(model, "runtime"):  # the engine holds the parameters
        sizes = [(p.numel, p.trainable) for f in model.runtime.flats for p in f.spec.params]
    else:
        sizes = [(p.numel(), p.requires_grad) for p in model.parameters()]
    n_params = sum(numel for numel, _ in sizes)
    flops_per_token = sum(numel * (6 if trained else 4) for numel, trained in sizes)
    for batch in args.batch_sizes:
        result = dict(mode=args.run, params_B=n_params / 1e9, layers=args.layers, dim=args.dim,
                      batch=batch, seq=args.seq, lora=args.lora, setup_s=setup_s,
                      **_measure(args, model, step, batch, flops_per_token))
        if hasattr(model, "memory_report"):
            result["memory_report"] = model.memory_report()
            # What dram.huge_pages (+thp) got from the kernel, not just what it asked for.
            result["huge_pages_GiB"] = (huge_page_bytes() or 0) / 2**30
            # The plan and the step it predicted from `tiered node`'s rates, if measured here.
            result["plan"] = model.plan_report().to_dict()
        # One line per batch size as soon as it is measured: a larger batch that runs out of
        # memory loses only its own row.
        print(json.dumps(result), flush=True)
    if hasattr(model, "close"):
        model.close()


def _measure(args, model, step, batch: int, flops_per_token: int) -> dict:
    """``args.steps`` steps at ``batch``: the median step after the first ``args.warmup``, and
    the peak of device memory over these steps alone."""
    import torch

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:  # a smaller batch measured before must not leave its blocks or its peak behind
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    idx = torch.randint(0, VOCAB, (batch, args.seq), device="cuda" if cuda else "cpu")
    nvme = getattr(getattr(model, "manager", None), "nvme", None)
    moved = [nvme.bytes_moved()] if nvme is not None else []
    times, losses = [], []
    for _ in range(args.steps):
        sync()
        t = time.perf_counter()
        losses.append(float(step(idx)))
        sync()
        times.append(time.perf_counter() - t)
        io = ""
        if nvme is not None:
            moved.append(nvme.bytes_moved())
            io = ", NVMe read {:.1f} GB, written {:.1f} GB".format(
                *(moved[-1][v] / 1e9 - moved[-2][v] / 1e9 for v in ("read", "write")))
        print(f"{args.run} batch {batch} step {len(times)}: {times[-1]:.3f} s, "
              f"loss {losses[-1]:.4f}{io}", file=sys.stderr, flush=True)
    step_s = statistics.median(times[args.warmup:])
    tokens = batch * args.seq
    result = dict(step_s=step_s, tokens_per_s=tokens / step_s,
                  tflops=flops_per_token * tokens / step_s / 1e12,
                  peak_hbm_GiB=torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
                  times=times, losses=losses)
    if moved:  # the measured steps' NVMe traffic, per step: the last step's update may still
        # be running (in the service, or delayed), so its bytes are counted once it is done
        model.runtime.worker.drain()
        moved[-1] = nvme.bytes_moved()
        measured = len(times) - args.warmup
        result["nvme_GB_per_step"] = {v: (moved[-1][v] - moved[args.warmup][v]) / 1e9 / measured
                                      for v in ("read", "write")}
    return result


def table(results: list[dict], baselines: list[str]) -> str:
    from tiered.core.report import format_table  # here: the parent process imports no torch before

    io = any("nvme_GB_per_step" in r for r in results)
    # The step the plan predicted from the node's rates and the last step's measured compute
    # (engine.plan_report(); `tiered node` must have measured this node).
    predicted = any((r.get("plan") or {}).get("predicted_s") for r in results)
    head = ["mode", "step s", "tokens/s", "TFLOPS", "peak HBM GiB"] + (
        ["predicted s", "measured / predicted"] if predicted else []) + [
        f"x vs {b}" for b in baselines] + (["NVMe GB/step read, written"] if io else [])
    rows = [head]
    by_mode = {r["mode"]: r for r in results if "step_s" in r}
    # A baseline that ran out of memory has no step time to compare with.
    for r in results:
        if "step_s" not in r:
            rows.append([r["mode"], "failed: " + r.get("error", "?")] + [""] * (len(head) - 2))
            continue
        ratios = [f"{by_mode[b]['step_s'] / r['step_s']:.2f}" if b in by_mode else "-"
                  for b in baselines]
        guess = (r.get("plan") or {}).get("predicted_s")
        rows.append([r["mode"], f"{r['step_s']:.3f}", f"{r['tokens_per_s']:,.0f}",
                     f"{r['tflops']:.1f}", f"{r['peak_hbm_GiB']:.1f}"] + (
                    [f"{guess:.3f}", f"{r['step_s'] / guess:.2f}"] if guess else
                    ["-", "-"] if predicted else []) + ratios + (
                    ["{read:.1f}, {write:.1f}".format(**r["nvme_GB_per_step"])
                     if "nvme_GB_per_step" in r else "-"] if io else []))
    return format_table(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--dim", type=int, default=2560)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--batches", default=None, help="several batch sizes, e.g. 4,8")
    parser.add_argument("--trace", default=None, help="folder for tiered's timelines")
    parser.add_argument("--steps", type=int, default=6, help="more than --warmup")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    parser.add_argument("--modes", default="gpu,fsdp2_offload,tiered:cpu")
    parser.add_argument("--nvme", default=None, help="folder for NVMe policies")
    parser.add_argument("--lora", type=int, default=0, help="fine-tune adapters of this rank")
    parser.add_argument("--set", default=None, help="policy keys for every tiered mode, as "
                        """JSON: '{"dram": {"spill": "nvme"}}'""")
    parser.add_argument("--out", default=None, help="write all results as JSON here")
    parser.add_argument("--run", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must be more than --warmup ({args.warmup})")
    args.batch_sizes = [int(b) for b in args.batches.split(",")] if args.batches else [args.batch]
    if args.run:
        run_mode(args)
        return

    results = []
    batches = args.batch_sizes
    for mode in args.modes.split(","):
        cmd = [sys.executable, __file__, "--run", mode, "--layers", str(args.layers),
               "--dim", str(args.dim), "--seq", str(args.seq),
               "--batches", ",".join(map(str, batches)), "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--lora", str(args.lora)] + (
               ["--nvme", args.nvme] if args.nvme else []) + (
               ["--trace", args.trace] if args.trace else []) + (
               ["--set", args.set] if args.set else [])
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        measured = {r["batch"]: r for r in map(json.loads, (
            line for line in proc.stdout.splitlines() if line.startswith("{")))}
        # A mode that fails (a baseline out of memory) has rows for the batch sizes it measured
        # before failing, and a failed row for each of the rest.
        results += [measured.get(batch) or {"mode": mode, "batch": batch,
                                            "error": f"exit {proc.returncode}"}
                    for batch in batches]
    baselines = [m for m in ("gpu", "fsdp2_offload") if m in args.modes.split(",")]
    for batch in batches:
        lora = f", LoRA rank {args.lora}" if args.lora else ""
        print(f"\nbatch {batch}, seq {args.seq}, {args.layers} x {args.dim}{lora}")
        print(table([r for r in results if r["batch"] == batch], baselines))
        for r in results:  # tier: auto's re-plan after the first step, where one ran
            replanned = (r.get("plan") or {}).get("replanned")
            if r["batch"] == batch and replanned:
                print(f"{r['mode']}: {replanned}")
    print(json.dumps(results))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
