"""``tiered``: the project's own commands.

    tiered check-policy FILE [--nvme PATH]          validate a policy and print it resolved
    tiered bench-io --nvme PATH [--size 4GiB] [--policy FILE] [--json]   NVMe engine bandwidth,
                                                    and a sweep: a table, or JSON with --json
    tiered version
"""
from __future__ import annotations

import argparse
import os
import sys

import yaml

from . import __version__
from .errors import TieredError, UsageError
from .launch import policy_from_args, warn_if_nvme_unused


def _check_policy(args) -> int:
    from .manager import this_machine

    # A quoted "~/x" reaches no shell that would expand it (policy_from_args makes it absolute).
    nvme = os.path.expanduser(args.nvme) if args.nvme else None
    try:
        policy = policy_from_args(args.file, nvme)
    except TieredError as e:
        print(f"tiered: error: {e}", file=sys.stderr)
        return 2
    warn_if_nvme_unused(policy, args.nvme, "tiered")
    # The device and what a rank may hold here, as YAML comments: the output stays a policy.
    notes, refusals = this_machine(policy)
    for refusal in refusals:
        print(f"tiered: warning: {refusal}", file=sys.stderr)
    print("".join(f"# {note}\n" for note in notes), end="")
    print(yaml.safe_dump(policy.to_dict(), sort_keys=False), end="")
    return 0


def _positive_size(flag: str, value: str) -> int:
    """A size flag's bytes, which must be > 0: the benchmark refused 0 only at its temporary
    file ("cannot reserve 0 B"), naming the file and not the flag."""
    from .sizes import parse_size

    try:
        size = parse_size(value)
    except ValueError as e:
        raise UsageError(f"{flag}: {e}") from None
    if size <= 0:
        raise UsageError(f"{flag} must be > 0, got {value}")
    return size


def _bench_io(args) -> int:
    import json

    from .tiers import bench_io
    from .tiers.aio import IoSettings

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


def main(argv: list[str] | None = None) -> int:
    # Help is plain text: the module docstring's ``markup`` is for readers of the code.
    parser = argparse.ArgumentParser(
        prog="tiered", description="The project's own commands (training starts with "
        "tiered-launch): check a policy, measure the NVMe I/O engine, print the version.")
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check-policy", help="validate a policy and print it resolved")
    check.add_argument("file", help="YAML policy file")
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
    version = commands.add_parser("version", help="print the version")
    version.set_defaults(run=lambda args: print(__version__) or 0)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
