"""The benchmark GPTs as ``tiered plan`` factories (``module:factory``, built on the meta device):

    tiered plan bench.plan_models:gpt_2_8b --policy configs/auto.yaml --node bench/node_h100.json

The same shapes bench_offload.py builds (its VOCAB, a head per 128 dimensions): the 2.78 B GPT of
the offload stages (32 x 2560) and the 6.5 B one of issue 20's second benchmark (32 x 4096).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "examples"))

from gpt import GPT  # noqa: E402

VOCAB = 50304


def gpt_2_8b() -> GPT:
    return GPT(VOCAB, 2560, 32, 2560 // 128)


def gpt_6_5b() -> GPT:
    return GPT(VOCAB, 4096, 32, 4096 // 128)
