"""A checkpoint already quantized by bitsandbytes (Hugging Face's ``BitsAndBytesConfig`` 4-bit
nf4 export, double-quantized) loads through ``load_model`` as the weights bitsandbytes
dequantizes it to ([Note: bitsandbytes exports] in tiered/checkpoint/bnb4.py), and peft's LoRA
over it trains through TieredTrainer as plain peft and Trainer over those weights. The oracle is
bitsandbytes itself: its ``dequantize_4bit`` of each weight of the saved file.

The export is real: transformers' ``from_pretrained(quantization_config=...)`` quantizes the
tiny Llama of test_hf_quantized on the CPU (bitsandbytes' CPU backend) and ``save_pretrained``
writes it. Its q, o and MLP weights are whole numbers of nf4's 64 x 256 blocks, so under
``frozen_dtype: nf4`` torchao quantizes them again; k and v are not, and stay fp32; the head is
not quantized by Hugging Face (it skips ``lm_head``), so the file holds it in fp32."""
from __future__ import annotations

import pytest
import torch

from helpers_hf import arguments, dataset, llama, lora, step_logs, train_plain

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")
bnb = pytest.importorskip("bitsandbytes.functional")

import tiered  # noqa: E402
from tiered.checkpoint.format import CheckpointError  # noqa: E402
from tiered.integrations.transformers import TieredTrainer, load_model  # noqa: E402
from helpers_quantized import NF4_BLOCKS, torchao_roundtrip  # noqa: E402
from torchao.quantization import to_nf4  # noqa: E402

DIMS = dict(hidden_size=128, intermediate_size=256)
NF4_SCALER_BLOCK = 256
"""Blocks a torchao double-quantization factor covers (``to_nf4(w, 64, 256)``)."""


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """The folder of the bnb export and its tensors as saved."""
    root = tmp_path_factory.mktemp("bnb4")
    llama(**DIMS).save_pretrained(root / "base")
    config = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                             bnb_4bit_use_double_quant=True)
    quantized = transformers.AutoModelForCausalLM.from_pretrained(
        root / "base", quantization_config=config, device_map="cpu")
    quantized.save_pretrained(root / "bnb")
    return root / "bnb", safetensors.load_file(root / "bnb" / "model.safetensors")


