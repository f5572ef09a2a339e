"""``tiered``: the project's own commands.

    tiered check-policy FILE [--nvme PATH]          validate a policy (YAML, or a DeepSpeed
                                                    config) and print it resolved
    tiered policy from-deepspeed FILE [--nvme PATH]  a DeepSpeed config as a tiered policy:
                                                    YAML, what became of each key as comments
    tiered bench-io --nvme PATH [--size 4GiB] [--policy FILE] [--json]   NVMe engine bandwidth,
                                                    and a sweep: a table, or JSON with --json
    tiered daemon start [--dram BYTES] [--nvme PATH] [--keep-failed SECONDS] [--cores LIST]
                        [--foreground]
    tiered daemon status [--json]                   the node's service: its pool, jobs, ranks
    tiered daemon stop
    tiered node [--nvme PATH] [--remeasure] [--json]   this node's rates, measured once, cached
    tiered plan MODEL [--policy FILE] [--nvme PATH] [--ranks N] [--node FILE] [--batch B --seq S]
                      [--lora RANK] [--frozen-dtype compute|int8|nf4] [--checkpointing]
                      [--tile TOKENS] [--json]
                                                    bytes per tier and the predicted step of a
                                                    model (HF config or module:factory)
    tiered version
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch
import yaml

from ..core.errors import TieredError, UsageError
from ..core.sizes import parse_size
from ..core.version import __version__
from ..placement.budgets import this_machine
from ..planning.node import node_rates
from ..policy.config import Policy, resolve, resolve_compute_dtype
from ..policy.kinds import ComputeDtype, Device, FrozenDtype
from ..policy.deepspeed import read_deepspeed
from ..policy.schema import merge
from ..service import service_paths, service_status, start_service, stop_service
from ..service.__main__ import main as run_service
from ..service.server import parse_cores
from ..service.status import status_table
from ..tiers import bench_io
from ..tiers.aio import IoSettings
from .launcher import policy_from_args, warn_if_nvme_unused
from .plan_answer import answer, question_of


def _check_policy(args) -> int:
    # A quoted "~/x" reaches no shell that would expand it (policy_from_args makes it absolute).
    nvme = os.path.expanduser(args.nvme) if args.nvme else None
    policy = policy_from_args(args.file, nvme)
    warn_if_nvme_unused(policy, args.nvme, "tiered")
    # The device and what a rank may hold here, as YAML comments: the output stays a policy.
    notes, refusals = this_machine(policy)
    if policy.compute_dtype is ComputeDtype.AUTO:
        notes.append(f"compute_dtype on this machine: {_compute_dtype_here(policy)[1]}")
    for refusal in refusals:
        print(f"tiered: warning: {refusal}", file=sys.stderr)
    deepspeed = read_deepspeed(args.file)
    if deepspeed is not None:
        print(deepspeed.comments(), end="")
    print("".join(f"# {note}\n" for note in notes), end="")
    print(yaml.safe_dump(policy.to_dict(), sort_keys=False), end="")
    return 0


def _compute_dtype_here(policy: Policy) -> tuple[Policy, str]:
    """``compute_dtype: auto`` made concrete as initialize would make it on this machine (for
    ``tiered plan --node`` of another node too: its file does not say what its device computes
    natively)."""
    on_gpu = policy.device is not Device.CPU and torch.cuda.is_available()
    return resolve_compute_dtype(policy, torch.device("cuda" if on_gpu else "cpu"))


def _from_deepspeed(args) -> int:
    nvme = {"nvme": {"path": os.path.abspath(os.path.expanduser(args.nvme))}} if args.nvme else {}
    translation = read_deepspeed(args.file)
    if translation is None:
        raise UsageError(f"{args.file} is not a DeepSpeed config (it has none of DeepSpeed's "
                         f"keys: zero_optimization, bf16, fp16, train_batch_size, ...): a "
                         f"tiered policy file, which check-policy reads as it is")
    resolve(args.file, nvme)  # what the policy lacks besides the translation (nvme.path)
    print(dataclasses.replace(translation, policy=merge(translation.policy, nvme)).yaml(), end="")
    return 0


def _add_policy(commands) -> None:
    policy = commands.add_parser(
        "policy", help="policy files: from-deepspeed",
        description="Policy files. from-deepspeed: a DeepSpeed config (ds_config.json) as the "
        "tiered policy it runs as, written as YAML with what became of each DeepSpeed key "
        "(honoured, ignored and why, left to the training script) as comments.")
    verbs = policy.add_subparsers(dest="verb", required=True)
    translate = verbs.add_parser("from-deepspeed", help="a DeepSpeed config as a tiered "
                                 "policy (YAML on standard output)")
    translate.add_argument("file", help="DeepSpeed config (JSON)")
    translate.add_argument("--nvme", default=None, metavar="PATH",
                           help="sets nvme.path (where the config gives no nvme_path)")
    translate.set_defaults(run=_from_deepspeed)


def _positive_size(flag: str, value: str) -> int:
    """A size flag's bytes, which must be > 0: the benchmark refused 0 only at its temporary
    file ("cannot reserve 0 B"), naming the file and not the flag."""

    try:
        size = parse_size(value)
    except ValueError as e:
        raise UsageError(f"{flag}: {e}") from None
    if size <= 0:
        raise UsageError(f"{flag} must be > 0, got {value}")
    return size


def _bench_io(args) -> int:
    try:
        policy = policy_from_args(args.policy, args.nvme)
        size = _positive_size("--size", args.size)
        sweep_size = _positive_size("--sweep-size", args.sweep_size)
        if args.repeats < 1:
            raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
        result = bench_io.run(os.path.abspath(os.path.expanduser(args.nvme)), size,
                              min(size, sweep_size),
                              IoSettings(policy.nvme.block_size, policy.nvme.queue_depth),
                              args.repeats)
    except (TieredError, ValueError) as e:
        print(f"tiered: error: {e}", file=sys.stderr)
        return 2
    # JSON alone on standard output when asked, so that it pipes into jq; else the table.
    print(json.dumps(result) if args.json else bench_io.table(result))
    return 0


def _node(args) -> int:
    try:
        nvme = os.path.abspath(os.path.expanduser(args.nvme)) if args.nvme else None
        rates = node_rates(nvme, remeasure=args.remeasure)
    except (TieredError, OSError) as e:
        print(f"tiered: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(dataclasses.asdict(rates)) if args.json else rates.table())
    return 0


def _plan(args) -> int:
    report = answer(question_of(args.model, args.policy, args.nvme, args.ranks, args.node,
                                args.batch, args.seq, args.lora, args.checkpointing,
                                _compute_dtype_here, args.tile, args.frozen_dtype))
    print(json.dumps(report.to_dict()) if args.json else report.table())
    return 0


def _daemon_start(args) -> int:
    try:
        dram = _positive_size("--dram", args.dram) if args.dram is not None else None
        if args.keep_failed is not None and not args.keep_failed >= 0:
            raise UsageError(f"--keep-failed must be >= 0 seconds, got {args.keep_failed}")
        if args.cores is not None:
            parse_cores(args.cores)  # a malformed list is refused here, not in the service
        if args.foreground:  # the service itself, here, as a systemd unit runs it
            return run_service((["--dram", str(dram)] if dram is not None else [])
                               + (["--keep-failed", str(args.keep_failed)]
                                  if args.keep_failed is not None else [])
                               + (["--cores", args.cores] if args.cores is not None else [])
                               + (["--nvme", args.nvme] if args.nvme is not None else []))
        pid = start_service(dram=dram, keep_seconds=args.keep_failed, cores=args.cores,
                            nvme=args.nvme)
    except (TieredError, ValueError) as e:
        print(f"tiered: error: {e}", file=sys.stderr)
        return 2
    print(f"tiered service started (pid {pid}) in {service_paths().folder}")
    return 0


def _daemon_status(args) -> int:
    try:
        status = service_status()
    except TieredError as e:
        print(f"tiered: {e}", file=sys.stderr)
        return 1
    print(json.dumps(status, indent=2) if args.json else status_table(status))
    return 0


def _daemon_stop(args) -> int:
    pid = stop_service()
    if pid is None:
        print(f"no tiered service runs in {service_paths().folder}")
    else:
        print(f"tiered service (pid {pid}) stopped; everything it held is freed")
    return 0


def _add_daemon(commands) -> None:
    daemon = commands.add_parser(
        "daemon", help="the node's tiered service: start, status, stop",
        description="The node's tiered service holds the DRAM pool of every training rank on "
        "the node and keeps a failed job's state for a while. tiered-launch starts one when "
        "none runs (and it exits once its jobs are gone); one started here runs until stopped. "
        "Its folder is $TIERED_RUNTIME_DIR, else $XDG_RUNTIME_DIR/tiered, else "
        "/tmp/tiered-<uid>.")
    verbs = daemon.add_subparsers(dest="verb", required=True)
    start = verbs.add_parser("start", help="start the service in the background")
    start.add_argument("--dram", default=None, metavar="BYTES",
                       help="DRAM it may hand out, all jobs together (default: 7/8 of the "
                       "memory available now)")
    start.add_argument("--nvme", default=None, metavar="PATH",
                       help="the folder on the node's drive its jobs' NVMe files go under: a "
                       "job whose nvme.path is elsewhere is refused (default: any)")
    start.add_argument("--keep-failed", type=float, default=None, metavar="SECONDS",
                       help="how long a failed job's state is kept after its last trainer is "
                       "gone (default: 900)")
    start.add_argument("--cores", default=None, metavar="LIST",
                       help="cores its CPU work runs on, e.g. 0-7,12 (default: those it may "
                       "use); each rank whose update it runs gets its share")
    start.add_argument("--foreground", action="store_true",
                       help="run in this process, logging to standard error (for a systemd "
                       "unit)")
    start.set_defaults(run=_daemon_start)
    status = verbs.add_parser("status", help="the pool, and what each job and rank holds")
    status.add_argument("--json", action="store_true", help="print it as JSON")
    status.set_defaults(run=_daemon_status)
    stop = verbs.add_parser("stop", help="stop the service; everything it holds is freed")
    stop.set_defaults(run=_daemon_stop)


def main(argv: list[str] | None = None) -> int:
    # Help is plain text: the module docstring's ``markup`` is for readers of the code.
    parser = argparse.ArgumentParser(
        prog="tiered", description="The project's own commands (training starts with "
        "tiered-launch): check a policy, measure the NVMe I/O engine, run the node's service, "
        "print the version.")
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check-policy", help="validate a policy and print it resolved")
    check.add_argument("file", help="YAML policy file, or a DeepSpeed config")
    check.add_argument("--nvme", default=None, metavar="PATH", help="sets nvme.path")
    check.set_defaults(run=_check_policy)
    bench = commands.add_parser(
        "bench-io", help="measure the NVMe I/O engine on a file system",
        description="Measure the NVMe I/O engine on a file system: the engine at the policy's "
        "settings, a single stream of plain reads and writes, and a sweep of queue depths and "
        "block sizes. Prints a table, or with --json the results as one JSON object.")
    bench.add_argument("--nvme", required=True, metavar="PATH", help="folder on the drive")
    bench.add_argument("--size", default="4GiB", help="bytes of the main test file")
    bench.add_argument("--sweep-size", default="1GiB", help="bytes per point of the sweep")
    bench.add_argument("--repeats", type=int, default=3,
                       help="runs of each sweep point (its median is reported)")
    bench.add_argument("--policy", default=None, metavar="FILE",
                       help="policy whose nvme.block_size and queue_depth the engine uses")
    bench.add_argument("--json", action="store_true",
                       help="print the results as JSON (alone on standard output) instead of "
                       "the table")
    bench.set_defaults(run=_bench_io)
    node = commands.add_parser(
        "node", help="this node's rates (AdamW, host-device copies, NVMe), measured once",
        description="The rates that decide a training step on this node: the CPU's and the "
        "GPU's AdamW, pinned copies each way and both at once, the NVMe I/O engine's. Measured "
        "once (tens of seconds) and kept in the user's cache folder for this machine and "
        "these library versions.")
    node.add_argument("--nvme", default=None, metavar="PATH",
                      help="a folder on the drive, to measure it too")
    node.add_argument("--remeasure", action="store_true", help="measure again, not the cache")
    node.add_argument("--json", action="store_true", help="print them as JSON")
    node.set_defaults(run=_node)
    plan = commands.add_parser(
        "plan", help="bytes per tier and the predicted step of a model, nothing allocated",
        description="Plan MODEL (a Hugging Face config.json or its folder, or module:factory "
        "called on the meta device) under a policy, as initialize would on rank 0: bytes per "
        "tier against the budgets (the policy's, else the node's memory), where each unit's "
        "states sit, and the step the node's rates predict. No GPU needed.")
    plan.add_argument("model", metavar="MODEL")
    plan.add_argument("--policy", default=None, metavar="FILE", help="the policy (default: "
                      "the built-in defaults, configs/cpu.yaml's)")
    plan.add_argument("--nvme", default=None, metavar="PATH",
                      help="sets nvme.path (a drive of the planned node; not touched)")
    plan.add_argument("--ranks", type=int, default=1, help="ranks on the node (default 1)")
    plan.add_argument("--batch", type=int, default=None, metavar="B",
                      help="sequences a step (with --seq): their activations, counted on fake "
                           "tensors, and the largest batch that fits")
    plan.add_argument("--seq", type=int, default=None, metavar="S", help="tokens a sequence")
    plan.add_argument("--lora", type=int, default=None, metavar="RANK",
                      help="LoRA adapters of RANK on every linear layer (peft), the rest frozen")
    plan.add_argument("--checkpointing", action="store_true", help="a Hugging Face model's "
                      "activation checkpointing on, for --batch's activations")
    plan.add_argument("--tile", type=int, default=None, metavar="TOKENS",
                      help="the MLPs and the loss computed TOKENS tokens at a time "
                           "(tiered.ops.long_sequence), for --batch's activations")
    plan.add_argument("--frozen-dtype", default=None,
                      choices=[dtype.value for dtype in FrozenDtype],
                      help="sets params.frozen_dtype: frozen linear weights (the base of --lora) "
                           "kept and moved quantized, int8 or nf4 (torchao)")
    plan.add_argument("--node", default=None, metavar="FILE", help="another node's rates and "
                      "memory, as `tiered node --json` printed them there (default: this "
                      "node's, if measured)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.set_defaults(run=_plan)
    _add_daemon(commands)
    _add_policy(commands)
    version = commands.add_parser("version", help="print the version")
    version.set_defaults(run=lambda args: print(__version__) or 0)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except TieredError as e:  # bad input, a refusal: one line, not a traceback
        print(f"tiered: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
