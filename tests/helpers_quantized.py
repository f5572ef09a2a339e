"""What the tests of quantized frozen weights (``params.frozen_dtype``) share: the reference's
weights, torchao's own quantization and dequantization of them, outside the product."""
from __future__ import annotations

import torch
from torch import nn
from torchao.quantization import Int8Tensor, Int8WeightOnlyConfig, PerRow, quantize_, to_nf4

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
