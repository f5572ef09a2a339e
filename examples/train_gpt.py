"""Train a small GPT through tiered on generated data.

    tiered-launch --nvme "$(mktemp -d)" --policy configs/nvme.yaml examples/train_gpt.py
    ... examples/train_gpt.py --checkpoint ckpt --save-every 50   # checkpoints as it goes
    ... examples/train_gpt.py --checkpoint ckpt --save-every 50 --keep-last 3   # the newest 3
    ... examples/train_gpt.py --checkpoint ckpt --resume          # on from the latest one
    tiered-launch --job NAME ... examples/train_gpt.py   # relaunched after a crash: on from the
                                                         # node's service's kept state
    ... examples/train_gpt.py --lora 8            # adapters only: the rest frozen, weights alone
    ... examples/train_gpt.py --save-pretrained out             # safetensors at the end
    ... examples/train_gpt.py --init-from out --lora 8          # fine-tune from them

The model is built under ``tiered.init`` (never materialized whole), then trained with an
ordinary loop. The data is a random Markov chain over the vocabulary in which every token has a
few likely successors, so the loss falls from ln(vocab) toward the chain's entropy.
"""
import argparse
import os
import sys
import time
from typing import NoReturn

import torch

import tiered  # first: it quiets torch's warning about a missing numpy
from tiered.checkpoint import check_folder

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import GPT, add_lora, next_token_loss  # noqa: E402


def markov_batches(vocab: int, batch: int, seq: int, seed: int):
    """Endless batches from a fixed chain: each token goes to one of 4 successors."""
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab, (vocab, 4), generator=g)
    while True:
        idx = torch.empty(batch, seq, dtype=torch.long)
        idx[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
        for t in range(1, seq):
            choice = torch.randint(0, 4, (batch,), generator=g)
            idx[:, t] = successors[idx[:, t - 1], choice]
        yield idx


def fail(parser: argparse.ArgumentParser, message: str, say: bool = True) -> NoReturn:
    """A refusal in one line (no usage: the flags parsed, what they name is wrong), exit 2."""
    if say:
        print(f"{parser.prog}: error: {message}", file=sys.stderr)
    sys.exit(2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=16, help="global batch, split across ranks")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--checkpoint", default=None,
                        help="folder for checkpoints (made at the first save); checked before "
                             "training starts")
    parser.add_argument("--save-every", type=int, default=0, help="steps between checkpoints")
    parser.add_argument("--keep-last", type=int, default=None, metavar="N",
                        help="keep only the newest N checkpoints, each save removing the older "
                             "ones once it is complete (default: keep all)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest checkpoint in --checkpoint; with none "
                             "there yet it is an error, not a fresh start (leave --resume out "
                             "of the first run)")
    parser.add_argument("--lora", type=int, default=0, metavar="RANK",
                        help="train LoRA adapters of this rank on the blocks' linear layers, "
                             "every other parameter frozen")
    parser.add_argument("--init-from", default=None, metavar="DIR",
                        help="start from these weights (safetensors, as --save-pretrained "
                             "writes them) instead of a random initialization")
    parser.add_argument("--save-pretrained", default=None, metavar="DIR",
                        help="export the trained weights as safetensors at the end")
    args = parser.parse_args()
    for flag, value, least in (("--steps", args.steps, 0), ("--batch", args.batch, 1),
                               ("--seq", args.seq, 2), ("--vocab", args.vocab, 1),
                               ("--dim", args.dim, 1), ("--layers", args.layers, 1),
                               ("--heads", args.heads, 1), ("--save-every", args.save_every, 0),
                               ("--lora", args.lora, 0)):
        if value < least:
            parser.error(f"{flag} must be >= {least}, got {value}")
    if args.keep_last is not None and args.keep_last < 1:
        parser.error(f"--keep-last must be >= 1, got {args.keep_last}")
    if args.dim % args.heads:
        parser.error(f"--heads {args.heads} must divide --dim {args.dim}")
    if (args.resume or args.save_every) and not args.checkpoint:
        parser.error("--resume and --save-every need --checkpoint DIR")
    if args.keep_last is not None and not args.save_every:
        parser.error("--keep-last needs --save-every N")
    if args.checkpoint:
        try:  # not a folder, or not writable: said now, not at the first save
            check_folder(args.checkpoint)
        except tiered.CheckpointError as e:
            fail(parser, f"--checkpoint: {e}")

    torch.manual_seed(0)
    with tiered.init(optimizer={"lr": args.lr}):
        model = GPT(args.vocab, args.dim, args.layers, args.heads, max_seq=args.seq)
        if args.lora:
            add_lora(model, args.lora)
    # Adapters are not in the weights: they start from their own initialization.
    engine, optimizer = tiered.initialize(model, weights=args.init_from,
                                          strict=not args.lora)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if args.batch % world:
        parser.error(f"--batch {args.batch} must be a multiple of the world size {world}")
    per_rank = args.batch // world

    def log(*parts):
        if rank == 0:
            print(*parts, flush=True)

    n_params = sum(f.numel for f in engine.runtime.flats)
    trained = sum(p.numel for f in engine.runtime.flats for p in f.spec.params if p.trainable)
    log(f"GPT {n_params / 1e6:.2f} M params ({trained / 1e6:.2f} M trained), "
        f"{len(engine.runtime.flats)} units, world size {world}, "
        f"compute {engine.policy.compute_dtype.value} on {engine.device}")
    log("placement of the first unit:", engine.placement()[engine.runtime.flats[0].name])

    # steps_taken counts optimizer.step() calls, and this loop makes one per batch: a rank that
    # took its state over from the node's service (its trainer died) goes on where it was.
    first = optimizer.steps_taken + 1
    if engine.reattached:
        log(f"reattached to the service's kept state: on from step {first}")
    elif args.resume:
        try:
            tag = engine.load_checkpoint(args.checkpoint)
        except tiered.CheckpointError as e:
            # Every rank refuses alike (a load's checks are agreed among ranks): rank 0 says it.
            # A --resume with no checkpoint to resume from most likely names the wrong folder;
            # starting afresh would train from scratch and save beside what the user meant.
            fail(parser, f"--resume: {e}", say=rank == 0)
        first = optimizer.steps_taken + 1
        log(f"resumed from {args.checkpoint}/{tag} at step {first}")
    data = markov_batches(args.vocab, args.batch, args.seq, seed=1)
    for _ in range(first - 1):  # the batches the resumed steps already saw
        next(data)
    log(f"training steps {first} to {args.steps} (--steps), the loss at the first and every "
        f"20th")
    start = time.perf_counter()
    for step in range(first, args.steps + 1):
        idx = next(data)[rank * per_rank:(rank + 1) * per_rank].to(engine.device)
        loss = next_token_loss(engine(idx), idx)
        engine.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if step % 20 == 0 or step == first:
            elapsed = time.perf_counter() - start
            log(f"step {step:4d}  loss {loss.item():.4f}  "
                f"{(step - first + 1) * args.batch * args.seq / elapsed:,.0f} tokens/s")
        if args.checkpoint and args.save_every and step % args.save_every == 0:
            engine.save_checkpoint(args.checkpoint, keep_last=args.keep_last)

    if args.save_pretrained:
        engine.save_pretrained(args.save_pretrained)
        log(f"weights saved to {args.save_pretrained}")
    log("memory report (bytes):")
    for tier, usage in engine.memory_report().items():
        log(f"  {tier:5s} current {usage['current']:>12,}  peak {usage['peak']:>12,}  "
            f"budget {usage['budget'] if usage['budget'] is None else format(usage['budget'], ',')}")
    engine.close()


if __name__ == "__main__":
    main()
