"""A LoRA step of a small Llama over a frozen base kept in the compute dtype, int8 or nf4
(``params.frozen_dtype``, issue 35), in one run.

    python bench/bench_quantized.py [--layers 4 --dim 512 --seq 256 --batch 4 --rank 16]
        [--steps 8] [--policy configs/cpu.yaml [--nvme PATH]] [--bf16]
        [--modes compute,int8,nf4]

The Llama (built from a config under ``tiered.init``, no download) gets peft's LoRA adapters
of ``--rank`` on every linear layer of its blocks (q, k, v, o, gate, up, down); everything
else is frozen. ``--dim`` must make its weights whole numbers of nf4's 64 x 256 blocks (a
multiple of 128: ``dim x dim`` and the MLP's ``dim x 8/3 dim`` rounded to 128). Each mode
trains ``--steps`` optimizer steps through ``tiered.initialize`` in this process, one mode
after the other; seconds per step are the median over the steps after the first two. The
table gives each mode's s/step against the first mode's, and the bytes each tier holds after
the last step (``engine.memory_report()``: DRAM, NVMe; HBM on a GPU), and the frozen units'
share of them as the plan places it (their records' bytes where quantized). On a CPU the
per-unit dequantization is on the step's path as it is on a GPU.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import tiered  # noqa: E402
from tiered import Policy  # noqa: E402
from tiered.core.report import format_table  # noqa: E402

from bench_hf_trainer import llama_arguments  # noqa: E402

WARMUP = 2
"""Steps left out of the median: the first touches every page (and torchao's first call)."""
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_llama(args, policy: Policy):
    """The benchmark Llama with peft's adapters, built under ``tiered.init`` (nothing
    allocated until initialize)."""
    torch.manual_seed(0)
    with tiered.init(policy):
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=args.vocab, hidden_size=args.dim,
            intermediate_size=-(-args.dim * 8 // 3 // 128) * 128,
            num_hidden_layers=args.layers, num_attention_heads=max(1, args.dim // 64),
            max_position_embeddings=args.seq, tie_word_embeddings=False))
        return get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=2 * args.rank,
                                                target_modules=TARGETS))


def run(mode: str, args, batches: list[torch.Tensor]) -> dict:
    overrides = {"params": {"frozen_dtype": mode}, "optimizer": {"lr": 1e-4},
                 "compute_dtype": "bf16" if args.bf16 else "fp32"}
    if args.nvme:
        overrides["nvme"] = {"path": args.nvme}
    policy = Policy.from_yaml(args.policy, overrides)
    engine, optimizer = tiered.initialize(lora_llama(args, policy), policy)
    times, losses = [], []
    try:
        for idx in batches:
            start = time.perf_counter()
            loss = engine(input_ids=idx, labels=idx).loss
            engine.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if engine.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            losses.append(loss.item())
        report = engine.memory_report()
        plan = engine.manager.current_plan
        frozen = {flat.spec.index for flat in engine.runtime.flats if not flat.has_trainable}
        frozen_bytes = sum(buffer.nbytes for (index, _), buffer in plan.shards.items()
                           if index in frozen)
        quantized = sum(flat.record is not None for flat in engine.runtime.flats)
    finally:
        engine.close()
    return dict(mode=mode, seconds=statistics.median(times[WARMUP:]), losses=losses,
                dram=report["dram"]["current"], nvme=report["nvme"]["current"],
                hbm=report["hbm"]["peak"] if engine.device.type == "cuda" else None,
                frozen=frozen_bytes, quantized=quantized)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    llama_arguments(parser, modes="compute,int8,nf4")
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    if args.steps <= WARMUP:
        parser.error(f"--steps must be more than {WARMUP} (the warm-up steps left out)")
    if args.dim % 128:
        parser.error("--dim must be a multiple of 128: nf4 takes whole 64 x 256 blocks")
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)
               for _ in range(args.steps)]
    print(f"Llama {args.layers} x {args.dim}, LoRA r{args.rank} on every block linear, batch "
          f"{args.batch} x {args.seq}, {'bf16' if args.bf16 else 'fp32'}, {args.steps} steps, "
          f"policy {args.policy}")
    results = [run(mode, args, batches) for mode in args.modes.split(",")]
    base = results[0]["seconds"]
    rows = [["frozen", "s/step", f"speed vs {results[0]['mode']}", "quantized units",
             "frozen MiB", "DRAM MiB", "NVMe MiB", "peak HBM MiB", "first loss"]]
    for r in results:
        rows.append([r["mode"], f"{r['seconds']:.3f}", f"{base / r['seconds']:.2f}x",
                     str(r["quantized"]), f"{r['frozen'] / 2**20:.1f}",
                     f"{r['dram'] / 2**20:.1f}", f"{r['nvme'] / 2**20:.1f}",
                     f"{r['hbm'] / 2**20:.1f}" if r["hbm"] is not None else "-",
                     f"{r['losses'][0]:.4f}"])
    print(format_table(rows))


if __name__ == "__main__":
    main()
