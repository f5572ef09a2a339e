"""TieredTrainer against Hugging Face's plain Trainer (and, where DeepSpeed is installed, Trainer
with DeepSpeed ZeRO-3 CPU offload) on the same Llama, data and TrainingArguments, in one run.

    python bench/bench_hf_trainer.py [--layers 4 --dim 512 --seq 256 --batch 4]
        [--steps 8] [--policy configs/cpu.yaml [--nvme PATH]] [--bf16]
        [--modes plain,tiered[,deepspeed]]

The Llama is built from a config (no download), fp32 unless --bf16. Each mode trains --steps
optimizer steps in this process, one after the other; seconds per step are the median over the
steps after the first two (compile, first touch). The table gives each mode's s/step, its speed
against the first mode's and its peak GPU memory (on a GPU). tiered builds its model under
``tiered.init``; the others build it whole, in fp32.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

import tiered  # noqa: E402
from tiered import Policy  # noqa: E402
from tiered.integrations.transformers import TieredTrainer  # noqa: E402

WARMUP = 2
"""Steps left out of the median: the first compiles and touches every page."""

ZERO3_OFFLOAD = {
    "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                          "offload_optimizer": {"device": "cpu", "pin_memory": True}},
    "bf16": {"enabled": "auto"}, "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
}
"""The DeepSpeed baseline: ZeRO-3 with parameters and optimizer offloaded to pinned CPU memory."""


class StepTimes(TrainerCallback):
    def __init__(self):
        self.times: list[float] = []
        self._start = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self._start)


def model_of(args, policy: Policy | None = None) -> LlamaForCausalLM:
    """The benchmark Llama; with ``policy``, built under ``tiered.init`` (nothing allocated:
    a 7 B model is never materialized whole)."""
    torch.manual_seed(0)
    if policy is not None:
        with tiered.init(policy):
            return model_of(args)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.dim, intermediate_size=args.dim * 8 // 3,
        num_hidden_layers=args.layers, num_attention_heads=max(1, args.dim // 64),
        max_position_embeddings=args.seq, tie_word_embeddings=False))


def run(mode: str, args, data, folder: str) -> tuple[float, int | None]:
    training = TrainingArguments(
        output_dir=os.path.join(folder, mode), max_steps=args.steps,
        per_device_train_batch_size=args.batch, learning_rate=1e-4, max_grad_norm=1.0,
        weight_decay=0.1, logging_steps=args.steps, save_strategy="no", report_to="none",
        disable_tqdm=True, bf16=args.bf16, use_cpu=not torch.cuda.is_available(),
        deepspeed=ZERO3_OFFLOAD if mode == "deepspeed" else None)
    timer = StepTimes()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    if mode == "tiered":
        overrides = {"nvme": {"path": args.nvme}} if args.nvme else {}
        if args.delayed:
            overrides["optimizer"] = {"delayed_update": {"enabled": True}}
        policy = Policy.from_yaml(args.policy, overrides)
        trainer = TieredTrainer(model=model_of(args, policy), args=training, train_dataset=data,
                                callbacks=[timer], policy=policy)
    else:
        trainer = Trainer(model=model_of(args), args=training, train_dataset=data,
                          callbacks=[timer])
    trainer.train()
    if mode == "tiered":
        trainer.engine.close()
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    return statistics.median(timer.times[WARMUP:]), peak


def llama_arguments(parser: argparse.ArgumentParser, modes: str) -> None:
    """The benchmark Llama's shape, its batches, the policy and the modes (``modes``: their
    default), as the Llama benchmarks take them (this one and bench_quantized.py)."""
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--policy", default=os.path.join(REPO, "configs", "cpu.yaml"))
    parser.add_argument("--nvme", default=None, help="nvme.path, for a policy that names NVMe")
    parser.add_argument("--modes", default=modes)
    parser.add_argument("--bf16", action="store_true")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    llama_arguments(parser, modes="plain,tiered")
    parser.add_argument("--delayed", action="store_true",
                        help="tiered with the delayed update (optimizer.delayed_update)")
    args = parser.parse_args()
    if args.steps <= WARMUP:
        parser.error(f"--steps must be more than {WARMUP} (the warm-up steps left out)")
    tokens = torch.randint(0, args.vocab, (args.batch * args.steps, args.seq),
                           generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in tokens]
    parameters = sum(p.numel() for p in model_of(args).parameters())
    print(f"Llama {parameters / 1e6:.1f} M parameters, batch {args.batch} x {args.seq}, "
          f"{'bf16' if args.bf16 else 'fp32'}, {args.steps} steps, policy {args.policy}")
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for mode in args.modes.split(","):
            results[mode] = run(mode, args, data, folder)
    first = next(iter(results))
    base = results[first][0]
    print(f"{'mode':<10} {'s/step':>8} {'speed vs ' + first:>17} {'peak GPU GiB':>13}")
    for mode, (seconds, peak) in results.items():
        gib = f"{peak / 2**30:.1f}" if peak is not None else "-"
        print(f"{mode:<10} {seconds:>8.3f} {base / seconds:>16.2f}x {gib:>13}")


if __name__ == "__main__":
    main()
