"""``tiered-launch``: torchrun with an offload policy.

    tiered-launch [--nvme PATH] [--policy FILE] [--nproc-per-node N] [torchrun's flags] train.py [args]

A script resumes with one flag of its own: the example takes ``--checkpoint DIR --resume`` and
calls ``engine.load_checkpoint(DIR)``, which picks up the latest complete checkpoint there.

The policy and the flags are checked here, before any rank starts (a bad file, key, NVMe path or
flag is a one-line error and exit status 2), then the policy is handed to every rank as JSON in
the environment, where ``tiered.initialize(model)`` picks it up. Ranks are started and connected
by ``torch.distributed.run`` itself, so multi-node runs use torchrun's rendezvous unchanged. Each
rank runs the script through ``rank_entry.py``, which makes it die with this launcher, also one
killed with SIGKILL (on Linux; see there).

A signal to the launcher (SIGTERM from a scheduler, SIGINT from Ctrl-C, SIGHUP from a closed
terminal; not under ``nohup``, which ignores it) stops the ranks with the same signal, and
tiered-launch exits 128 + the signal with one line saying so.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import shlex
import signal
import sys
import time

from ..core.errors import NvmeError, TieredError, UsageError
from ..core.limits import usable_cores
from ..engine.engine import LAUNCHED_ENV
from ..policy.config import POLICY_ENV, Policy, resolve
from ..policy.deepspeed import DEEPSPEED_ENV, read_deepspeed
from ..service import JobHold, ensure_service, service_paths, service_status
from ..service.client import JOB_ENV, SERVICE_ENV
from ..tiers.nvme import check_nvme_path
from .rank_entry import LAUNCHER_PID_ENV

NPROC_ALLOWED = "a number >= 1, or auto, cpu, gpu or xpu for one rank per device"
RANK_ENTRY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank_entry.py")


def _parser():
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "tiered-launch"
    parser.description = "Run a training script under torch.distributed.run with a tiered policy."
    parser.add_argument("--policy", default=None, metavar="FILE",
                        help="YAML offload policy, or a DeepSpeed config (default: built-in, "
                        "equal to configs/cpu.yaml)")
    parser.add_argument("--nvme", default=None, metavar="PATH",
                        help="folder for the NVMe tier; sets nvme.path of the policy")
    parser.add_argument("--job", default=None, metavar="NAME",
                        help="the job's name at the node's tiered service (default: "
                        "torchrun's --rdzv-id when given, else a new name per launch)")
    parser.add_argument("--fresh", action="store_true",
                        help="start the job afresh: discard what the node's service kept of "
                        "a failed run of the same --job (by default its ranks go on from the "
                        "last step every rank completed)")
    parser.add_argument("--no-daemon", action="store_true",
                        help="keep every tier in the training processes instead of using "
                        "(or starting) the node's tiered service")
    parser.add_argument("--keep-failed", type=float, default=None, metavar="SECONDS",
                        help="for a service this launch starts: how long it keeps a failed "
                        "job's state (default: 900)")
    return parser


def policy_from_args(policy_file: str | None, nvme: str | None):
    """The policy a command line names (``--policy``, ``--nvme``), with its NVMe path checked;
    raises TieredError (PolicyError, NvmeError) naming the file, key or path."""
    overrides = {"nvme": {"path": os.path.abspath(os.path.expanduser(nvme))}} if nvme else {}
    policy = resolve(policy_file, overrides)
    if policy.uses_nvme:
        assert policy.nvme.path is not None  # a policy that uses NVMe names its path
        try:
            check_nvme_path(policy.nvme.path)
        except NvmeError as e:
            if nvme or not policy_file:
                raise
            raise NvmeError(f"{policy_file}: nvme.path: {e}", errno=e.errno,
                            path=e.path) from None
    return policy


def warn_if_nvme_unused(policy: Policy, nvme: str | None, prog: str) -> None:
    """``--nvme`` only sets nvme.path, which a policy placing nothing on NVMe never reads (nor is
    the folder checked): say so, as the user who passed it likely meant another policy."""
    if nvme and not policy.uses_nvme:
        print(f"{prog}: warning: the policy places nothing on NVMe (params.tier, optimizer.tier "
              f"and dram.spill are not nvme), so --nvme {nvme} is not used", file=sys.stderr)


def _ranks_per_node(nproc_per_node: str) -> int:
    """``--nproc-per-node`` as torchrun reads it; torchrun itself refused 0 with a bare
    AssertionError, and ``abc`` with a traceback."""
    from torch.distributed.run import determine_local_world_size

    try:
        ranks = determine_local_world_size(nproc_per_node)
    except ValueError as e:  # also a device word without the device: "Cuda is not available."
        raise UsageError(f"--nproc-per-node {nproc_per_node!r}: {str(e).rstrip('.')}; "
                         f"allowed: {NPROC_ALLOWED}") from None
    if ranks < 1:
        raise UsageError(f"--nproc-per-node must be {NPROC_ALLOWED}, got {nproc_per_node!r}")
    return ranks


def _check_nnodes(nnodes: str) -> None:
    """torchrun's ``--nnodes``: N, or MIN:MAX for an elastic job."""
    bounds = nnodes.split(":")
    if not (len(bounds) <= 2 and all(b.strip().isdigit() for b in bounds)
            and 0 < int(bounds[0]) <= int(bounds[-1])):
        raise UsageError(f"--nnodes must be N or MIN:MAX with 1 <= MIN <= MAX, got {nnodes!r}")


