"""trl's DPOTrainer through TieredTrainerMixin under ``tiered-launch``; run by tests/integrations/test_dpo.py.

    tiered-launch --policy configs/cpu.yaml --job J tests/scripts/hf_dpo.py OUT_DIR

The policy is the launcher's (``policy=`` left out). Trains the tests' tiny Llama against a
frozen copy of it as the reference, two engines open in this process through the node's
service, with the parity DPOConfig; writes OUT_DIR/state.pt (the policy's
``full_state_dict()``) and OUT_DIR/run.json (the per-step logs and the jobs the service holds
the two engines under).
"""
import json
import os
import sys

import torch

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [TESTS, os.path.join(os.path.dirname(TESTS), "examples")]
from trl import DPOTrainer  # noqa: E402

from tiered.integrations.transformers import TieredTrainerMixin  # noqa: E402

from finetune_hf import char_tokenizer  # noqa: E402
from helpers_hf import dpo_arguments, llama, preferences, step_logs  # noqa: E402


class TieredDPOTrainer(TieredTrainerMixin, DPOTrainer):
    pass


out = sys.argv[1]
trainer = TieredDPOTrainer(model=llama(), ref_model=llama(),
                           args=dpo_arguments(os.path.join(out, "run")),
                           train_dataset=preferences(), processing_class=char_tokenizer())
trainer.train()
torch.save(trainer.engine.full_state_dict(), os.path.join(out, "state.pt"))
with open(os.path.join(out, "run.json"), "w") as file:
    json.dump({"logs": step_logs(trainer),
               "jobs": [trainer.engine.service_job, trainer.ref_engine.service_job]}, file)
trainer.engine.close()
trainer.ref_engine.close()
