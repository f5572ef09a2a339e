"""Building a model under tiered.init: nothing materialized whole, every parameter initialized."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import tiered

from gpt import GPT
from helpers import REPO

CPU_FP32 = dict(device="cpu", compute_dtype="fp32")


def fill_by_shape(module: nn.Module) -> None:
    """A deterministic init that differs by module class and parameter, for exact comparison."""
    for index, (name, param) in enumerate(module.named_parameters(recurse=False)):
        ramp = torch.arange(param.numel(), dtype=torch.float32).reshape(param.shape)
        param.copy_(torch.sin(ramp + 7 * index + len(type(module).__name__)))


def test_param_init_fn_gives_exactly_the_eager_values():
    with tiered.init("configs/cpu.yaml", param_init_fn=fill_by_shape, **CPU_FP32):
        model = GPT(64, 32, 3, 2, max_seq=16)
    assert all(p.is_meta for p in model.parameters()), "parameters were materialized"
    engine, _ = tiered.initialize(model)
    eager = GPT(64, 32, 3, 2, max_seq=16)
    with torch.no_grad():
        eager.apply(fill_by_shape)
    state = engine.full_state_dict()
    for name, value in eager.state_dict().items():
        assert torch.equal(state[name], value), name
    engine.close()


def test_default_init_runs_reset_parameters_in_every_unit():
    torch.manual_seed(0)
    with tiered.init("configs/cpu.yaml", **CPU_FP32):
        model = GPT(64, 32, 4, 2, max_seq=16, tied=True)
    engine, _ = tiered.initialize(model)
    state = engine.full_state_dict()
    assert all(torch.isfinite(v).all() for v in state.values())
    for i in range(4):
        assert torch.equal(state[f"blocks.{i}.ln1.weight"], torch.ones(32))
        assert torch.equal(state[f"blocks.{i}.ln1.bias"], torch.zeros(32))
        for linear, fan_in in (("qkv", 32), ("fc", 32), ("out", 128)):
            weight = state[f"blocks.{i}.{linear}.weight"]
            assert weight.abs().max() <= 1 / math.sqrt(fan_in), f"block {i} {linear}"
            assert weight.std() > 0.2 / math.sqrt(fan_in), f"block {i} {linear} not initialized"
    assert not torch.equal(state["blocks.0.fc.weight"], state["blocks.1.fc.weight"])
    # The tied weight keeps the embedding's N(0, 1) init, as in eager construction where the
    # head's own init is discarded by the tying; GPT.reset_parameters set the positions.
    assert 0.9 < state["emb.weight"].std() < 1.1
    assert 0.01 < state["pos"].std() < 0.03
    engine.close()


def test_parent_init_wins_over_child_init():
    # nn.MultiheadAttention zeroes out_proj.bias after out_proj initialized it.
    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.MultiheadAttention(16, 2) for _ in range(2))

    with tiered.init("configs/cpu.yaml", **CPU_FP32):
        model = Attention()
    engine, _ = tiered.initialize(model)
    state = engine.full_state_dict()
    assert torch.equal(state["blocks.1.out_proj.bias"], torch.zeros(16))
    assert torch.equal(state["blocks.1.in_proj_bias"], torch.zeros(48))
    assert state["blocks.1.out_proj.weight"].abs().max() > 0
    engine.close()


def test_buffers_built_in_init_keep_their_values():
    class Rotary(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8),
                                 persistent=False)
            self.proj = nn.Linear(8, 8)

        def forward(self, x):
            return self.proj(x) * self.inv_freq.repeat(2)

    with tiered.init("configs/cpu.yaml", **CPU_FP32):
        model = nn.Sequential(Rotary(), Rotary())
    engine, _ = tiered.initialize(model)
    expected = 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8)
    assert torch.equal(model[0].inv_freq, expected)
    assert torch.isfinite(engine(torch.randn(3, 8))).all()
    engine.close()


def test_module_without_reset_parameters_is_named():
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.gain = nn.Parameter(torch.ones(4))

    with tiered.init("configs/cpu.yaml", **CPU_FP32):
        model = nn.Sequential(Scale(), Scale())
    with pytest.raises(tiered.TieredError, match=r"Scale holds parameters \['gain'\].*param_init_fn"):
        tiered.initialize(model)


def test_model_larger_than_dram_builds_with_nvme_policy(tmp_path):
    # 16 blocks of width 512: 51 M parameters, 0.82 GB of training state (16 bytes each),
    # 2.4 times the DRAM budget.
    # DRAM holds only the fp32 gradients and staging; everything else goes to the files.
    layers, dim = 16, 512
    dram_budget = 330 * 2**20
    out = subprocess.run(
        [sys.executable, os.path.join(REPO, "tests", "scripts", "build_large.py"), str(tmp_path),
         str(dram_budget), str(layers), str(dim)],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    state_bytes = 16 * result["params"]
    assert state_bytes > 2 * dram_budget
    report = result["report"]
    assert report["dram"]["peak"] <= dram_budget
    assert report["nvme"]["current"] >= 12 * result["params"]
    # Building costs nothing; partitioning holds one unit (and its fp32 copy) at a time besides
    # the staging buffers: the process never holds even the fp32 weights all at once (measured
    # here: 40-125 MB of growth for 206 MB of fp32 weights).
    assert result["build_growth"] < 16 * 2**20
    assert result["init_growth"] < 4 * result["params"]
    assert result["init_growth"] < dram_budget + 16 * result["largest_unit"]
    assert all(math.isfinite(v) for row in result["sample"] for v in row)


def test_device_bytes_count_every_parameter_materialized_with_a_unit():
    """A head whose weight is tied to the embedding and whose bias is its own: with
    units.split_large the head is a unit owning only the bias, but building it materializes the
    head module's every parameter, the tied weight too, and both are counted."""
    from tiered.engine.init import Materializer
    from tiered.placement.units import find_units

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(512, 16)
            self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
            self.head = nn.Linear(16, 512)
            self.head.weight = self.emb.weight

    with torch.device("meta"):
        model = Tied()
    units = find_units(model, None, split_large=True)
    assert [u.path for u in units] == ["blocks.0", "blocks.1", "head", ""]
    materializer = Materializer(model, units, torch.device("cpu"), None)
    head = units[2]
    assert [p.names for p in head.params] == [("head.bias",)]
    assert materializer.device_bytes([head]) == (512 + 512 * 16) * 4
    materializer.values(head)
    assert not model.head.weight.is_meta and not model.head.bias.is_meta
    assert materializer.device_bytes([units[3]]) == 0  # the root's tied weight exists already


class AttentionBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x):
        h = self.ln(x)
        return x + self.attn(h, h, h, need_weights=False)[0]


class AttentionNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(AttentionBlock() for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("frozen", ["attn.out_proj", "attn.in_proj"])
def test_the_halves_of_a_split_module_are_built_at_once(frozen):
    # MultiheadAttention's init zeroes its child out_proj's bias: with out_proj frozen or
    # in_proj frozen, the block's halves hold the two, and each must see the whole init.
    states = {}
    for split in (False, True):
        torch.manual_seed(0)
        overrides = dict(compute_dtype="fp32", device="cpu", units={"split_frozen": split})
        with tiered.init(**overrides):
            net = AttentionNet()
        for name, param in net.named_parameters():
            param.requires_grad_(not name.split(".", 2)[2].startswith(frozen))
        engine, _ = tiered.initialize(net, **overrides)
        assert len(engine.runtime.flats) == (4 if split else 2)
        states[split] = engine.full_state_dict()
        assert engine.memory_report()["hbm"]["peak"] <= engine.manager.plan.working_set
        engine.close()
    assert not states[True]["blocks.0.attn.out_proj.bias"].any()
    assert all(torch.equal(states[True][name], value) for name, value in states[False].items())
