"""Convergence on real text, each optimizer setting against plain PyTorch AdamW (issue 21).

    python bench/bench_convergence.py [--steps 400 --modes torch,tiered:fp32,tiered:bf16,...]
        [--out FOLDER]

A byte-level GPT (vocabulary 256; ``--dim 256 --layers 4``, about 3.3 M parameters) learns the
Python standard library's own source files, text no one here wrote: the ``.py`` files at the
top of ``sysconfig``'s stdlib folder, in name order, the last 5% of the bytes held out. Every
mode starts from the same weights and reads the same batches; the validation loss (the same
held-out batches) is taken every ``--every`` steps. Modes:
- ``torch``: the model in fp32 with ``torch.optim.AdamW`` (the reference); ``torch+dpu``: under
  the delayed update's rule (``+dpu40``: after 40 ordinary steps), the rule's own cost;
- ``tiered:fp32``: configs/cpu.yaml in fp32 (bit for bit the reference: a check of the bench);
- ``tiered:bf16``: cpu.yaml in bf16, the one-pass kernel's mixed precision;
- ``tiered:bf16+dpu``: the same with the one-step delayed update (``+dpu40``: after 40
  ordinary steps, its ``warmup_steps``);
- ``+moments-bf16``, ``+moments-int8``, ``+master-bf16`` (with tiered modes, combined with each
  other and with ``+dpu``): the compact optimizer states of issue 21 (``optimizer.moments``,
  ``optimizer.master``).
- ``lora:torch``, ``lora:compute``, ``lora:int8``, ``lora:nf4`` (issue 35): LoRA adapters of
  ``--lora-rank`` on every block's linear layers of a base first trained whole for
  ``--pretrain`` steps (plain PyTorch, fp32, on batches of their own); ``lora:torch`` trains
  them with ``torch.optim.AdamW`` over the fp32 base, the others through tiered in fp32 with
  ``params.frozen_dtype`` compute (bit for bit ``lora:torch``), int8 or nf4 (QLoRA's base);
  each scored against ``lora:torch`` where it runs. With ``--model llama`` the model is a
  Hugging Face Llama of the same width and depth (vocabulary 256, untied head) and the adapters
  are peft's LoRA on every linear layer of its blocks (``lora:torch``: plain peft with
  ``torch.optim.AdamW``).
It prints each mode's final validation loss and its gap to the reference, and writes
``convergence.json`` and the curves as ``convergence.svg`` into ``--out``.
"""
from __future__ import annotations

import argparse
import copy
import functools
import glob
import json
import os
import sys
import sysconfig
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "examples"))

from tiered.core.report import format_table  # noqa: E402

from gpt import GPT, add_lora, next_token_loss  # noqa: E402

OPTIM = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
HELD_OUT = 0.05


def corpus() -> tuple[torch.Tensor, torch.Tensor]:
    """The standard library's top-level sources as bytes: (training, held out)."""
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    data = b"".join(open(path, "rb").read() for path in files)
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    split = int(len(tokens) * (1 - HELD_OUT))
    return tokens[:split], tokens[split:]


def batches(tokens: torch.Tensor, count: int, batch: int, seq: int, seed: int) -> list:
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(tokens) - seq, (count, batch), generator=generator)
    return [torch.stack([tokens[s:s + seq] for s in row]) for row in starts.tolist()]


