"""Train a few bf16 steps and end right after optimizer.step(), without engine.close(): the
update (with clipping: at several ranks, an all-reduce on the worker) is still running when the
interpreter exits. argv: NVMe folder. Run directly or under tiered-launch."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "examples"))
import torch  # noqa: E402

import tiered  # noqa: E402

from gpt import GPT, next_token_loss  # noqa: E402

torch.manual_seed(0)
engine, optimizer = tiered.initialize(GPT(512, 256, 4, 4), "configs/nvme.yaml", device="cpu",
                                      compute_dtype="bf16", nvme={"path": sys.argv[1]},
                                      optimizer={"max_grad_norm": 1.0})
idx = torch.randint(0, 512, (1, 8))  # few tokens: the update, not the forward, is long
for _ in range(3):
    next_token_loss(engine(idx), idx).backward()
    optimizer.step()
    optimizer.zero_grad()
