"""Pretrained weights by name into the tiers: ``tiered.initialize(model, weights=...)``,
``engine.load_state_dict`` and ``engine.load_pretrained``. A load gives the model PyTorch's
``load_state_dict`` would give it, training on from there matches PyTorch bit for bit, a unit
the weights hold is never initialized, and each rank reads its own shards' elements only."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from torch import nn

import tiered
from tiered.checkpoint import sources
from tiered.engine.init import reset_module
from tiered.ops.tiled_linear import tile_large_linears

from distributed import run_ranks
from gpt import GPT, add_lora, next_token_loss
from helpers import REPO
from helpers_models import (OPTIM, SEQ, VOCAB, assert_parity_on_host, batches, make_model,
                            run_engine, train_torch)


def pretrained() -> dict[str, torch.Tensor]:
    """Weights other than the ones the engine's model starts with (make_model's)."""
    torch.manual_seed(5)
    model = GPT(VOCAB, 32, 2, 2, max_seq=SEQ, tied=True, qkv_bias=False)
    return {name: value.clone() for name, value in model.state_dict().items()}


def engine_for(policy: str, nvme: str, model: nn.Module | None = None, **kwargs):
    return tiered.initialize(model if model is not None else make_model(),
                             os.path.join(REPO, "configs", f"{policy}.yaml"),
                             device="cpu", nvme={"path": nvme},
                             **{"compute_dtype": "fp32", "optimizer": OPTIM, **kwargs})


def export(weights: dict, tmp_path, **options) -> tuple[str, list[str]]:
    """``weights`` exported by an engine's save_pretrained: (the folder, its files)."""
    folder = str(tmp_path / "export")
    engine, _ = engine_for("cpu", str(tmp_path), weights=weights)
    files = engine.save_pretrained(folder, **options)
    engine.close()
    return folder, files


def built_under_init(calls: list[str], **overrides) -> GPT:
    """make_model's GPT on meta parameters, recording each module ``initialize`` initializes."""
    def init_fn(module: nn.Module) -> None:
        calls.append(type(module).__name__)
        reset_module(module)

    with tiered.init(param_init_fn=init_fn, **overrides):
        return make_model()


def assert_equal_states(state: dict, expected: dict) -> None:
    assert list(state) == list(expected)
    for name in expected:
        assert torch.equal(state[name], expected[name]), name


@pytest.mark.parametrize("policy", ["cpu", "nvme", "gpu"])
def test_training_after_a_load_is_torchs_bit_for_bit(policy, tmp_path):
    weights = pretrained()
    engine, optimizer = engine_for(policy, str(tmp_path))
    assert engine.load_state_dict(weights) == ([], [])
    assert_equal_states(engine.full_state_dict(), weights)
    state = run_engine(engine, optimizer)
    engine.close()
    model = make_model()
    model.load_state_dict(weights)
    expected = train_torch(model, torch.optim.AdamW(model.parameters(), fused=True, **OPTIM))
    assert_equal_states(state, expected)


@pytest.mark.parametrize("compute_dtype", ["fp32", "bf16"])
def test_initialize_builds_units_from_the_weights_without_initializing_them(compute_dtype,
                                                                           tmp_path):
    weights = pretrained()
    calls: list[str] = []
    model = built_under_init(calls, compute_dtype=compute_dtype, device="cpu")
    engine, optimizer = tiered.initialize(model, weights=weights)
    assert calls == []
    # The fp32 masters hold the weights exactly, whatever the compute dtype.
    assert_equal_states(engine.full_state_dict(), weights)
    state = run_engine(engine, optimizer, steps=slice(0, 1))
    engine.close()
    assert not torch.equal(state["blocks.0.fc.weight"], weights["blocks.0.fc.weight"])


