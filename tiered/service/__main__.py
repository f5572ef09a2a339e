"""``python -m tiered.service``: run the node's tier service in the foreground (what ``tiered
daemon start`` runs in the background, and a systemd unit runs directly; see daemon/)."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from ..core.errors import TieredError
from ..core.sizes import parse_size
from ..tiers.dram import default_budget
from .paths import default_folder, service_paths
from .server import KEEP_SECONDS, ServiceConfig, TierService, parse_cores, run, serve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tiered.service",
                                     description="Run the node's tiered service.")
    parser.add_argument("--folder", default=None, help="service folder (socket, lock, log)")
    parser.add_argument("--dram", default=None,
                        help="bytes of DRAM the service may hand out (default: 7/8 of the "
                        "memory available now)")
    parser.add_argument("--keep-failed", type=float, default=KEEP_SECONDS,
                        metavar="SECONDS",
                        help="how long a failed job's state is kept after its last trainer "
                        "is gone (default: 900)")
    parser.add_argument("--cores", default=None, metavar="LIST",
                        help="cores its CPU work runs on, e.g. 0-7,12 (default: those it may "
                        "use); each hosted rank gets its share")
    parser.add_argument("--nvme", default=None, metavar="PATH",
                        help="the folder its jobs' NVMe files go under (default: any)")
    parser.add_argument("--until-idle", action="store_true",
                        help="exit once the jobs served are gone and nothing is held")
    parser.add_argument("--background", action="store_true",
                        help="detach (a session of its own, output to the folder's "
                        "service.log); print the pid once it serves")
    args = parser.parse_args(argv)
    try:
        dram = parse_size(args.dram) if args.dram is not None else default_budget(1)
        if args.keep_failed < 0:
            raise ValueError(f"--keep-failed must be >= 0 seconds, got {args.keep_failed}")
        config = ServiceConfig(args.folder or default_folder(), dram, args.keep_failed,
                               args.until_idle,
                               parse_cores(args.cores) if args.cores is not None else None,
                               os.path.abspath(os.path.expanduser(args.nvme))
                               if args.nvme is not None else None)
    except (TieredError, ValueError) as e:
        print(f"tiered service: error: {e}", file=sys.stderr)
        return 2
    if args.background:
        return _in_background(config)
    _log_to_stderr()
    try:
        return run(config)
    except TieredError as e:
        print(f"tiered service: error: {e}", file=sys.stderr)
        return 2


def _log_to_stderr() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s tiered-service %(levelname)s %(message)s")


def _in_background(config: ServiceConfig) -> int:
    """Fork a service that is no child of whoever started this (a launcher's process tree, a
    scheduler's kill of its process group and its wait for its children must not include the
    service: a failed job's state outlives them). The parent waits for the child's word: its
    pid once it serves, or why it could not."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid:
        os.close(write_end)
        with os.fdopen(read_end, "rb") as word:
            said = word.read().decode(errors="replace")
        if said.startswith("ready"):
            print(pid)
            return 0
        os.waitpid(pid, 0)
        print(f"tiered service: error: {said or 'it exited before serving'}", file=sys.stderr)
        return 2
    os.close(read_end)
    os.setsid()
    try:
        paths = service_paths(config.folder, create=True)
        log = os.open(paths.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.fchmod(log, 0o600)  # a log kept from before (or made by hand) may be looser
        nothing = os.open(os.devnull, os.O_RDONLY)
        os.dup2(nothing, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(nothing)
        os.close(log)
        _log_to_stderr()
        service = TierService(config)
    except BaseException as e:
        os.write(write_end, str(e).encode())
        os._exit(2)  # the parent reports it; nothing of the parent's may run here
    os.write(write_end, b"ready")
    os.close(write_end)
    code = serve(service)
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
