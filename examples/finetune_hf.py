"""Fine-tune a Hugging Face causal LM with TieredTrainer, offline.

    tiered-launch --nvme "$(mktemp -d)" --policy configs/nvme.yaml examples/finetune_hf.py --out ft
    ... examples/finetune_hf.py --out ft --lora 8          # LoRA adapters, the base frozen
    ... examples/finetune_hf.py --out ft --base PATH       # a checkpoint folder of your own

Nothing is downloaded. Without ``--base`` a small Llama made from a config and saved to
``OUT/base`` stands in for a downloaded checkpoint; the tokenizer is a character-level one built
here, and the text is the Python standard library's own source, read from this machine. The
model is built with ``load_model`` (nothing allocated) and the folder's weights are read
straight into the tiers. The fine-tuned model is saved to ``OUT/final``: a folder
``from_pretrained`` loads, or with ``--lora`` an adapter ``PeftModel.from_pretrained`` loads.
"""
import argparse
import glob
import os
import sysconfig

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, TrainingArguments

from tiered.integrations.transformers import TieredTrainer, load_model


def char_tokenizer() -> PreTrainedTokenizerFast:
    """Characters of printable ASCII, each a token (and pad, end, unknown)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    printable = [chr(code) for code in range(32, 127)] + ["\n"]
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(printable)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.decoder = decoders.Fuse()  # characters back into the text, not joined by spaces
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>",
                                   eos_token="<eos>", unk_token="<unk>")


def library_text(characters: int) -> str:
    """About ``characters`` of the Python standard library's source, its files in name order."""
    parts, total = [], 0
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))):
        with open(path, encoding="utf-8", errors="replace") as file:
            parts.append(file.read())
        total += len(parts[-1])
        if total >= characters:
            break
    return "".join(parts)[:characters]


def token_rows(tokenizer, rows: int, seq: int) -> list[dict[str, torch.Tensor]]:
    """``rows`` consecutive windows of ``seq`` tokens, each its own labels."""
    ids = tokenizer(library_text(rows * seq))["input_ids"]
    windows = torch.tensor(ids[:rows * seq]).view(rows, seq)
    return [{"input_ids": row, "labels": row} for row in windows]


def make_base(folder: str, tokenizer, layers: int, dim: int) -> None:
    """A small Llama saved as a checkpoint folder (what a download would give)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=dim,
                         intermediate_size=dim * 8 // 3, num_hidden_layers=layers,
                         num_attention_heads=max(1, dim // 64), max_position_embeddings=1024,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="folder for the base, the run, the result")
    parser.add_argument("--base", default=None, help="a checkpoint folder (default: made here)")
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank (0: full fine-tune)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=8, help="per rank")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--lr", type=float, default=None,
                        help="default: 3e-3, or 1e-2 with --lora")
    args = parser.parse_args()

    training = TrainingArguments(
        output_dir=os.path.join(args.out, "run"), max_steps=args.steps,
        per_device_train_batch_size=args.batch, learning_rate=args.lr or (
            1e-2 if args.lora else 3e-3), lr_scheduler_type="cosine", warmup_steps=5,
        weight_decay=0.1, max_grad_norm=1.0, logging_steps=10, save_strategy="no",
        report_to="none", disable_tqdm=True, bf16=torch.cuda.is_available(),
        use_cpu=not torch.cuda.is_available())
    tokenizer = char_tokenizer()
    base = args.base or os.path.join(args.out, "base")
    with training.main_process_first(desc="the base checkpoint"):  # rank 0 makes it first
        if args.base is None and not os.path.isfile(os.path.join(base, "config.json")):
            make_base(base, tokenizer, args.layers, args.dim)
    model = load_model(base)
    if args.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(
            r=args.lora, lora_alpha=2 * args.lora,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    data = token_rows(tokenizer, rows=args.steps * args.batch * training.world_size, seq=args.seq)
    trainer = TieredTrainer(model=model, args=training, train_dataset=data,
                            processing_class=tokenizer)
    if training.process_index == 0:
        print(f"{trainer.engine.num_parameters(trainable_only=True):,} of "
              f"{trainer.engine.num_parameters():,} parameters train")
    trainer.train()
    trainer.save_model(os.path.join(args.out, "final"))
    trainer.engine.close()


if __name__ == "__main__":
    main()
