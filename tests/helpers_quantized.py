"""What the tests of quantized frozen weights (``params.frozen_dtype``) share: the reference's
weights, torchao's own quantization and dequantization of them, outside the product."""
from __future__ import annotations

import os

import torch
from torch import nn
from torchao.quantization import Int8Tensor, Int8WeightOnlyConfig, PerRow, quantize_, to_nf4

import tiered

from gpt import GPT, LoRALinear, add_lora
from helpers import REPO
from helpers_models import OPTIM, RANK, SEQ, VOCAB

FORMATS = ("nf4", "int8")
NF4_BLOCKS = 64 * 256
"""Elements of nf4's whole blocks of scales (``to_nf4(w, 64, 256)``): a weight it takes is a
multiple of them."""


def torchao_roundtrip(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    """``weight`` quantized to ``fmt`` and dequantized, by torchao alone."""
    if fmt == "nf4":
        return to_nf4(weight, 64, 256).get_original_weight()
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    layer.weight.data.copy_(weight)
    quantize_(layer, Int8WeightOnlyConfig())  # the user-facing config: its tensor's values
    assert torch.equal(layer.weight.dequantize(), Int8Tensor.from_hp(weight, PerRow()).dequantize())
    return layer.weight.dequantize()


@torch.no_grad()
def with_torchao_linears(model: nn.Module, fmt: str) -> nn.Module:
    """``model`` (untied: no linear weight is an embedding's) with every linear weight the
    format takes (nf4: whole blocks; int8: any) replaced by its torchao round trip, as QLoRA's
    base computes with it; the rest as it was."""
    for module in model.modules():
        if isinstance(module, nn.Linear) and (fmt == "int8"
                                              or module.weight.numel() % NF4_BLOCKS == 0):
            module.weight.copy_(torchao_roundtrip(module.weight.detach(), fmt))
    return model


def qlora_model(seed: int = 0) -> nn.Module:
    """The parity LoRA GPT at width 128, so that every linear weight of its blocks is a whole
    number of nf4's 64 x 256 blocks (128 x 128 and multiples); its tied embedding, biases and
    norms stay in the compute dtype, as QLoRA leaves them. Its adapters are both random (as
    helpers_models.lora_model); ``seed``: its weights' (the adapters' is seed + 1)."""
    torch.manual_seed(seed)
    model = add_lora(GPT(VOCAB, 128, 2, 2, max_seq=SEQ, tied=True, qkv_bias=False), RANK)
    torch.manual_seed(seed + 1)
    for module in model.modules():
        if isinstance(module, LoRALinear):
            nn.init.normal_(module.lora_a, std=0.1)
            nn.init.normal_(module.lora_b, std=0.1)
    return model


def qlora_engine(fmt: str, policy: str, nvme: str, pretrained: bool = False, seed: int = 0,
                 compute_dtype: str = "fp32"):
    """qlora_model(seed) under ``configs/<policy>.yaml`` with ``params.frozen_dtype: fmt``
    (on the CPU). ``pretrained``: the model's own values are zeros and its
    weights come from ``initialize(weights=)`` (qlora_model's state dict): each unit is read
    whole from them then quantized, rank 0's record sent to the others."""
    model, weights = qlora_model(seed), None
    if pretrained:
        weights = {name: value.clone() for name, value in model.state_dict().items()}
        with torch.no_grad():
            for param in model.parameters():
                param.zero_()
    return tiered.initialize(model, os.path.join(REPO, "configs", f"{policy}.yaml"),
                             compute_dtype=compute_dtype, device="cpu", nvme={"path": nvme},
                             params={"frozen_dtype": fmt}, weights=weights,
                             optimizer=dict(OPTIM, sub_group_size=1024))
