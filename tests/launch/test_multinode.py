"""Two nodes on one machine: two launchers (``--nnodes 2``, ``--node-rank 0`` and ``1``, a
rendezvous on localhost), each with a node's service of its own (its own runtime folder, as each
node has), train tests/scripts/launch_train.py at world size 2. They must compute what one node
of two ranks computes, bit for bit (the same gradients averaged over the same ranks, the same
AdamW), and what PyTorch's AdamW computes on the whole batch in one process.

Each node here has one core, as each rank of the one node of two has: a rank takes its node's
share of the cores as intra-op threads, and torch's CPU kernels sum in an order that depends on
their thread count, so two nodes of two cores each (two threads a rank) differ from one node of
two cores (one a rank) in the last bits, which AdamW then carries on (the likely source of the
3.3322 against 3.3317 seen between the two layouts' bf16 losses at step 20). Nothing else differs: the update runs in the trainer on
several nodes (the service hosts a rank's CPU side only when every rank of the job is on its
node) and in the service on one, with the same kernels."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from tiered.engine.engine import LAUNCHED_ENV
from tiered.policy.config import POLICY_ENV, Policy
from tiered.service.paths import RUNTIME_ENV

from helpers import REPO, finish, train_reference, write_policy

SCRIPT = REPO / "tests" / "scripts" / "launch_train.py"
CORES = sorted(os.sched_getaffinity(0))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_launcher(runtime: Path, *args, cores: set[int] | None = None) -> subprocess.Popen:
    """``tiered-launch args`` as a node of its own: its service lives in ``runtime``; with
    ``cores``, the node has only those (its launcher, and so its ranks, bound to them)."""
    env = {k: v for k, v in os.environ.items()
           if k not in (POLICY_ENV, LAUNCHED_ENV, "OMP_NUM_THREADS")}
    env[RUNTIME_ENV] = str(runtime)
    return subprocess.Popen([sys.executable, "-m", "tiered.launch.launcher", *map(str, args)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=None if cores is None else
                            lambda: os.sched_setaffinity(0, cores))


def test_two_nodes_train_as_one_node_of_two_ranks_and_as_pytorch(tmp_path):
    policy_file = write_policy(tmp_path / "train.yaml", "cpu", compute_dtype="fp32",
                               device="cpu", optimizer={"lr": 1e-2, "betas": [0.8, 0.99],
                                                        "eps": 1e-3, "weight_decay": 0.1})
    port = free_port()
    outs = {name: tmp_path / name for name in ("nodes", "node")}
    for out in outs.values():
        out.mkdir()
    nodes = [start_launcher(tmp_path / f"runtime{node}", "--nnodes", 2, "--node-rank", node,
                            "--nproc-per-node", 1, "--master-addr", "127.0.0.1",
                            "--master-port", port, "--policy", policy_file, SCRIPT,
                            outs["nodes"], cores={node % len(CORES)})
             for node in (0, 1)]
    one_node = start_launcher(tmp_path / "runtime", "--nproc-per-node", 2, "--policy",
                              policy_file, SCRIPT, outs["node"])
    runs = [finish(process, timeout=240) for process in (*nodes, one_node)]
    for run in runs:
        assert run.returncode == 0, run.stderr

    seen = [json.loads((outs["nodes"] / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [(info["rank"], info["world"]) for info in seen] == [(0, 2), (1, 2)]
    # The nodes' launchers derive one job name, each held at its own node's service.
    assert seen[0]["service_job"] is not None
    assert seen[0]["service_job"] == seen[1]["service_job"]
    assert sorted(os.listdir(tmp_path / "runtime0")) == sorted(os.listdir(tmp_path / "runtime1"))

    two_nodes = [torch.load(outs["nodes"] / f"rank{rank}.pt") for rank in (0, 1)]
    one_node_of_two = torch.load(outs["node"] / "rank0.pt")
    policy = Policy.from_yaml(policy_file)
    reference = train_reference(policy)
    for key, expected in reference.items():
        assert torch.equal(two_nodes[0][key], two_nodes[1][key]), key
        assert torch.equal(two_nodes[0][key], one_node_of_two[key]), key
        torch.testing.assert_close(two_nodes[0][key], expected, rtol=0, atol=1e-5, msg=key)
