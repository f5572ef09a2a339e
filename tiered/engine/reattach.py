"""A relaunched trainer takes over its rank's state, kept by the node's service after the trainer
before it died (see [Note: reattach] in service/commits.py).

Each ``step()`` call sends its record (``StepRecorder`` makes the model's part: RNG states,
persistent buffers, extra states); the service keeps the records of the last step committed on
every rank, and each rank's segments, whose shards are that step's. ``tiered.initialize``
under the same job then maps those segments again instead of reserving new ones, builds no unit
(``check_kept`` first makes sure this run asks for the same thing), and ``restore`` puts back
what the records hold: the optimizer's counters as after ``load_checkpoint``, which weights of
the delayed update are current, the RNG states and the buffers.
"""
from __future__ import annotations

import base64
import json

import torch
from torch import nn

from ..checkpoint.format import DTYPES, NAMES
from ..checkpoint.pretrained import (EXTRA_STATE, extra_states, persistent_buffers, rng_states,
                                     set_rng_states, store_model_state)
from ..core.errors import TieredError
from ..tiers.aio import host_buffer

RECORD_BYTES = 512 << 10
"""The most a step's record of the model may take on the wire (a message holds 1 MiB). A model
whose buffers are larger cannot be reattached to (its record says why); it trains as ever."""


class ReattachError(TieredError):
    """The service's kept state of the job cannot be taken over by this run."""


def tensor_to_wire(tensor: torch.Tensor) -> list:
    data = tensor.detach().cpu().contiguous()
    raw = bytes(host_buffer(data, data.numel() * data.element_size()))
    return [DTYPES[data.dtype], list(data.shape), base64.b64encode(raw).decode()]


def tensor_from_wire(value: list) -> torch.Tensor:
    dtype, shape, text = value
    raw = bytearray(base64.b64decode(text))
    out = torch.empty(shape, dtype=NAMES[dtype])
    host_buffer(out, len(raw))[:] = raw
    return out


class StepRecorder:
    """The model's part of a step's record: what a checkpoint holds besides the shards."""

    def __init__(self, module: nn.Module, state_dict_keys: list[str], device: torch.device):
        self._module = module
        self._keys = state_dict_keys
        self._device = device

    def __call__(self) -> dict:
        """The RNG states, persistent buffers and extra states as JSON values; or, where they
        cannot travel (too large, an extra state JSON cannot hold), why not."""
        rng = {name: tensor_to_wire(value) for name, value in rng_states(self._device).items()}
        buffers = {name: tensor_to_wire(buffer) for name, buffer
                   in persistent_buffers(self._module, self._keys).items()}
        size = sum(len(value[2]) for value in (*rng.values(), *buffers.values()))
        state: dict[str, object] = dict(buffers)
        for key, value in extra_states(self._module, self._keys).items():
            if isinstance(value, torch.Tensor):
                wire = tensor_to_wire(value)
                state[key] = {"tensor": wire}
                size += len(wire[2])
                continue
            try:  # only these need a trial: the rest is base64 text
                size += len(json.dumps(value))
            except (TypeError, ValueError):
                return {"unrecorded": f"the extra state {key} is neither a tensor nor JSON"}
            state[key] = {"json": value}
        if size > RECORD_BYTES:
            return {"unrecorded": f"the model's RNG states, buffers and extra states take "
                                  f"{size} bytes on the wire, more than a step's record "
                                  f"holds ({RECORD_BYTES})"}
        return {"rng": rng, "state": state}


def check_kept(kept: dict, asked: dict, job: str) -> None:
    """Refuse, naming the difference, a run that does not ask for what the kept state is of:
    ``asked`` is this rank's host request's fingerprint (HostRequest.fingerprint)."""
    fresh = f"; relaunch with --fresh to discard the kept state of job {job}, or use another --job"
    why = kept["record"]["model"].get("unrecorded")
    if why:
        raise ReattachError(f"job {job}'s kept state cannot be taken over: {why}{fresh}")
    was = kept["host"]
    for key, what in (("policy", "the policy"), ("names", "the model's units"),
                      ("trainable", "which units train"), ("ranges", "the param groups"),
                      ("plan", "the memory plan (the model's sizes or their placement)")):
        if was.get(key) != asked.get(key):
            detail = _first_difference(was.get(key), asked.get(key), key)
            raise ReattachError(f"job {job} was run with other {what} than this run's: "
                                f"{detail}{fresh}")


def _first_difference(kept, now, path: str) -> str:
    if isinstance(kept, dict) and isinstance(now, dict):
        for key in sorted(set(kept) | set(now), key=str):
            if kept.get(key) != now.get(key):
                return _first_difference(kept.get(key), now.get(key), f"{path}.{key}")
    if isinstance(kept, list) and isinstance(now, list):
        if len(kept) != len(now):
            return f"{path} has {len(kept)} entries in the kept state, {len(now)} here"
        for i, (a, b) in enumerate(zip(kept, now)):
            if a != b:
                return _first_difference(a, b, f"{path}[{i}]")
    return f"{path} was {kept!r}, is {now!r}"


def restore(engine, kept: dict) -> None:
    """Put back what the kept records hold (the shards are the segments' already)."""
    record = kept["record"]
    swapped = record["optimizer"]["swapped"]
    for unit in swapped:
        engine.manager.swap_params(unit)
    engine.runtime.host.params_swapped(swapped)
    engine.optimizer.restore_step_record(record["optimizer"], kept["final"])
    model = record["model"]
    set_rng_states({name: tensor_from_wire(value) for name, value in model["rng"].items()},
                    engine.device)
    values = {}
    for key, value in model["state"].items():
        if key.endswith(EXTRA_STATE):
            values[key] = (tensor_from_wire(value["tensor"]) if "tensor" in value
                           else value["json"])
        else:
            values[key] = tensor_from_wire(value)
    store_model_state(engine.module, values)
