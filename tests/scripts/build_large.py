"""Build and partition a GPT under tiered.init with an NVMe policy; report peak memory (RSS).

usage: build_large.py NVME_DIR DRAM_BUDGET_BYTES LAYERS DIM
"""
import json
import os
import resource
import sys

import torch

import tiered

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "examples"))
from gpt import GPT  # noqa: E402


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


nvme, dram_budget, layers, dim = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
policy = dict(device="cpu", compute_dtype="bf16", nvme={"path": nvme}, dram={"budget": dram_budget})
# A tiny run first: the first use of torch's modules and kernels loads code and fills caches
# (about 70 MB here, even for a model on the meta device), which is not the model's memory.
with tiered.init("configs/nvme.yaml", **policy):
    warm_up = GPT(1024, 64, 1, 1)
tiered.initialize(warm_up)[0].close()
baseline = peak_rss()
torch.manual_seed(0)
with tiered.init("configs/nvme.yaml", **policy):
    model = GPT(1024, dim, layers, max(1, dim // 64))
built = peak_rss()
engine, optimizer = tiered.initialize(model)
n_params = sum(f.numel for f in engine.runtime.flats)
largest_unit = max(f.padded_numel for f in engine.runtime.flats)
print(json.dumps({"params": n_params, "largest_unit": largest_unit,
                  "build_growth": built - baseline, "init_growth": peak_rss() - baseline,
                  "report": engine.memory_report(), "sample": engine.full_state_dict()[
                      "blocks.3.fc.weight"][:2, :4].tolist()}))
engine.close()