def test_adapters_missing_from_the_weights_are_initialized_and_named(tmp_path):
    """LoRA on a pretrained model: the base weights come from the files, the adapters (not in
    them) from their own initialization, and the warning names them."""
    weights = pretrained()
    folder, _ = export(weights, tmp_path)
    calls: list[str] = []
    with tiered.init(compute_dtype="fp32", device="cpu",
                     param_init_fn=lambda m: (calls.append(type(m).__name__), reset_module(m))):
        model = add_lora(make_model(), 4)
    with pytest.raises(tiered.CheckpointError, match="blocks.0.qkv.lora_a"):
        tiered.initialize(model, weights=folder)
    with pytest.warns(UserWarning, match=r"16 parameters, buffers or extra states are not in "
                                         r".*lora_a"):
        engine, _ = tiered.initialize(model, weights=folder, strict=False)
    state = engine.full_state_dict()
    engine.close()
    # A block whose layers have adapters is built as without weights, then takes the weights
    # it holds (a layer's init touches its frozen weight too); the root unit (embedding, tied
    # head, positions, final norm) is read, not initialized.
    assert "LoRALinear" in calls and not {"Embedding", "GPT"} & set(calls)
    for name, value in state.items():
        if "lora_" in name:
            assert name.endswith("lora_a") or torch.count_nonzero(value) == 0, name
        else:
            assert torch.equal(value, weights[name]), name


def test_sharded_export_loads_back_exactly(tmp_path):
    weights = pretrained()
    folder, files = export(weights, tmp_path, dtype=torch.bfloat16, max_shard_bytes=8192)
    assert len(files) > 3 and os.path.exists(os.path.join(folder, sources.INDEX))
    engine, _ = engine_for("nvme", str(tmp_path))
    assert engine.load_pretrained(folder) == ([], [])
    state = engine.full_state_dict()
    engine.close()
    assert_equal_states(state, {name: value.bfloat16().float() for name, value in weights.items()})


@pytest.mark.parametrize("kept", ["emb.weight", "head.weight"])
def test_a_tied_parameter_loads_from_either_of_its_names(kept, tmp_path):
    """Hugging Face files keep one name of tied weights."""
    weights = pretrained()
    dropped = {"emb.weight": "head.weight", "head.weight": "emb.weight"}[kept]
    partial = {name: value for name, value in weights.items() if name != dropped}
    engine, _ = engine_for("cpu", str(tmp_path))
    assert engine.load_state_dict(partial) == ([], [])
    state = engine.full_state_dict()
    engine.close()
    assert_equal_states(state, weights)


def test_tiles_read_their_blocks_of_the_layer(tmp_path):
    """Linear layers tiled two ways (rows and columns) load nn.Linear's weight and bias."""
    weights = pretrained()
    tiling = {"max_unit_bytes": 100}  # a 32-wide fp32 row is 128 bytes: columns split too
    engine, optimizer = engine_for("cpu", str(tmp_path), tiling=tiling)
    assert any(".tiles.3." in name for flat in engine.runtime.flats
               for spec in flat.spec.params for name in spec.names)
    assert engine.load_state_dict(weights) == ([], [])
    assert_equal_states(engine.full_state_dict(), weights)
    idx = batches()[0][0]
    with torch.no_grad():
        logits = engine(idx)
    engine.close()
    calls: list[str] = []
    direct, _ = tiered.initialize(built_under_init(calls, compute_dtype="fp32", device="cpu"),
                                  weights=weights, tiling=tiling)
    assert calls == []
    assert_equal_states(direct.full_state_dict(), weights)
    direct.close()
    model = make_model()
    model.load_state_dict(weights)
    tile_large_linears(model, tiling["max_unit_bytes"], 4)  # the same sums in the same order
    with torch.no_grad():
        assert torch.equal(logits, model(idx))


def test_persistent_buffers_load_and_others_are_left(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 4))
    model[2].register_buffer("scratch", torch.ones(3), persistent=False)
    weights = {name: torch.randn_like(value) if value.is_floating_point() else value + 7
               for name, value in model.state_dict().items()}
    engine, _ = engine_for("cpu", str(tmp_path), model=model)
    assert engine.load_state_dict(weights) == ([], [])
    assert_equal_states(engine.full_state_dict(), weights)
    assert torch.equal(model[2].scratch, torch.ones(3))
    engine.close()


def test_a_model_in_bf16_rounds_what_it_loads_as_torch_does(tmp_path):
    weights = pretrained()
    model = make_model().to(torch.bfloat16)
    engine, _ = engine_for("cpu", str(tmp_path), model=model, compute_dtype="bf16")
    engine.load_state_dict(weights)
    state = engine.full_state_dict()
    engine.close()
    reference = make_model().to(torch.bfloat16)
    reference.load_state_dict(weights)
    assert_equal_states(state, {name: value.float() for name, value in
                                reference.state_dict().items()})


