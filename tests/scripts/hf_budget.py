"""``load_model`` of a checkpoint folder larger than the DRAM budget, fine-tuned by TieredTrainer
under the NVMe policy; run by tests/integrations/test_hf_launch.py in a process of its own, so that its
resident memory is the run's.

    python tests/scripts/hf_budget.py FOLDER NVME DRAM_BYTES OUT.json

A tiny run comes first, so that what any run adds once (imports, the AdamW kernel's compile)
is in the baseline. Writes the resident memory before the model was built and the most it
reached after (sampled every 5 ms), the engine's memory report and the losses.
"""
import gc
import json
import os
import sys
import threading
import time

import psutil
import torch

import tiered  # noqa: F401

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tiered.integrations.transformers import TieredTrainer, load_model  # noqa: E402

from helpers_hf import arguments, llama, step_logs  # noqa: E402

folder, nvme, dram, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
tokens = torch.randint(0, 512, (8, 64), generator=torch.Generator().manual_seed(0))
data = [{"input_ids": row, "labels": row} for row in tokens]
args = arguments(os.path.join(os.path.dirname(out), "run"), max_steps=3,
                 gradient_accumulation_steps=1, per_device_train_batch_size=2, bf16=True)


class Peak(threading.Thread):
    def __init__(self):
        super().__init__(daemon=True)
        self.most, self.running = 0, True

    def run(self):
        process = psutil.Process()
        while self.running:
            self.most = max(self.most, process.memory_info().rss)
            time.sleep(0.005)


tiny = TieredTrainer(model=llama(vocab_size=512), args=args, train_dataset=data, policy={
    "device": "cpu"})
tiny.train()
tiny.engine.close()
del tiny
gc.collect()
before = psutil.Process().memory_info().rss
peak = Peak()
peak.start()
policy = tiered.Policy.from_yaml("configs/nvme.yaml", {
    "nvme": {"path": nvme}, "dram": {"budget": dram}, "device": "cpu",
    "optimizer": {"sub_group_size": 1 << 18}})
model = load_model(folder, policy=policy)
trainer = TieredTrainer(model=model, args=args, train_dataset=data, policy=policy)
trainer.train()
report = trainer.engine.memory_report()
peak.running = False
peak.join()
trainer.engine.close()
with open(out, "w") as file:
    json.dump({"before": before, "peak": peak.most, "report": report,
               "losses": [log["loss"] for log in step_logs(trainer)]}, file)
