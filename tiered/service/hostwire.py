"""A rank's host as data on the wire: its plan, its setup, its commands and its events as JSON
values (wire.py carries them), so that the node's service can run the host a trainer would run
in a thread of its own (optim/host.py).

The commands' messages are their dataclasses' fields and the events' the parameters of
HostEvents' methods, both through codec.py: a command or an event is declared once, in
optim/commands.py. Nothing here is a tensor: memory is named by what it is (a unit's state, a
staging buffer), and both sides find it in the segments they share."""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

from ..optim.commands import Command, GradientIn, HostEvents, StepArrived, Update, ZeroGrad
from ..optim.groups import GroupRange
from ..placement.plan import BlockKey, MemoryPlan
from ..policy.config import Policy
from ..policy.kinds import Tier
from .codec import decode, encode, fields_from_wire, fields_to_wire, op_name, parameter_types


@dataclass(frozen=True)
class HostRequest:
    """What a trainer asks of the service to run its rank's host there."""

    policy: Policy
    plan: MemoryPlan
    blocks: dict[BlockKey, tuple[int, int, int]]
    """Where each DRAM state and staging buffer lies in the rank's segments: (segment, byte
    offset, bytes) (TierManager.descriptors)."""
    names: list[str]
    trainable: list[bool]
    ranges: list[tuple[GroupRange, ...]]
    threads: int
    """The CPU update's threads for this rank."""
    traced: bool = False
    """Whether the trainer keeps a timeline: the host's spans are sent to it (hosting.py)."""

    def to_wire(self) -> dict:
        return fields_to_wire(self)

    def fingerprint(self) -> dict:
        """What a relaunch of the rank must ask for alike to take its kept state over: the
        policy, the plan (and so every unit's size and placement), the units and their param
        groups; not where its memory lies or how many threads it gets."""
        return fields_to_wire(self, skip=frozenset({"blocks", "threads", "traced"}))

    @classmethod
    def from_wire(cls, value: dict) -> "HostRequest":
        return fields_from_wire(cls, value)

    @property
    def has_nvme_shards(self) -> bool:
        """Whether its plan has shards on NVMe (the rank's files are then its state too)."""
        return any(buffer.tier is Tier.NVME for buffer in self.plan.shards.values())

    @property
    def segment_ids(self) -> list[int]:
        """The segments its blocks lie in."""
        return sorted({segment for segment, _, _ in self.blocks.values()})


COMMANDS: dict[str, type] = {op_name(kind): kind
                             for kind in (GradientIn, ZeroGrad, Update, StepArrived)}
"""What the training side sends its host, by the ``op`` of its message."""
IN_PROCESS_ONLY = frozenset({"ready", "tensor"})
"""GradientIn's fields that never cross: the copy's CUDA event (the trainer's sender waits for
it before sending: remote.py) and a gradient no shared buffer holds."""


def command_to_wire(command: Command) -> dict:
    """A command as a message; a gradient no named buffer holds cannot cross (the remote host's
    plan lands every gradient in one)."""
    assert getattr(command, "tensor", None) is None, \
        "a gradient outside the shared buffers cannot cross"
    return {"op": op_name(type(command)), **fields_to_wire(command, IN_PROCESS_ONLY)}


def command_from_wire(message: dict) -> Command:
    """The command a message carries; ValueError naming what is wrong in it."""
    kind = COMMANDS.get(message["op"])
    if kind is None:
        raise ValueError(f"unknown host command {message['op']!r}")
    return fields_from_wire(kind, message, IN_PROCESS_ONLY)


EVENTS: dict[str, Callable] = {name: method for name, method
                               in inspect.getmembers(HostEvents, inspect.isfunction)
                               if not name.startswith("_")}
"""What a host tells the training side: HostEvents' methods, by name (an event's ``op``)."""


class EventSender:
    """HostEvents whose every call is sent as a message (the host's end in the service): an
    event's fields are its method's parameters, by name."""

    def __init__(self, send: Callable[[dict], None]):
        self._send = send

    def __getattr__(self, name: str) -> Callable[..., None]:
        if name not in EVENTS:
            raise AttributeError(name)
        signature = inspect.signature(EVENTS[name])
        kinds = parameter_types(EVENTS[name])

        def send(*args, **kwargs) -> None:
            given = signature.bind(None, *args, **kwargs).arguments
            self._send({"op": name, **{key: encode(given[key], kind)
                                        for key, kind in kinds.items()}})
        return send


@dataclass(frozen=True)
class Span:
    """A span the host timed in the service, for the trainer's timeline (Timeline.record)."""

    name: str
    category: str
    track: str
    start_ns: int
    duration_ns: int
    args: dict[str, Any] | None


def span_to_wire(span: Span) -> dict:
    return {"op": op_name(Span), **fields_to_wire(span)}


def span_from_wire(message: dict) -> Span:
    return fields_from_wire(Span, message)


def deliver(message: dict, events: HostEvents) -> None:
    """Call the method of ``events`` an event's message names, with its fields (the trainer's
    end); ValueError for a message that is no event."""
    method = EVENTS.get(message["op"])
    if method is None:
        raise ValueError(f"unknown host event {message['op']!r}")
    kinds = parameter_types(method)
    getattr(events, message["op"])(**{key: decode(message.get(key), kind, key)
                                       for key, kind in kinds.items()})
