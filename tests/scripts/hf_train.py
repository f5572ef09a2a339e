"""TieredTrainer under ``tiered-launch``; run by tests/integrations/test_hf_launch.py.

    tiered-launch --nvme DIR --policy configs/nvme.yaml --nproc-per-node 2 \
        tests/scripts/hf_train.py OUT_DIR

The policy is the launcher's (``policy=`` left out). Trains the tests' tiny Llama with the
parity TrainingArguments at ``--per-device 2`` per rank, then rank 0 writes OUT_DIR/state.pt
(``engine.full_state_dict()``) and OUT_DIR/logs.json (the per-step logs); every rank exports
the model with ``save_model`` into OUT_DIR/export.
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tiered.integrations.transformers import TieredTrainer  # noqa: E402

from helpers_hf import arguments, dataset, llama, step_logs  # noqa: E402

out = sys.argv[1]
trainer = TieredTrainer(model=llama(), args=arguments(os.path.join(out, "run")),
                        train_dataset=dataset())
trainer.train()
state = trainer.engine.full_state_dict()
trainer.save_model(os.path.join(out, "export"))
if trainer.engine.runtime.group.rank == 0:
    torch.save(state, os.path.join(out, "state.pt"))
    with open(os.path.join(out, "logs.json"), "w") as file:
        json.dump({"logs": step_logs(trainer), "world": trainer.args.world_size,
                   "placement": trainer.engine.placement()}, file)
trainer.engine.close()
