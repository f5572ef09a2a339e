"""The service's messages as JSON, derived from their declared types (tiered/service/codec.py): a
host request (its policy, plan, blocks and param-group ranges) crosses a real JSON text and comes
back equal, the plan's shards in the order they were made (the order names the NVMe files);
what a peer sends that its type does not admit is refused naming the field."""
from __future__ import annotations

import json
from typing import Literal

import pytest
import torch

from tiered.optim.groups import GroupRange
from tiered.placement.plan import Buffer, MemoryPlan, StateKind
from tiered.policy.config import Policy
from tiered.policy.kinds import Tier
from tiered.service.codec import decode, encode
from tiered.service.hostwire import HostRequest


def request(**changes) -> HostRequest:
    plan = MemoryPlan(
        shards={(1, StateKind.EXP_AVG): Buffer("unit 1 exp_avg", Tier.NVME, 300, torch.float32),
                (0, StateKind.PARAM): Buffer("unit 0 param", Tier.DRAM, 512, torch.bfloat16),
                (0, StateKind.EXP_AVG): Buffer("unit 0 exp_avg", Tier.NVME, 512, torch.uint8)},
        staging={"param_in0": Buffer("read-ahead 0", Tier.DRAM, 4096, torch.uint8)},
        working_set=12345, left_pinned=0)
    fields = dict(
        policy=Policy.from_dict({"optimizer": {"lr": 3e-4, "betas": [0.8, 0.95],
                                               "param_groups": [{"match": "bias",
                                                                 "weight_decay": 0.0}]},
                                 "nvme": {"path": "/tmp/x"}}),
        plan=plan,
        blocks={(0, StateKind.PARAM): (2, 0, 1024), ("staging", "param_in0"): (3, 4096, 4096)},
        names=["embed", "block.0"], trainable=[True, False],
        ranges=[(GroupRange(0, 100, 0), GroupRange(100, 512, None)), ()],
        threads=2, traced=True)
    fields.update(changes)
    return HostRequest(**fields)


def through_json(value):
    return json.loads(json.dumps(value))


def test_a_host_request_crosses_json_unchanged_with_its_plans_order():
    sent = request()
    received = HostRequest.from_wire(through_json(sent.to_wire()))
    assert received == sent
    assert list(received.plan.shards) == list(sent.plan.shards)
    assert received.blocks[("staging", "param_in0")] == (3, 4096, 4096)
    assert received.plan.shards[(0, StateKind.PARAM)].dtype is torch.bfloat16
    assert received.policy.optimizer.betas == (0.8, 0.95)


def test_the_fingerprint_is_the_request_but_where_its_memory_lies():
    first = request()
    moved = request(blocks={(0, StateKind.PARAM): (7, 0, 1024)}, threads=9, traced=False)
    assert through_json(moved.fingerprint()) == through_json(first.fingerprint())
    other_plan = request(plan=MemoryPlan({}, {}, 0))
    assert other_plan.fingerprint() != first.fingerprint()
    assert set(first.fingerprint()) == {"policy", "plan", "names", "trainable", "ranges"}


@pytest.mark.parametrize("path, value, said", [
    (("blocks", 0, 0), ["staging", 3], "blocks key"),           # a staging buffer named by a number
    (("blocks", 0, 0), [0, "velocity"], "velocity"),             # no such state
    (("blocks", 0, 1), [1, 2], "should have 3 items"),           # (segment, offset) without bytes
    (("ranges", 0, 0), {"start": 0, "stop": "9", "group": 0}, "ranges[0][0].stop"),
    (("trainable", 1), 1, "trainable[1]"),                       # 1 is no bool
    (("plan", "working_set"), 1.5, "plan.working_set"),
])
def test_a_field_its_type_does_not_admit_is_refused_by_name(path, value, said):
    message = through_json(request().to_wire())
    place = message
    for step in path[:-1]:
        place = place[step]
    place[path[-1]] = value
    with pytest.raises(ValueError, match=said.replace("[", r"\[").replace("]", r"\]")):
        HostRequest.from_wire(message)


def test_a_union_of_tuples_is_written_as_the_alternative_the_value_is():
    kind = tuple[int, StateKind] | tuple[Literal["staging"], str]
    assert encode((4, StateKind.GRAD), kind) == [4, "grad"]
    assert encode(("staging", "grad_in1"), kind) == ["staging", "grad_in1"]
    assert decode(["staging", "grad_in1"], kind, "key") == ("staging", "grad_in1")
    assert decode([4, "grad"], kind, "key") == (4, StateKind.GRAD)
    with pytest.raises(TypeError):
        encode(("landing", "grad_in1"), kind)
