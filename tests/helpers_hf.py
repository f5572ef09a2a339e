"""What the Hugging Face tests share: a tiny Llama from a config (no download), its data, the
TrainingArguments of the parity runs, and the plain Trainer's side of them; for trl's
DPOTrainer, a few preferences and the same arguments as a DPOConfig."""
from __future__ import annotations

import pytest
import torch

transformers = __import__("pytest").importorskip("transformers")

STEPS = 6
"""Optimizer steps of a parity run."""
PARITY = dict(rtol=1e-5, atol=1e-6)
"""fp32 parity with plain Trainer: the two take the gradient norm in another order (torch's
norm of norms against the engine's sum of squares), so the clip factor, and through it every
update, differs in the last bits."""


def config(**overrides) -> "transformers.LlamaConfig":
    values = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  tie_word_embeddings=False)
    return transformers.LlamaConfig(**{**values, **overrides})


def llama(**overrides) -> "transformers.LlamaForCausalLM":
    """The same tiny Llama every call (seeded), fp32."""
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config(**overrides))


def lora(model):
    """``model`` with LoRA adapters on its attention's q and v (seeded draws)."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(1)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8,
                                                      target_modules=["q_proj", "v_proj"]))


def dataset(rows: int = 24, seq: int = 16) -> list[dict[str, torch.Tensor]]:
    """Random token rows, each its own labels (the model shifts them)."""
    tokens = torch.randint(0, 128, (rows, seq), generator=torch.Generator().manual_seed(3))
    return [{"input_ids": row, "labels": row} for row in tokens]


PARITY_ARGUMENTS = dict(max_steps=STEPS, per_device_train_batch_size=2,
                        gradient_accumulation_steps=2, learning_rate=1e-2,
                        lr_scheduler_type="cosine", warmup_steps=2, max_grad_norm=1.0,
                        weight_decay=0.1, adam_epsilon=1e-6, logging_steps=1, save_strategy="no",
                        report_to="none", use_cpu=True, disable_tqdm=True, seed=7)
"""The issue's parity settings: cosine schedule with warm-up, accumulation 2, clipping 1.0,
weight decay 0.1 (eps 1e-6: near-zero gradients make 1e-8 amplify rounding)."""


def arguments(output_dir, **overrides) -> "transformers.TrainingArguments":
    """The parity settings, fp32."""
    return transformers.TrainingArguments(
        **{**PARITY_ARGUMENTS, "output_dir": str(output_dir), **overrides})


def dpo_arguments(output_dir, **overrides):
    """The parity settings as trl's DPOConfig, fp32 (trl's default is bf16); trl's other
    defaults stay (gradient checkpointing on, beta 0.1, the sigmoid loss)."""
    import trl

    return trl.DPOConfig(**{**PARITY_ARGUMENTS, "output_dir": str(output_dir), "bf16": False,
                            **overrides})


def preferences():
    """A few prompts, each with a chosen and a rejected completion, as trl's DPOTrainer reads
    them (its tokenizer: the example's characters)."""
    import datasets

    rows = [("The sky is", " blue.", " loud."), ("Two and two make", " four.", " five."),
            ("Water is", " wet.", " dry."), ("Fire is", " hot.", " cold."),
            ("Snow is", " white.", " green."), ("Ice is", " cold.", " warm."),
            ("Grass is", " green.", " purple."), ("The sun is", " bright.", " dark.")]
    prompt, chosen, rejected = zip(*rows)
    return datasets.Dataset.from_dict({"prompt": list(prompt), "chosen": list(chosen),
                                       "rejected": list(rejected)})


def train_plain(model, args, data) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Plain Trainer's final weights and its per-step logs."""
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    return ({name: value.detach().clone() for name, value in model.state_dict().items()},
            step_logs(trainer))


def step_logs(trainer) -> list[dict]:
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def assert_close_states(got: dict, expected: dict, **tolerance) -> None:
    assert set(got) >= set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, **(tolerance or PARITY), msg=name)

