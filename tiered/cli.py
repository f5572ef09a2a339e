"""``tiered``: the project's own commands.

    tiered check-policy FILE [--nvme PATH]   validate a policy and print it resolved, with defaults
    tiered version
"""
from __future__ import annotations

import argparse
import sys

import yaml

from . import __version__
from .errors import TieredError
from .launch import policy_from_args


def _check_policy(args) -> int:
    try:
        policy = policy_from_args(args.file, args.nvme)
    except TieredError as e:
        print(f"tiered: error: {e}", file=sys.stderr)
        return 2
    print(yaml.safe_dump(policy.to_dict(), sort_keys=False), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tiered", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check-policy", help="validate a policy and print it resolved")
    check.add_argument("file", help="YAML policy file")
    check.add_argument("--nvme", default=None, metavar="PATH", help="sets nvme.path")
    check.set_defaults(run=_check_policy)
    version = commands.add_parser("version", help="print the version")
    version.set_defaults(run=lambda args: print(__version__) or 0)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
