"""Compact optimizer states on real text (issue 21): a byte-level LM learns the Python standard
library's sources (bench/bench_convergence.py, its own command line) a few hundred steps under
each setting, and ends where the same run with fp32 states ends, within a bound.

The bound, 1.5% of held-out loss: at this size (0.4 M parameters, 300 steps of 8 x 64 bytes)
plain PyTorch AdamW's own final loss moved by 1.05% between four orders of the same batches
(2.3053 to 2.3297), and every compact setting stayed within 0.75% of the fp32-state run of its
order (bench/RESULTS.md, seventeenth session); a setting as far from its twin as the batch
order moves the reference, with half that again for margin, fails.

The moments' formats are the optimizer's alone, so they are compared in fp32 compute against
plain PyTorch AdamW, an oracle outside the product (tiered's fp32 run is it, bit for bit). bf16
master weights need bf16 compute, which a CPU without native bf16 runs about 100 times slower
than fp32 (a 512 x 128 by 128 x 512 matmul: 53 ms against 0.55 ms on CI's kind of CPU, the
run 4.5 minutes): that comparison runs where the CPU computes bf16 natively (and on the box).
"""
from __future__ import annotations

import pytest
import torch

from tiered.device.bf16 import bf16_support

import helpers_convergence as convergence

BOUND = 0.015
SETTINGS = ["--steps", "300", "--every", "300", "--dim", "128", "--layers", "2", "--batch", "8",
            "--seq", "64", "--held-out-batches", "4"]
NATIVE_BF16 = bf16_support(torch.device("cpu"))


def assert_within_bound(final: dict[str, float], reference: str) -> None:
    assert final[reference] < 2.6  # it learned: from ln 256 = 5.5 at the start
    for mode, loss in final.items():
        assert abs(loss - final[reference]) <= BOUND * final[reference], (mode, final)


def test_compact_moments_learn_real_text_as_pytorch_adamw_does(tmp_path):
    final = convergence.final_losses(tmp_path, [["tiered:fp32+moments-bf16"],
                                                ["torch", "tiered:fp32+moments-int8"]],
                                      SETTINGS)
    assert set(final) == {"torch", "tiered:fp32+moments-bf16", "tiered:fp32+moments-int8"}
    assert_within_bound(final, "torch")


@pytest.mark.skipif(not NATIVE_BF16.native, reason=f"{NATIVE_BF16.why}: bf16 compute runs "
                    f"about 100 times slower than fp32 here")
def test_bf16_master_weights_learn_real_text_as_fp32_masters_do(tmp_path):
    final = convergence.final_losses(tmp_path, [["tiered:bf16"],
                                                ["tiered:bf16+moments-int8+master-bf16"]],
                                      SETTINGS)
    assert set(final) == {"tiered:bf16", "tiered:bf16+moments-int8+master-bf16"}
    assert_within_bound(final, "tiered:bf16")
