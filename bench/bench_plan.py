"""How long ``tiered plan`` takes on the issue's examples (issue 33, item 2).

    python bench/bench_plan.py [--repeats 2] [--repo PATH] [--nvme PATH] [--only NAME]

Times ``tiered plan`` as a user runs it, a fresh process each time, on configs of Llama-3-8B's
and Llama-2-70B's shapes (written here from their published dimensions: nothing is
downloaded): the 8B on this node (the default policy, batch 1 x 4096: it does not fit a small
machine, so the answer plans what would make it fit too), the 8B under ``configs/auto.yaml`` on
the reference node (bench/node_h100.json), and docs/planner.md's 70B LoRA example. Each row is the
best of ``--repeats`` runs: wall-clock seconds, and the CPU seconds the process used (user and
system; on a machine shared with other work the wall clock is the CPU time stretched by the
load, so both are shown), and the answer's verdict line. ``--repo`` times another checkout of
tiered (an older commit, made with ``git worktree add``) with this environment's packages.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LLAMA_3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 8,
              "max_position_embeddings": 8192, "vocab_size": 128256, "rms_norm_eps": 1e-5,
              "rope_theta": 500000.0, "hidden_act": "silu", "tie_word_embeddings": False,
              "torch_dtype": "bfloat16"}
LLAMA_2_70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
               "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
               "num_attention_heads": 64, "num_key_value_heads": 8,
               "max_position_embeddings": 4096, "vocab_size": 32000, "rms_norm_eps": 1e-5,
               "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
               "torch_dtype": "bfloat16"}


def config_folder(root: str, name: str, config: dict) -> str:
    folder = os.path.join(root, name)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as file:
        json.dump(config, file)
    return folder


def examples(root: str, nvme: str, repo: str) -> dict[str, list[str]]:
    """The examples' arguments, with the policy and node files of the checkout ``repo``."""
    llama_8b = config_folder(root, "llama-3-8b", LLAMA_3_8B)
    llama_70b = config_folder(root, "llama-2-70b", LLAMA_2_70B)
    node = os.path.join(repo, "bench", "node_h100.json")
    auto = os.path.join(repo, "configs", "auto.yaml")
    return {
        "8B, this node, batch 1 x 4096": [llama_8b, "--batch", "1", "--seq", "4096"],
        "8B, auto on the reference node": [llama_8b, "--policy", auto, "--node", node,
                                           "--batch", "1", "--seq", "4096"],
        "70B LoRA r16 (README)": [llama_70b, "--policy", auto, "--nvme", nvme, "--node", node,
                                  "--batch", "1", "--seq", "4096", "--lora", "16",
                                  "--checkpointing"],
    }


def timed(repo: str, args: list[str], cache: str) -> tuple[float, float, str]:
    """Wall seconds, CPU seconds and the last line of one ``tiered plan`` run in ``repo``."""
    env = dict(os.environ, PYTHONPATH=repo, TIERED_CACHE=cache)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "tiered.launch.cli", "plan", *args],
                          cwd=repo, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"tiered plan {' '.join(args)} failed:\n{done.stderr}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done.stdout.strip().splitlines()[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--repo", default=REPO, help="the checkout of tiered to time")
    parser.add_argument("--nvme", default=os.path.join(tempfile.gettempdir(), "tiered-nvme"),
                        help="the 70B example's --nvme (planned, never written)")
    parser.add_argument("--only", default=None, help="time the examples whose name has this")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        cache = os.path.join(root, "cache")  # no node measured: the same answer anywhere
        repo = os.path.abspath(args.repo)
        for name, plan_args in examples(root, args.nvme, repo).items():
            if args.only and args.only not in name:
                continue
            runs = [timed(repo, plan_args, cache)
                    for _ in range(args.repeats)]
            wall, cpu, last = min(runs)
            print(f"{name}: {wall:.1f} s wall, {cpu:.1f} s CPU (best of {args.repeats}); "
                  f"{last}", flush=True)


if __name__ == "__main__":
    main()