LLAMA_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_model(args) -> torch.nn.Module:
    """GPT-2's initialization (normal, std 0.02; zero biases): torch's defaults give the tied
    embedding rows a norm of about 16, and the first hundred steps would go to shrinking
    logits of a loss near 40 (ln 256 is 5.5). ``--model llama``: transformers' Llama, whose own
    initialization is that one (initializer_range 0.02); its k and v as wide as q, so that
    every block linear is whole nf4 blocks at a width of 128."""
    torch.manual_seed(0)
    if args.model == "llama":
        import transformers

        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=256, hidden_size=args.dim, intermediate_size=4 * args.dim,
            num_hidden_layers=args.layers, num_attention_heads=max(1, args.dim // 64),
            num_key_value_heads=max(1, args.dim // 64), max_position_embeddings=args.seq,
            tie_word_embeddings=False))
    model = GPT(256, args.dim, args.layers, args.dim // 64, max_seq=args.seq, tied=True)
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(module.weight, std=0.02)
            if getattr(module, "bias", None) is not None:
                torch.nn.init.zeros_(module.bias)
    return model


@functools.cache
def pretrained_base(steps: int, args_key: tuple) -> dict[str, torch.Tensor]:
    """The base LoRA modes adapt: make_model's GPT trained whole for ``steps`` steps by plain
    PyTorch AdamW in fp32, on batches of their own (seed 100), its state dict."""
    args = argparse.Namespace(**dict(args_key))
    model = make_model(args)
    optimizer = torch.optim.AdamW(model.parameters(), fused=True, **dict(OPTIM, lr=args.lr))
    training, _ = corpus()
    for idx in batches(training, steps, args.batch, args.seq, seed=100):
        next_token_loss(logits(model, idx), idx).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


def logits(model: torch.nn.Module, idx: torch.Tensor) -> torch.Tensor:
    """The next-byte logits of ``model`` (a GPT, a Hugging Face causal LM, a peft model of one,
    or an engine of either) on ``idx``."""
    out = model(idx)
    return out if isinstance(out, torch.Tensor) else out.logits


def lora_model(args) -> torch.nn.Module:
    """The pretrained base with adapters on every block's linear layers, the rest frozen."""
    model = make_model(args)
    model.load_state_dict(pretrained_base(args.pretrain, tuple(sorted(vars(args).items()))))
    torch.manual_seed(3)  # the adapters' draws, the same in every mode
    if args.model == "llama":
        import peft

        # peft's B starts at zero, as add_lora's: the draws above are A's
        return peft.get_peft_model(model, peft.LoraConfig(
            r=args.lora_rank, lora_alpha=args.lora_rank, target_modules=LLAMA_LINEARS))
    return add_lora(model, args.lora_rank)


def run(mode: str, args, train: list, held_out: list) -> dict:
    import tiered

    model = lora_model(args) if mode.startswith("lora:") else make_model(args)
    hyper = dict(OPTIM, lr=args.lr)
    evaluated = None  # the weights held out batches are scored on, where not the trained ones
    if mode.startswith("lora:") and mode != "lora:torch":
        engine, optimizer = tiered.initialize(
            model, os.path.join(REPO, "configs", "cpu.yaml"), device="cpu",
            compute_dtype="fp32", optimizer=hyper,
            params={"frozen_dtype": mode.removeprefix("lora:")})
        close = engine.close
    elif mode.startswith("torch") or mode == "lora:torch":
        # fused: the kernel tiered runs, so that tiered:fp32 is this bit for bit
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                      fused=True, **hyper)
        engine, close = model, lambda: None
        _, _, extra = mode.partition("+")
        if extra.startswith("dpu"):  # scored on the latest weights, as engine.eval() gives
            engine, optimizer = _delayed(model, optimizer, int(extra[3:] or 0))
            evaluated = model
    else:
        setting, *extras = mode.removeprefix("tiered:").split("+")
        overrides = dict(device="cpu", compute_dtype=setting, optimizer=hyper)
        for extra in extras:
            if extra.startswith("dpu"):  # "dpu40": after 40 ordinary steps
                overrides["optimizer"]["delayed_update"] = {"enabled": True,
                                                             "warmup_steps": int(extra[3:] or 0)}
            else:  # "moments-int8", "master-bf16"
                key, _, value = extra.partition("-")
                overrides["optimizer"][key] = value
        engine, optimizer = tiered.initialize(model, os.path.join(REPO, "configs", "cpu.yaml"),
                                              **overrides)
        close = engine.close
    def held_out_loss() -> float:
        if hasattr(optimizer, "synchronize"):  # a pending delayed update is finished first
            optimizer.synchronize()
        engine.eval()
        scored = evaluated or engine
        with torch.no_grad():
            loss = sum(next_token_loss(logits(scored, idx), idx).item() for idx in held_out)
        engine.train()
        return loss / len(held_out)

    curve, start = [(0, held_out_loss())], time.perf_counter()
    for step, idx in enumerate(train, start=1):
        next_token_loss(logits(engine, idx), idx).backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % args.every == 0 or step == len(train):
            curve.append((step, held_out_loss()))
            print(f"{mode} step {step}: held-out loss {curve[-1][1]:.4f}", flush=True)
    close()
    return dict(mode=mode, curve=curve, seconds=time.perf_counter() - start)