def test_a_pending_delayed_update_does_not_write_over_the_load(tmp_path):
    weights = pretrained()
    engine, optimizer = engine_for(
        "cpu", str(tmp_path),
        optimizer=dict(OPTIM, delayed_update={"enabled": True, "warmup_steps": 0}))
    idx = batches()[0][0]
    next_token_loss(engine(idx), idx).backward()
    optimizer.step()  # returns at once: its update is still to be applied
    optimizer.zero_grad()
    engine.load_state_dict(weights)
    assert_equal_states(engine.full_state_dict(), weights)
    with torch.no_grad():
        logits = engine(idx)
    engine.close()
    model = make_model()
    model.load_state_dict(weights)
    with torch.no_grad():
        assert torch.equal(logits, model(idx))


def test_the_moments_stay_as_torchs_do(tmp_path):
    """A load mid-training replaces the weights and keeps AdamW's state, as
    ``model.load_state_dict`` keeps a torch optimizer's."""
    weights = pretrained()
    engine, optimizer = engine_for("cpu", str(tmp_path))
    run_engine(engine, optimizer, steps=slice(0, 2))
    engine.load_state_dict(weights)
    state = run_engine(engine, optimizer, steps=slice(2, None))
    engine.close()
    model = make_model()
    reference = torch.optim.AdamW(model.parameters(), fused=True, **OPTIM)
    train_torch(model, reference, steps=slice(0, 2))
    model.load_state_dict(weights)
    assert_equal_states(state, train_torch(model, reference, steps=slice(2, None)))


def _read_own_shards(rank: int, world: int, folder: str, nvme: str, out: str) -> None:
    read = []
    original = sources.SafetensorsSource.read

    def counting(self, name, start, count):
        read.append(count)
        return original(self, name, start, count)

    sources.SafetensorsSource.read = counting
    calls: list[str] = []
    model = built_under_init(calls, compute_dtype="fp32", device="cpu")
    engine, optimizer = tiered.initialize(
        model, os.path.join(REPO, "configs", "nvme.yaml"), weights=folder,
        nvme={"path": nvme}, optimizer=OPTIM)
    loaded = engine.full_state_dict()
    own = 0
    for flat in engine.runtime.flats:
        start, end = flat.shard_range
        own += max(0, min(end, flat.numel) - start)
    own_reads = sum(read)
    run_engine(engine, optimizer, steps=slice(0, 1), rank=rank, world=world)
    engine.load_pretrained(folder)
    reloaded = engine.full_state_dict()
    engine.close()
    torch.save({"calls": calls, "own": own, "read": own_reads, "loaded": loaded,
                "reloaded": reloaded}, os.path.join(out, f"rank{rank}.pt"))


@pytest.mark.parametrize("world", [2, 3])
def test_each_rank_reads_its_own_shards_only(world, tmp_path):
    weights = pretrained()
    folder, _ = export(weights, tmp_path, max_shard_bytes=16384)
    run_ranks(world, _read_own_shards, folder, str(tmp_path), str(tmp_path))
    total = sum(value.numel() for name, value in weights.items() if name != "head.weight")
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(world)]
    assert sum(result["own"] for result in results) == total
    for result in results:
        assert result["calls"] == []
        assert result["read"] == result["own"]
        assert_equal_states(result["loaded"], weights)
        assert_equal_states(result["reloaded"], weights)


