"""A rank's host as data on the wire: its plan, its setup, its commands and its events as JSON
values (wire.py carries them), so that the node's service can run the host a trainer would run
in a thread of its own (optim/host.py).

Nothing here is a tensor: memory is named by what it is (a unit's state, a staging buffer), and
both sides find it in the segments they share (see ServicePlan)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..optim.adamw import AdamWHyper
from ..optim.arrival import LastBackward
from ..optim.commands import Command, GradientIn, StepArrived, Update, UpdateMode, ZeroGrad
from ..optim.groups import GroupRange
from ..placement.plan import Buffer, MemoryPlan, StateKind
from ..policy.config import Policy, Tier

DTYPES = {str(dtype).removeprefix("torch."): dtype
          for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.uint8)}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _buffer(buffer: Buffer) -> list:
    return [buffer.label, buffer.tier.value, buffer.numel, dtype_name(buffer.dtype)]


def _unbuffer(value: list) -> Buffer:
    label, tier, numel, dtype = value
    return Buffer(label, Tier(tier), int(numel), DTYPES[dtype])


def plan_to_wire(plan: MemoryPlan) -> dict:
    return {"shards": [[unit, kind.value, _buffer(buffer)]
                       for (unit, kind), buffer in plan.shards.items()],
            "staging": [[name, _buffer(buffer)] for name, buffer in plan.staging.items()],
            "working_set": plan.working_set}


def plan_from_wire(value: dict) -> MemoryPlan:
    """The plan as the trainer made it, in the same order (the order in which NVMe shards are
    made names them: service/files.py)."""
    return MemoryPlan(
        shards={(int(unit), StateKind(kind)): _unbuffer(buffer)
                for unit, kind, buffer in value["shards"]},
        staging={name: _unbuffer(buffer) for name, buffer in value["staging"]},
        working_set=int(value["working_set"]))


@dataclass(frozen=True)
class HostRequest:
    """What a trainer asks of the service to run its rank's host there."""

    policy: Policy
    plan: MemoryPlan
    blocks: dict[tuple, tuple[int, int, int]]
    """Where each DRAM state ((unit, StateKind)) and staging buffer (("staging", name)) lies
    in the rank's segments: (segment, byte offset, bytes) (TierManager.descriptors)."""
    names: list[str]
    trainable: list[bool]
    ranges: list[tuple[GroupRange, ...]]
    threads: int
    """The CPU update's threads for this rank."""
    traced: bool = False
    """Whether the trainer keeps a timeline: the host's spans are sent to it (hosting.py)."""

    def to_wire(self) -> dict:
        return {"policy": self.policy.to_dict(), "plan": plan_to_wire(self.plan),
                "blocks": [[_block_key(key), *where] for key, where in self.blocks.items()],
                "names": list(self.names),
                "trainable": list(self.trainable),
                "ranges": [[[r.start, r.stop, r.group] for r in unit] for unit in self.ranges],
                "threads": self.threads, "traced": self.traced}

    def fingerprint(self) -> dict:
        """What a relaunch of the rank must ask for alike to take its kept state over: the
        policy, the plan (and so every unit's size and placement), the units and their param
        groups; not where its memory lies or how many threads it gets."""
        value = self.to_wire()
        for key in ("blocks", "threads", "traced"):
            del value[key]
        return value

    @classmethod
    def from_wire(cls, value: dict) -> "HostRequest":
        return cls(Policy.from_dict(value["policy"]), plan_from_wire(value["plan"]),
                   {_unblock_key(key): (int(segment), int(at), int(nbytes))
                    for key, segment, at, nbytes in value["blocks"]},
                   [str(n) for n in value["names"]],
                   [bool(t) for t in value["trainable"]],
                   [tuple(GroupRange(int(a), int(b), None if g is None else int(g))
                          for a, b, g in unit) for unit in value["ranges"]],
                   int(value["threads"]), bool(value.get("traced", False)))


    @property
    def segment_ids(self) -> list[int]:
        """The segments its blocks lie in."""
        return sorted({segment for segment, _, _ in self.blocks.values()})


def _block_key(key: tuple) -> list:
    first, second = key
    return ["staging", second] if first == "staging" else [first, second.value]


def _unblock_key(value: list) -> tuple:
    first, second = value
    return ("staging", str(second)) if first == "staging" else (int(first), StateKind(second))


def _hyper(hyper: AdamWHyper) -> list:
    return [hyper.lr, hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay]


def _last(last: LastBackward | None) -> dict | None:
    if last is None:
        return None
    return {"step_units": last.step_units,
            "forward_rank": [[unit, place] for unit, place in last.forward_rank.items()],
            "hypers": None if last.hypers is None else [_hyper(h) for h in last.hypers]}


def _unlast(value: dict | None) -> LastBackward | None:
    if value is None:
        return None
    hypers = value["hypers"]
    return LastBackward(bool(value["step_units"]),
                        {int(unit): int(place) for unit, place in value["forward_rank"]},
                        None if hypers is None else tuple(AdamWHyper(*h) for h in hypers))


def command_to_wire(command: Command) -> dict:
    """A command as a message; a gradient no named buffer holds cannot cross (the remote host's
    plan lands every gradient in one)."""
    if isinstance(command, GradientIn):
        assert command.tensor is None, "a gradient outside the shared buffers cannot cross"
        return {"op": "gradient_in", "unit": command.unit, "dtype": dtype_name(command.dtype),
                "numel": command.numel, "first": command.first, "landing": command.landing,
                "last": _last(command.last), "ticket": command.ticket}
    if isinstance(command, ZeroGrad):
        return {"op": "zero_grad", "set_to_none": command.set_to_none}
    if isinstance(command, Update):
        return {"op": "update", "number": command.number, "step": command.step,
                "units": list(command.units),
                "hypers": [_hyper(h) for h in command.hypers],
                "loss_scale": command.loss_scale, "mode": command.mode.value}
    assert isinstance(command, StepArrived)
    return {"op": "step_arrived", "last": _last(command.last), "step": command.step}


def command_from_wire(value: dict) -> Command:
    op = value["op"]
    if op == "gradient_in":
        return GradientIn(int(value["unit"]), DTYPES[value["dtype"]], int(value["numel"]),
                          bool(value["first"]), value["landing"], _unlast(value["last"]),
                          int(value["ticket"]))
    if op == "zero_grad":
        return ZeroGrad(bool(value["set_to_none"]))
    if op == "update":
        return Update(int(value["number"]), int(value["step"]),
                      tuple(int(u) for u in value["units"]),
                      tuple(AdamWHyper(*h) for h in value["hypers"]),
                      float(value["loss_scale"]), UpdateMode(value["mode"]))
    if op == "step_arrived":
        return StepArrived(_unlast(value["last"]), int(value["step"]))
    raise ValueError(f"unknown host command {op!r}")


COMMAND_OPS = ("gradient_in", "zero_grad", "update", "step_arrived")
