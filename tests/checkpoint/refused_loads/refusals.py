"""What the refused-load tests share: a small GPT and its engine, hand-written safetensors
files, and the second of the two checks every refusal makes (the engine is unchanged:
helpers.refused; the run goes on as if the load had never been tried)."""
from __future__ import annotations

import ctypes
import json
import math
import os
import shutil
import struct

import torch
from torch import nn

import tiered
from tiered.core.limits import usable_cores

from gpt import GPT, next_token_loss
from helpers import assert_same

VOCAB, DIM, SEQ, ROWS = 64, 32, 16, 4
INDEX = "model.safetensors.index.json"
LAST_UNIT_KEY = "head.weight"  # in <root>, the unit loaded last: a half-load would show


def make_model(seed: int = 0, **kwargs) -> GPT:
    torch.manual_seed(seed)
    return GPT(VOCAB, DIM, 2, 2, max_seq=SEQ, **kwargs)


def new_engine(model: nn.Module | None = None, **overrides):
    # As many optimizer threads in every process as one rank takes by default: the two-rank
    # test compares with the one-rank run bit for bit, and two ranks would each take half the
    # cores. torch.set_num_threads, which the worker calls, also sets MKL's threads for the
    # whole process, so the training thread's matrix products (and their last bits) follow
    # the worker's count: ranks on 1 thread against a reference on 2 differed in the
    # LayerNorm parameters after one step, and a later test in the same process on 2.
    return tiered.initialize(make_model() if model is None else model, device="cpu",
                             compute_dtype="fp32", optimizer={"lr": 1e-2},
                             cpu={"optimizer_threads": usable_cores()}, **overrides)


def batch(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(seed))


def step(engine, optimizer, seed: int) -> float:
    idx = batch(seed)
    loss = next_token_loss(engine(idx), idx)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def good_state() -> dict[str, torch.Tensor]:
    """Weights of another initialization: loading them changes every parameter."""
    return {name: value.clone() for name, value in make_model(seed=7).state_dict().items()}


def raw(tensor: torch.Tensor) -> bytes:
    tensor = tensor.contiguous()
    return ctypes.string_at(tensor.data_ptr(), tensor.numel() * tensor.element_size())


def write_safetensors(path, entries: dict[str, tuple[str, list[int], bytes]]) -> str:
    """A safetensors file written by hand: 8-byte little-endian header length, the JSON header
    (``name -> {dtype, shape, data_offsets}``), then the bytes."""
    header, data = {}, b""
    for name, (dtype, shape, payload) in entries.items():
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [len(data), len(data) + len(payload)]}
        data += payload
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded + data)
    return str(path)


def f32_entries(state: dict[str, torch.Tensor]) -> dict[str, tuple[str, list[int], bytes]]:
    return {name: ("F32", list(value.shape), raw(value.float())) for name, value in state.items()}


def open_files_under(folder) -> list[str]:
    """The files under ``folder`` this process holds open."""
    folder = os.path.realpath(folder)
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(folder + os.sep):
            found.append(target)
    return found


def copy_of(folder, tmp_path, name: str = "copy"):
    target = tmp_path / name
    shutil.copytree(folder, target)
    return target


def goes_on_as_never_loaded(engine, optimizer, reference) -> None:
    """The next step gives exactly the state of a run that never saw the refused load: the
    weights, the Adam moments and the step counts all stayed."""
    loss = step(engine, optimizer, 2)
    assert math.isfinite(loss)
    assert_same(engine.full_state_dict(), reference[1], "the step after the refusal")