def test_the_example_fine_tunes_from_exported_weights(tmp_path):
    """Real runs of the example: one exports its weights, the next starts from them with LoRA
    adapters on top, at the loss where the first ended instead of ln(vocab)."""
    folder = str(tmp_path / "weights")

    def run(*args: str) -> list[float]:
        done = subprocess.run([sys.executable, os.path.join(REPO, "examples", "train_gpt.py"),
                               *args], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return [float(x) for x in re.findall(r"loss (\d+\.\d+)", done.stdout)]

    trained = run("--steps", "25", "--save-pretrained", folder)
    assert os.path.exists(os.path.join(folder, sources.SINGLE_FILE))
    tuned = run("--steps", "20", "--init-from", folder, "--lora", "4")
    assert trained[0] > 6.0  # ln(512) = 6.24 from a random start
    assert trained[-1] < 5.0 and tuned[0] < trained[-1] + 0.2  # on from where it ended


class _TiedAcrossBlocks(nn.Module):
    """Two blocks sharing one weight (so the root unit owns it) beside their own biases."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.blocks[1].weight = self.blocks[0].weight

    def forward(self, x):
        return self.blocks[1](self.blocks[0](x))


def test_weights_holding_part_of_a_module_spread_over_units(tmp_path):
    """The biases (block units) are in the weights, the weight tied across the blocks (the
    root unit) is not: the blocks' layers are initialized whole, then take the biases."""
    torch.manual_seed(0)
    biases = {k: torch.randn_like(v) for k, v in _TiedAcrossBlocks().state_dict().items()
              if k.endswith("bias")}

    def build(weights=None) -> dict[str, torch.Tensor]:
        with tiered.init(device="cpu", compute_dtype="fp32"):
            model = _TiedAcrossBlocks()
        torch.manual_seed(1)
        engine, _ = tiered.initialize(model, weights=weights, strict=False)
        state = engine.full_state_dict()
        engine.close()
        return state

    initialized = build()
    with pytest.warns(UserWarning, match="blocks.0.weight"):
        state = build(biases)
    for name, value in state.items():
        assert torch.equal(value, biases.get(name, initialized[name])), name
    assert not torch.equal(initialized["blocks.0.bias"], biases["blocks.0.bias"])


def test_a_tied_parameter_named_twice_takes_the_last_as_torch_does(tmp_path):
    weights = pretrained()
    weights["head.weight"] = weights["emb.weight"] + 1  # after emb.weight in state-dict order
    engine, _ = engine_for("cpu", str(tmp_path))
    engine.load_state_dict(weights)
    state = engine.full_state_dict()
    engine.close()
    model = make_model()
    model.load_state_dict(weights)
    assert_equal_states(state, model.state_dict())


class _Counted(nn.Linear):
    """A layer with extra state (as TransformerEngine's FP8 layers have)."""

    count = 0

    def get_extra_state(self):
        return {"count": self.count}

    def set_extra_state(self, state):
        self.count = state["count"]


def test_extra_states_load_as_torch_loads_them(tmp_path):
    model = nn.Sequential(_Counted(4, 4), nn.Linear(4, 2))
    engine, _ = engine_for("cpu", str(tmp_path), model=model)
    state = engine.full_state_dict()
    state["0._extra_state"] = {"count": 7}
    assert engine.load_state_dict(state) == ([], [])
    assert model[0].count == 7
    assert engine.load_state_dict(engine.full_state_dict()) == ([], [])
    engine.close()


def test_the_index_file_itself_names_the_folder(tmp_path, monkeypatch):
    weights = pretrained()
    folder, _ = export(weights, tmp_path, max_shard_bytes=8192)
    engine, _ = engine_for("cpu", str(tmp_path))
    assert engine.load_pretrained(os.path.join(folder, sources.INDEX)) == ([], [])
    assert_equal_states(engine.full_state_dict(), weights)
    engine.load_state_dict(make_model().state_dict())
    monkeypatch.chdir(folder)
    assert engine.load_pretrained(sources.INDEX) == ([], [])  # a bare name: this folder
    assert_equal_states(engine.full_state_dict(), weights)
    engine.close()


class _Stateless(nn.Linear):
    """A layer whose extra state is None (as a module may return before it has any)."""

    def get_extra_state(self):
        return None

    def set_extra_state(self, state):
        assert state is None


def test_an_extra_state_of_none_round_trips(tmp_path):
    model = nn.Sequential(_Stateless(4, 4), nn.Linear(4, 2))
    engine, _ = engine_for("cpu", str(tmp_path), model=model)
    assert engine.load_state_dict(engine.full_state_dict()) == ([], [])
    engine.close()


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["cpu", "gpu"])
def test_weights_into_states_on_cuda(policy, tmp_path):
    """Shards read on the host into device-tier states (gpu.yaml) or pinned DRAM beside the GPU;
    training from there matches torch on the GPU."""
    weights = pretrained()
    engine, optimizer = tiered.initialize(
        make_model(), os.path.join(REPO, "configs", f"{policy}.yaml"), weights=weights,
        compute_dtype="fp32", device="cuda", optimizer=OPTIM)
    assert_equal_states(engine.full_state_dict(), weights)
    state = run_engine(engine, optimizer)
    engine.close()
    model = make_model().cuda()
    model.load_state_dict(weights)
    expected = train_torch(model, torch.optim.AdamW(model.parameters(), fused=True, **OPTIM),
                           device="cuda")
    assert_parity_on_host(state, expected)
