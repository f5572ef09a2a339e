"""``tiered-launch``: torchrun with an offload policy.

    tiered-launch [--nvme PATH] [--policy FILE] [--nproc-per-node N] [torchrun's flags] train.py [args]

A script resumes with one flag of its own: the example takes ``--checkpoint DIR --resume`` and
calls ``engine.load_checkpoint(DIR)``, which picks up the latest complete checkpoint there.

The policy is loaded and checked here, before any rank starts (a bad file, key or NVMe path is a
one-line error and exit status 2), then handed to every rank as JSON in the environment, where
``tiered.initialize(model)`` picks it up. Ranks are started and connected by
``torch.distributed.run`` itself, so multi-node runs use torchrun's rendezvous unchanged.
"""
from __future__ import annotations

import json
import os
import sys

from .engine.engine import LAUNCHED_ENV
from .errors import TieredError
from .limits import usable_cores
from .policy import POLICY_ENV, resolve
from .tiers.nvme import check_nvme_path


def _parser():
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "tiered-launch"
    parser.description = "Run a training script under torch.distributed.run with a tiered policy."
    parser.add_argument("--policy", default=None, metavar="FILE",
                        help="YAML offload policy (default: built-in, equal to configs/cpu.yaml)")
    parser.add_argument("--nvme", default=None, metavar="PATH",
                        help="folder for the NVMe tier; sets nvme.path of the policy")
    return parser


def policy_from_args(policy_file: str | None, nvme: str | None):
    """The policy a command line names (``--policy``, ``--nvme``), with its NVMe path checked;
    raises TieredError (PolicyError, NvmeError) naming the file, key or path."""
    overrides = {"nvme": {"path": os.path.abspath(nvme)}} if nvme else {}
    policy = resolve(policy_file, overrides)
    if policy.uses_nvme:
        check_nvme_path(policy.nvme.path)
    return policy


def _single_node_without_rendezvous(args) -> bool:
    nnodes = str(args.nnodes)
    single = nnodes == "1" or nnodes.split(":")[-1] == "1"
    return (single and not args.rdzv_endpoint and args.rdzv_backend == "static"
            and getattr(args, "master_port", None) in (None, 29500))


def _threads_per_rank(nproc_per_node: str) -> int:
    """torchrun would set OMP_NUM_THREADS=1 for several ranks, starving the CPU optimizer; give
    each rank its share of the cores this process may use (affinity and cgroup quota) instead."""
    ranks = int(nproc_per_node) if str(nproc_per_node).isdigit() else 1
    return max(1, usable_cores() // max(1, ranks))


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        policy = policy_from_args(args.policy, args.nvme)
    except TieredError as e:
        print(f"tiered-launch: error: {e}", file=sys.stderr)
        return 2
    if not os.path.exists(args.training_script) and not args.module:
        print(f"tiered-launch: error: training script {args.training_script} does not exist",
              file=sys.stderr)
        return 2

    os.environ[POLICY_ENV] = json.dumps(policy.to_dict())
    os.environ[LAUNCHED_ENV] = "1"
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads_per_rank(args.nproc_per_node)))
    if _single_node_without_rendezvous(args):
        args.standalone = True

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    try:
        run(args)
    except ChildFailedError as e:
        codes = sorted({failure.exitcode for failure in e.failures.values()})
        print(f"tiered-launch: {args.training_script} failed on {len(e.failures)} rank(s) "
              f"with exit code(s) {codes}; see the rank's error above", file=sys.stderr)
        return next((c for c in codes if c > 0), 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