def _delayed(model: GPT, optimizer: torch.optim.Optimizer, warmup: int):
    """Plain PyTorch under the delayed update's rule (tiered.policy.config.DelayedUpdatePolicy): after
    ``warmup`` ordinary steps, step t's gradient is taken at the weights from before step t-1
    and applied to those after it. The forward runs a copy holding the weights it is due."""
    compute = copy.deepcopy(model)

    class Delayed:
        steps = 0

        def step(self):
            for mine, its in zip(model.parameters(), compute.parameters()):
                mine.grad = its.grad
            before = copy.deepcopy(model.state_dict())
            optimizer.step()
            self.steps += 1
            compute.load_state_dict(model.state_dict() if self.steps <= warmup else before)

        def synchronize(self):
            """As the engine's: the next forward reads the latest weights."""
            compute.load_state_dict(model.state_dict())

        def zero_grad(self):
            compute.zero_grad()
            optimizer.zero_grad()

    return compute, Delayed()


def svg(results: list[dict], path: str) -> None:
    """The held-out loss curves, one polyline a mode, as an SVG file (no plotting library)."""
    width, height, pad = 640, 400, 50
    points = [point for r in results for point in r["curve"]]
    steps = max(step for step, _ in points)
    low, high = min(loss for _, loss in points), max(loss for _, loss in points)
    x = lambda step: pad + (width - 2 * pad) * step / steps  # noqa: E731
    y = lambda loss: height - pad - (height - 2 * pad) * (loss - low) / (high - low)  # noqa
    colors = ["#000000", "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]
    lines = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'font-family="sans-serif" font-size="12">',
             f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" '
             f'stroke="black"/><line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" '
             f'stroke="black"/>',
             f'<text x="{width / 2}" y="{height - 15}" text-anchor="middle">step '
             f'(0 to {steps})</text>',
             f'<text x="15" y="{pad - 15}">held-out loss, {high:.3f} (top) to {low:.3f} '
             f'(bottom)</text>']
    for index, result in enumerate(results):
        color = colors[index % len(colors)]
        polyline = " ".join(f"{x(step):.1f},{y(loss):.1f}" for step, loss in result["curve"])
        lines.append(f'<polyline points="{polyline}" fill="none" stroke="{color}" '
                     f'stroke-width="1.5"/>')
        lines.append(f'<text x="{width - pad - 150}" y="{pad + 16 * index}" fill="{color}">'
                     f'{result["mode"]}</text>')
    lines.append("</svg>")
    with open(path, "w") as file:
        file.write("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--lr", type=float, default=OPTIM["lr"])
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--model", choices=("gpt", "llama"), default="gpt",
                        help="the example GPT, or a Hugging Face Llama of that size")
    parser.add_argument("--held-out-batches", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1, help="of the training batches' order")
    parser.add_argument("--pretrain", type=int, default=300,
                        help="steps the base of the lora: modes is trained whole first")
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--modes", default="torch,tiered:fp32,tiered:bf16,tiered:bf16+dpu,"
                        "tiered:bf16+dpu40")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    training, held = corpus()
    train = batches(training, args.steps, args.batch, args.seq, seed=args.seed)
    held_out = batches(held, args.held_out_batches, args.batch, args.seq, seed=2)
    print(f"{len(training) + len(held):,} bytes of stdlib source, {len(held):,} held out; "
          f"{sum(p.numel() for p in make_model(args).parameters()) / 1e6:.1f} M parameters")
    results = [run(mode, args, train, held_out) for mode in args.modes.split(",")]
    reference = next((r for r in results if r["mode"] in ("torch", "lora:torch")), results[0])
    final = reference["curve"][-1][1]
    rows = [["mode", "held-out loss", "gap to " + reference["mode"], "seconds"]]
    for r in results:
        loss = r["curve"][-1][1]
        rows.append([r["mode"], f"{loss:.4f}", f"{(loss - final) / final:+.2%}",
                     f"{r['seconds']:.0f}"])
    print(format_table(rows))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "convergence.json"), "w") as file:
        json.dump(results, file, indent=1)
    svg(results, os.path.join(args.out, "convergence.svg"))


if __name__ == "__main__":
    main()
