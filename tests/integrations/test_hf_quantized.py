"""QLoRA through Hugging Face: ``load_model(path, frozen_dtype=...)``, peft's ``get_peft_model``
on it and ``TieredTrainer`` train the adapters as plain peft and Trainer do over a base of the
same quantized weights. The reference is outside the product: the tiny Llama whose linear
weights are torchao's own quantized and dequantized values (helpers_quantized), peft's LoRA on
it, plain Trainer with ``torch.optim.AdamW``. The engine reads the folder's fp32 weights and
quantizes each unit as it reads it.

The Llama is 128 wide with an MLP of 256, so that q, o, the MLP's and the head's weights are
whole numbers of nf4's 64 x 256 blocks; k and v (64 x 128) are not, and stay fp32 under nf4,
as the embedding and norms do. No clipping (max_grad_norm 0): the engine and torch would take
the gradients' norm in other orders; without it every operation is in the same order, so the
two runs agree to the bit."""
from __future__ import annotations

import pytest
import torch

from helpers_hf import arguments, dataset, llama, lora, step_logs, train_plain
from helpers_quantized import with_torchao_linears

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

from tiered.integrations.transformers import TieredTrainer, load_model  # noqa: E402

DIMS = dict(hidden_size=128, intermediate_size=256)
UNCLIPPED = dict(max_grad_norm=0.0)
ADAPTER = "adapter_model.safetensors"


def reference(fmt: str, adapters: dict[str, torch.Tensor], args, data):
    """peft's LoRA over torchao's round trip of the tiny Llama, its adapters starting as
    ``adapters``, trained by plain Trainer; the model, its final state and step logs."""
    model = lora(with_torchao_linears(llama(**DIMS), fmt))
    assert not model.load_state_dict(adapters, strict=False).unexpected_keys
    state, logs = train_plain(model, args, data)
    return model, state, logs


@pytest.mark.parametrize("fmt,tier", [("nf4", "dram"), ("nf4", "nvme"), ("int8", "dram")])
def test_qlora_over_load_model_trains_saves_and_merges_as_peft(fmt, tier, tmp_path):
    llama(**DIMS).save_pretrained(tmp_path / "base")
    policy = ({"device": "cpu"} if tier == "dram" else
              {"device": "cpu", "params": {"tier": "nvme"}, "nvme": {"path": str(tmp_path)}})
    model = lora(load_model(str(tmp_path / "base"), policy=policy, frozen_dtype=fmt))
    data = dataset()
    trainer = TieredTrainer(model=model, args=arguments(tmp_path / "tiered", **UNCLIPPED),
                            train_dataset=data)
    quantized = [flat.name for flat in trainer.engine.runtime.flats if flat.record is not None]
    assert quantized == ["base_model.model.model.layers.0 (frozen)",
                         "base_model.model.model.layers.1 (frozen)", "<root>"]
    # peft initializes the adapters as the engine materializes them: the reference starts there
    start = {name: value for name, value in trainer.engine.full_state_dict().items()
             if ".lora_" in name}
    trainer.train()
    got = trainer.engine.full_state_dict()
    trainer.save_model(str(tmp_path / "adapter"))
    trainer.engine.close(restore_weights=True)

    plain, expected, expected_logs = reference(fmt, start, arguments(tmp_path / "plain",
                                                                     **UNCLIPPED), data)
    assert [log["loss"] for log in step_logs(trainer)] == [log["loss"] for log in expected_logs]
    assert set(got) == set(expected)
    for name, value in expected.items():  # the adapters and the dequantized base
        assert torch.equal(got[name], value), name
    original = llama(**DIMS).state_dict()
    assert not torch.equal(got["base_model.model.lm_head.weight"], original["lm_head.weight"])

    plain.save_pretrained(tmp_path / "plain_adapter")
    ours = safetensors.load_file(tmp_path / "adapter" / ADAPTER)
    theirs = safetensors.load_file(tmp_path / "plain_adapter" / ADAPTER)
    assert set(ours) == set(theirs) and len(ours) == 8
    for name, value in theirs.items():
        assert torch.equal(ours[name], value), name

    merged, merged_plain = (m.merge_and_unload().state_dict() for m in (trainer.model, plain))
    assert set(merged) == set(merged_plain)
    for name, value in merged_plain.items():
        assert torch.equal(merged[name], value), name
