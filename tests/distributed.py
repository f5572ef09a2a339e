"""Run a function on several real ranks: one process each, joined by torch.distributed (gloo)."""
from __future__ import annotations

import datetime
import faulthandler
import gc
import os
import socket

import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, environment: dict, fn, args) -> None:
    faulthandler.enable()  # a rank that aborts in C++ still shows where Python was
    # The caller's environment as it is now, not as it was when the fork server started.
    os.environ.clear()
    os.environ.update(environment, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # A rank waiting for a peer that will never come fails the test in two minutes, not 30.
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    try:
        fn(rank, world_size, *args)
    finally:
        # Engines are gone and their groups' last tensors freed before the groups are: gloo's
        # threads must not be left holding tensors for interpreter exit to destroy, which can
        # abort the process (pytorch/pytorch PR 179291 describes it).
        gc.collect()
        dist.destroy_process_group()


def run_ranks(world_size: int, fn, *args) -> None:
    """``fn(rank, world_size, *args)`` on each rank; raises if any rank fails. ``fn`` must be
    importable (a module-level function) and report results through files.

    Ranks fork from a server process that imported torch, torch._dynamo (which the CPU worker
    imports: 5 s a rank here) and tiered once (multiprocessing's forkserver), instead of each
    importing them anew (spawn: 2-4 s a rank on the CI machine, two thirds of a multi-rank
    test). The server itself runs no torch work (importing dynamo starts no thread), so no
    thread pool or process group is forked into a rank."""
    mp.start_processes(_entry, args=(world_size, _free_port(), dict(os.environ), fn, args),
                       nprocs=world_size, join=True, start_method="forkserver")


mp.set_forkserver_preload(["torch", "torch._dynamo", "tiered", "distributed"])