def _check_torchrun_flags(args) -> int:
    """The torchrun flags that torchrun checks with an AssertionError or a traceback from deep
    inside, and ours beside them; returns the ranks per node."""
    if args.no_daemon and (args.job is not None or args.keep_failed is not None
                           or args.fresh):
        raise UsageError("--job, --fresh and --keep-failed are for the node's tiered service, "
                         "which --no-daemon does not use")
    if args.keep_failed is not None and not args.keep_failed >= 0:
        raise UsageError(f"--keep-failed must be >= 0 seconds, got {args.keep_failed}")
    if args.job is not None and not _JOB_NAME.fullmatch(args.job):
        raise UsageError(f"--job must be 1 to 100 letters, digits, '.', '_' or '-', got "
                         f"{args.job!r}")
    _check_nnodes(args.nnodes)
    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if not args.monitor_interval > 0:
        raise UsageError(f"--monitor-interval must be > 0 seconds, got {args.monitor_interval}")
    return _ranks_per_node(args.nproc_per_node)


_JOB_NAME = re.compile(r"[A-Za-z0-9._-]{1,100}")
"""What the service accepts as a job's name (service/jobs.py)."""


def _torchrun_flags(parser, args) -> str:
    """The torchrun flags this command line sets, as the context of an error torchrun raises."""
    ours = {"policy", "nvme", "training_script", "training_script_args", "job", "no_daemon",
            "keep_failed"}
    return " ".join(f"--{name.replace('_', '-')}" + ("" if value is True else f"={value}")
                    for name, value in vars(args).items()
                    if name not in ours and value != parser.get_default(name))


def _single_node_without_rendezvous(args) -> bool:
    nnodes = str(args.nnodes)
    single = nnodes == "1" or nnodes.split(":")[-1] == "1"
    return (single and not args.rdzv_endpoint and args.rdzv_backend == "static"
            and getattr(args, "master_port", None) in (None, 29500))


def _threads_per_rank(ranks: int) -> int:
    """torchrun would set OMP_NUM_THREADS=1 for several ranks, starving the CPU optimizer; give
    each rank its share of the cores this process may use (affinity and cgroup quota) instead."""
    return max(1, usable_cores() // ranks)


def _through_rank_entry(args) -> None:
    """Have torchrun start ``python -u rank_entry.py MODE SCRIPT ARGS`` for each rank, where it
    would start ``python -u [-m] SCRIPT ARGS`` (or, with --no-python, ``SCRIPT ARGS``)."""
    if args.run_path:
        # torchrun runs the script in a multiprocessing child it starts itself, not from a
        # command line: that rank is left as torchrun starts it.
        return
    mode = "module" if args.module else "program" if args.no_python else "script"
    args.training_script_args = [mode, args.training_script, *args.training_script_args]
    args.training_script = RANK_ENTRY
    args.module = args.no_python = False
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())


class _SaidInOneLine(logging.Filter):
    """torchrun's log lines about stopping the ranks for a signal the launcher got ("Received
    2 death signal, shutting down workers", then "Sending process N closing signal SIGINT" per
    rank): tiered-launch says the same in one line. Its other lines are kept."""

    def __init__(self):
        super().__init__()
        self.stopping = False

    def filter(self, record: logging.LogRecord) -> bool:
        if "death signal" in str(record.msg):
            self.stopping = True
            return False
        return not (self.stopping and "closing signal" in str(record.msg))


def _keep_a_hangup_ignored(args) -> None:
    """torchrun handles SIGHUP (stopping the ranks) even where it is ignored, as under
    ``nohup tiered-launch ...``, whose user asked for the job to outlive the terminal."""
    hangup = getattr(signal, "SIGHUP", None)  # none on Windows
    if hangup is not None and signal.getsignal(hangup) is signal.SIG_IGN:
        args.signals_to_handle = ",".join(name for name in args.signals_to_handle.split(",")
                                          if name.strip() != "SIGHUP")


def _say_stops_in_one_line() -> None:
    said = _SaidInOneLine()
    for name in ("torch.distributed.elastic.agent.server.api",
                 "torch.distributed.elastic.multiprocessing.api"):
        logging.getLogger(name).addFilter(said)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        ranks = _check_torchrun_flags(args)
        policy = policy_from_args(args.policy, args.nvme)
    except TieredError as e:
        print(f"tiered-launch: error: {e}", file=sys.stderr)
        return 2
    warn_if_nvme_unused(policy, args.nvme, "tiered-launch")
    deepspeed = read_deepspeed(args.policy) if args.policy else None
    for line in deepspeed.summary() if deepspeed is not None else ():
        print(f"tiered-launch: note: {line}", file=sys.stderr)
    if deepspeed is not None:
        os.environ[DEEPSPEED_ENV] = os.path.abspath(args.policy)
    if not os.path.exists(args.training_script) and not args.module:
        print(f"tiered-launch: error: training script {args.training_script} does not exist",
              file=sys.stderr)
        return 2

    try:
        hold = None if args.no_daemon else _hold_job_at_the_service(args)
    except TieredError as e:
        print(f"tiered-launch: error: {e} (or train without the node's service: --no-daemon)",
              file=sys.stderr)
        return 2
    try:
        code = _run(parser, args, policy, ranks)
    except BaseException:
        if hold is not None:
            hold.end(clean=False)
        raise
    if hold is not None:
        hold.end(clean=code == 0)
        if code - 128 in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            _say_how_to_go_on(hold.job, sys.argv[1:] if argv is None else argv)
    return code


