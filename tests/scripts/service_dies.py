"""Trains a step through the node's service, says so on stdout, and waits for a line on stdin
(the test kills the service meanwhile, or stops it); then, as argv[1] says, trains another step
and closes its engine (``train``), closes it (``close``), or ends without closing it (``exit``:
the engine is shut down at the interpreter's exit). Run by tests/service/test_service_loss.py, under
tiered/launch/rank_entry.py as tiered-launch runs a rank."""
import sys

import torch
from torch import nn

import tiered  # first: it quiets torch's warning about a missing numpy

TRAINED = "-- trained --"


def step(engine, optimizer) -> None:
    loss = engine(torch.randn(4, 16)).square().mean()
    engine.backward(loss)
    optimizer.step()
    optimizer.zero_grad()


torch.manual_seed(0)
engine, optimizer = tiered.initialize(
    nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16)), device="cpu",
    compute_dtype="fp32")
step(engine, optimizer)
print(f"trained with its host in {type(engine.runtime.host).__name__}", flush=True)
print(TRAINED, file=sys.stderr, flush=True)  # what the rank says after it is the test's
sys.stdin.readline()
if sys.argv[1] == "train":
    step(engine, optimizer)
if sys.argv[1] != "exit":
    engine.close()