def bnb_weights(saved: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each 4-bit weight of the file: bitsandbytes' own dequantization of it, and its
    dequantized block scales."""
    out = {}
    for name in [key[:-len(".absmax")] for key in saved if key.endswith(".weight.absmax")]:
        state = bnb.QuantState.from_dict({key[len(name) + 1:]: value for key, value in
                                          saved.items() if key.startswith(f"{name}.")},
                                         torch.device("cpu"))
        scales = bnb.dequantize_blockwise(state.absmax, state.state2) + state.offset
        out[name] = bnb.dequantize_4bit(saved[name], state), scales
    return out


def loaded(path, fmt: str) -> dict[str, torch.Tensor]:
    """The model's weights as the engine holds them after ``load_model(path, fmt)``, all
    frozen (so that every unit is frozen and, under nf4, quantized)."""
    model = load_model(str(path), policy={"device": "cpu"}, frozen_dtype=fmt)
    model.requires_grad_(False)
    engine, _ = tiered.initialize(model, weights=str(path))
    try:
        return engine.full_state_dict()
    finally:
        engine.close()


def test_a_bitsandbytes_nf4_export_loads_as_bitsandbytes_dequantizes_it(export):
    path, saved = export
    oracle = bnb_weights(saved)
    assert len(oracle) == 14  # 7 linear weights in each of the two layers

    got = loaded(path, "compute")  # bitsandbytes' weights, to the bit
    assert not [key for key in got if "absmax" in key or "quant" in key]
    for name, (weight, _) in oracle.items():
        assert torch.equal(got[name], weight), name
    assert torch.equal(got["lm_head.weight"], saved["lm_head.weight"])

    got = loaded(path, "nf4")  # quantized again by torchao, unit by unit
    for name, (weight, scales) in oracle.items():
        if weight.numel() % NF4_BLOCKS:  # k, v: nf4 does not take them, bnb's values stay
            assert torch.equal(got[name], weight), name
            continue
        # The codes and the block scales carry over (the largest of a block was coded ±1)...
        assert torch.equal(weight.view(-1, 64).abs().amax(dim=1), scales), name
        assert torch.equal(to_nf4(weight, 64, NF4_SCALER_BLOCK).quantized_data.view(-1),
                           saved[name].view(-1)), name
        # ...and only torchao's int8 double quantization of the scales around their mean
        # differs: at most half a step of its grid, a whole one where the group's largest is
        # clamped to 127, i.e. max |scale - mean| / 128 per group of 256 blocks, times the
        # code (|code| <= 1); plus the two products' fp32 rounding, an ulp of the largest.
        spread = (scales - scales.mean()).abs().view(-1, NF4_SCALER_BLOCK).amax(dim=1)
        bound = spread.repeat_interleave(64 * NF4_SCALER_BLOCK).view(weight.shape) / 128 \
            + 2 * torch.finfo(torch.float32).eps * scales.max()
        difference = (got[name] - weight).abs()
        assert (difference <= bound).all(), (name, difference.max().item())
        assert torch.equal(got[name], torchao_roundtrip(weight, "nf4")), name
    assert torch.equal(got["lm_head.weight"], torchao_roundtrip(saved["lm_head.weight"], "nf4"))


def test_formats_it_does_not_carry_over_are_refused_by_name(export, tmp_path):
    path, saved = export
    name = "model.layers.0.self_attn.q_proj.weight"
    key = f"{name}.quant_state.bitsandbytes__nf4"
    blocks_of_128 = bytes(saved[key].tolist()).replace(b'"blocksize": 64', b'"blocksize": 128')
    for changed, expected in [
            ({key.replace("nf4", "fp4"): saved[key]}, f"{name} is a bitsandbytes fp4 weight"),
            ({key: torch.tensor(list(blocks_of_128), dtype=torch.uint8)},
             f"{name} is bitsandbytes nf4 in blocks of 128"),
            ({key: saved[key], f"{name[:-len('.weight')]}.SCB": torch.ones(128)},
             "self_attn.q_proj is a bitsandbytes 8-bit weight")]:
        tensors = {k: v for k, v in saved.items() if k != key}
        tensors.update(changed)
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        folder.mkdir()
        safetensors.save_file(tensors, folder / "model.safetensors")
        (folder / "config.json").write_text((path / "config.json").read_text())
        model = load_model(str(folder), policy={"device": "cpu"}, frozen_dtype="nf4")
        with pytest.raises(CheckpointError, match=expected):
            tiered.initialize(model, weights=str(folder))


@pytest.mark.parametrize("fmt", ["compute", "nf4"])
def test_qlora_over_a_bitsandbytes_export_trains_as_peft_over_its_weights(export, fmt, tmp_path):
    # peft's LoRA on load_model's model of the export, through TieredTrainer, against plain peft
    # and Trainer over the tiny Llama holding the weights the engine computes with: bitsandbytes'
    # dequantization of each 4-bit weight (under nf4, torchao's round trip of it where nf4 takes
    # it, as the test above found), the file's other tensors as they are. No clipping: the two
    # would take the gradients' norm in other orders; without it they agree to the bit.
    path, saved = export
    plain = llama(**DIMS)
    weights = {name: saved[name] for name in plain.state_dict()}  # a 4-bit one: its codes
    for name, (weight, _) in bnb_weights(saved).items():
        weights[name] = (torchao_roundtrip(weight, fmt)
                         if fmt == "nf4" and weight.numel() % NF4_BLOCKS == 0 else weight)
    if fmt == "nf4":
        weights["lm_head.weight"] = torchao_roundtrip(saved["lm_head.weight"], fmt)
    model = lora(load_model(str(path), policy={"device": "cpu"}, frozen_dtype=fmt))
    data, unclipped = dataset(), dict(max_grad_norm=0.0)
    trainer = TieredTrainer(model=model, args=arguments(tmp_path / "tiered", **unclipped),
                            train_dataset=data)
    start = {name: value for name, value in trainer.engine.full_state_dict().items()
             if ".lora_" in name}
    assert len(start) == 8  # A and B of q and v in each of the two layers
    trainer.train()
    got = trainer.engine.full_state_dict()
    trainer.engine.close()

    plain.load_state_dict(weights, strict=True)
    plain = lora(plain)
    assert not plain.load_state_dict(start, strict=False).unexpected_keys
    expected, expected_logs = train_plain(plain, arguments(tmp_path / "plain", **unclipped), data)
    assert [log["loss"] for log in step_logs(trainer)] == [log["loss"] for log in expected_logs]
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