def _say_how_to_go_on(job: str, argv: list[str]) -> None:
    """After a stop: until when the node's service keeps the job, and the command that goes on
    from it (the same, with its --job)."""

    try:
        keep = service_status()["keep_seconds"]
    except TieredError:  # the service is gone: nothing of the job is kept
        return
    if "--job" not in argv and not any(arg.startswith("--job=") for arg in argv):
        argv = ["--job", job, *argv]
    until = time.strftime("%H:%M:%S", time.localtime(time.time() + keep))
    print(f"tiered-launch: the node's service keeps job {job} until {until}; go on from it "
          f"with: {shlex.join(['tiered-launch', *argv])}", file=sys.stderr)


def _hold_job_at_the_service(args):
    """Find the node's service (start one, which exits once its jobs are gone, when none runs),
    and hold this launch's job there; the ranks learn both from their environment."""

    job = args.job or _job_name(args)
    folder = service_paths().folder
    _, started = ensure_service(folder, keep_seconds=args.keep_failed, until_idle=True)
    if not started and args.keep_failed is not None:
        print(f"tiered-launch: warning: --keep-failed applies to a service this launch starts; "
              f"the one running in {folder} keeps its own setting (tiered daemon status)",
              file=sys.stderr)
    one_node = args.nnodes in ("1", "1:1")  # else the world size is known once they meet
    world = _ranks_per_node(args.nproc_per_node) if one_node else None
    hold = JobHold(folder, job, fresh=args.fresh, world=world)
    print(f"tiered-launch: job {job}", file=sys.stderr)
    if hold.note:
        print(f"tiered-launch: {hold.note}", file=sys.stderr)
    os.environ[SERVICE_ENV] = folder
    os.environ[JOB_ENV] = job
    return hold


def _job_name(args) -> str:
    """A job's name where --job gives none: the rendezvous id; else, on several nodes, one
    every node derives alike (from the rendezvous endpoint and the script), so that their
    launchers hold one job; on one node, a new one."""
    if args.rdzv_id != "none":
        return args.rdzv_id
    if args.nnodes not in ("1", "1:1"):
        shared = f"{args.rdzv_endpoint}\0{os.path.basename(args.training_script)}"
        return f"job-{hashlib.sha256(shared.encode()).hexdigest()[:8]}"
    return f"job-{secrets.token_hex(4)}"


def _run(parser, args, policy: Policy, ranks: int) -> int:
    """torchrun with the policy in the ranks' environment; its exit status, said in one line."""
    os.environ[POLICY_ENV] = json.dumps(policy.to_dict())
    os.environ[LAUNCHED_ENV] = "1"
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads_per_rank(ranks)))
    # torchrun's agent keeps one TCPStore for every round of its rendezvous, and the ranks of
    # a --max-restarts round found the killed round's keys there: gloo then connected to the
    # dead ranks' ports (Connection refused, or a hang; pytorch/pytorch#135712). Unshared, rank
    # 0 of each round hosts a store of its own.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    flags = _torchrun_flags(parser, args)  # as given, before standalone is set for them
    if _single_node_without_rendezvous(args):
        args.standalone = True
    script = args.training_script
    _through_rank_entry(args)

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    _keep_a_hangup_ignored(args)
    _say_stops_in_one_line()
    try:
        run(args)
    except ChildFailedError as e:
        codes = sorted({failure.exitcode for failure in e.failures.values()})
        print(f"tiered-launch: {script} failed on {len(e.failures)} rank(s) "
              f"with exit code(s) {codes}; see the rank's error above", file=sys.stderr)
        return next((c for c in codes if c > 0), 1)
    except SignalException as e:
        # Ctrl-C, a scheduler's SIGTERM or a closed terminal's SIGHUP (torchrun handles each):
        # torchrun has already stopped the ranks with it.
        try:
            print(f"tiered-launch: stopped by {signal.Signals(e.sigval).name}; the ranks were "
                  f"stopped with it", file=sys.stderr)
        except OSError:  # the terminal that closed was our stderr: the exit status says it
            pass
        return 128 + int(e.sigval)
    except (ValueError, AssertionError) as e:
        # The flags torchrun checks only as it starts, before any rank (the rendezvous backend,
        # --redirects, --local-ranks-filter, ...): its message is the clue, its stack is not.
        print(f"tiered-launch: error: torchrun refused {flags or 'its default flags'}: "
              f"{' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
