"""Refused weight loads, what is wrong with the values: names, shapes and dtypes that do not
match the model, a load at the wrong moment, bad ``tiered.initialize(model, weights=...)`` and a
load refused on one rank of two. Each fails with a CheckpointError naming the key or value at
fault and changes nothing; a refused ``initialize`` leaves the model as it came. With
``strict=False`` what is missing keeps its value and the result lists what did not match."""
from __future__ import annotations

import importlib
import math
import os
import warnings

import pytest
import torch
from refusals import (DIM, LAST_UNIT_KEY, SEQ, VOCAB, batch, f32_entries, goes_on_as_never_loaded,
                      good_state, make_model, new_engine, raw, step, write_safetensors)
from torch import nn

import tiered

from distributed import run_ranks
from gpt import next_token_loss
from helpers import CONFIGS, assert_same, refused

engine_module = importlib.import_module("tiered.engine.engine")


# --- 5. names, shapes and dtypes that do not match the model ---------------------------------

@pytest.mark.parametrize("key,wrong", [(LAST_UNIT_KEY, (VOCAB, DIM - 1)),
                                       ("blocks.1.fc.bias", (4 * DIM, 1)),
                                       ("pos", (SEQ // 2, DIM))])
def test_a_wrong_shape_is_refused_naming_the_key_and_both_shapes(key, wrong, trained, reference):
    engine, optimizer = trained
    state = good_state()
    right = list(state[key].shape)
    state[key] = torch.zeros(wrong)
    refused(engine, lambda: engine.load_state_dict(state), "the state dict", key,
            str(list(wrong)), str(right))
    refused(engine, lambda: engine.load_state_dict(state, strict=False), key, str(list(wrong)))
    goes_on_as_never_loaded(engine, optimizer, reference)


def test_a_wrong_shape_in_a_file_names_the_file_too(trained, reference, tmp_path):
    engine, optimizer = trained
    state = good_state()
    state["pos"] = state["pos"][:SEQ // 2].clone()
    path = write_safetensors(tmp_path / "model.safetensors", f32_entries(state))
    refused(engine, lambda: engine.load_pretrained(path), path, "pos", str([SEQ // 2, DIM]),
            str([SEQ, DIM]))
    goes_on_as_never_loaded(engine, optimizer, reference)


def test_a_missing_key_is_refused_under_strict_listing_it(trained, reference):
    engine, optimizer = trained
    state = good_state()
    del state["blocks.1.fc.bias"]
    refused(engine, lambda: engine.load_state_dict(state), "blocks.1.fc.bias", "1 missing",
            "strict=False")
    goes_on_as_never_loaded(engine, optimizer, reference)


def test_an_unexpected_key_is_refused_under_strict_listing_it(trained, reference):
    engine, optimizer = trained
    state = good_state()
    state["blocks.2.fc.bias"] = torch.zeros(4 * DIM)
    message = refused(engine, lambda: engine.load_state_dict(state), "blocks.2.fc.bias",
                      "1 unexpected", "strict=False")
    assert "missing:" not in message, message
    goes_on_as_never_loaded(engine, optimizer, reference)


def test_missing_and_unexpected_keys_are_both_listed(trained, reference, tmp_path):
    engine, optimizer = trained
    state = good_state()
    del state["emb.weight"], state[LAST_UNIT_KEY]
    state["lm_head.weight"] = torch.zeros(VOCAB, DIM)
    path = write_safetensors(tmp_path / "model.safetensors", f32_entries(state))
    refused(engine, lambda: engine.load_pretrained(path), path, "2 missing", "emb.weight",
            LAST_UNIT_KEY, "1 unexpected", "lm_head.weight", "strict=False")
    goes_on_as_never_loaded(engine, optimizer, reference)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_a_parameter_given_as_an_integer_tensor_is_refused(dtype, trained, reference):
    engine, optimizer = trained
    state = good_state()
    state["ln.weight"] = torch.ones(DIM, dtype=dtype)
    refused(engine, lambda: engine.load_state_dict(state), "ln.weight", str(dtype),
            "floating-point")
    refused(engine, lambda: engine.load_state_dict(state, strict=False), "ln.weight", str(dtype))
    goes_on_as_never_loaded(engine, optimizer, reference)


def test_an_integer_parameter_in_a_file_is_refused(trained, reference, tmp_path):
    engine, optimizer = trained
    entries = f32_entries(good_state())
    entries[LAST_UNIT_KEY] = ("I64", [VOCAB, DIM], raw(torch.ones(VOCAB, DIM, dtype=torch.int64)))
    path = write_safetensors(tmp_path / "model.safetensors", entries)
    refused(engine, lambda: engine.load_pretrained(path), path, LAST_UNIT_KEY, "torch.int64")
    goes_on_as_never_loaded(engine, optimizer, reference)


def test_a_value_that_is_not_a_tensor_is_refused_naming_its_key(trained, reference):
    engine, optimizer = trained
    state = good_state()
    state["ln.bias"] = [0.0] * DIM
    refused(engine, lambda: engine.load_state_dict(state), "'ln.bias'", "list", "not a tensor")
    goes_on_as_never_loaded(engine, optimizer, reference)


def test_a_load_between_forward_and_backward_is_refused(trained, reference):
    engine, optimizer = trained
    before = engine.full_state_dict()
    idx = batch(2)
    loss = next_token_loss(engine(idx), idx)
    with pytest.raises(tiered.CheckpointError, match="between a forward"):
        engine.load_state_dict(good_state())
    loss.backward()
    assert_same(engine.full_state_dict(), before, "loaded while gathered")
    optimizer.step()
    optimizer.zero_grad()
    assert_same(engine.full_state_dict(), reference[1], "the step after the refusal")


def test_a_wrong_shape_for_a_tiled_layer_names_the_layer_key(tmp_path):
    engine, optimizer = new_engine(tiling={"max_unit_bytes": 4096})
    assert isinstance(engine.module.blocks[1].fc, tiered.TiledLinear)
    step(engine, optimizer, 1)
    state = good_state()
    state["blocks.1.fc.weight"] = torch.zeros(4 * DIM, DIM + 1)
    message = refused(engine, lambda: engine.load_state_dict(state), "blocks.1.fc.weight",
                      str([4 * DIM, DIM + 1]), str([4 * DIM, DIM]))
    assert "tiles" not in message, message
    assert math.isfinite(step(engine, optimizer, 2))
    engine.close()


class Buffered(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, 8)
        self.out = nn.Linear(8, 4)
        self.register_buffer("scale", torch.full((8,), 2.0))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, x):
        return self.out(torch.tanh(self.inp(x)) * self.scale)


def test_buffers_a_wrong_shape_refused_a_missing_one_kept_a_non_persistent_one_unexpected():
    engine, optimizer = new_engine(Buffered())
    before = engine.full_state_dict()
    assert "scale" in before and "scratch" not in before
    state = {k: v + 1 for k, v in before.items()}
    state["scale"] = torch.ones(9)
    refused(engine, lambda: engine.load_state_dict(state), "scale", "[9]", "[8]")
    state["scale"] = torch.full((8,), 5.0)
    state["scratch"] = torch.ones(3)
    refused(engine, lambda: engine.load_state_dict(state), "1 unexpected", "scratch")
    del state["scale"]
    result = engine.load_state_dict(state, strict=False)
    assert result == (["scale"], ["scratch"])
    loaded = engine.full_state_dict()
    assert torch.equal(loaded["scale"], before["scale"])
    assert torch.equal(engine.module.scratch, torch.zeros(3))
    assert_same({k: v for k, v in loaded.items() if k != "scale"},
                {k: state[k] for k in loaded if k != "scale"})
    engine.close()



# --- 7. strict=False -------------------------------------------------------------------------

@pytest.mark.parametrize("policy,source", [("cpu", "state dict"), ("cpu", "file"),
                                           ("nvme", "state dict")])
def test_strict_false_loads_what_matches_and_keeps_the_rest(policy, source, tmp_path):
    policy_file = str(CONFIGS / f"{policy}.yaml")
    engine, optimizer = tiered.initialize(
        make_model(), policy_file, device="cpu", compute_dtype="fp32",
        nvme={"path": str(tmp_path)}, optimizer={"lr": 1e-2})
    step(engine, optimizer, 1)
    before = engine.full_state_dict()
    state = good_state()
    # A whole unit missing (blocks.0), one parameter of a unit (blocks.1), and the root's
    # first and last parameters; two names the model does not have.
    missing = [n for n in state if n.startswith("blocks.0.")] + ["blocks.1.fc.bias", "pos",
                                                                 LAST_UNIT_KEY]
    for name in missing:
        del state[name]
    state["blocks.7.fc.bias"] = torch.zeros(3)  # not the model's: never checked, never read
    state["extra"] = torch.ones(2, dtype=torch.int64)
    if source == "file":
        result = engine.load_pretrained(
            write_safetensors(tmp_path / "partial.safetensors",
                              {n: ("I64" if v.dtype == torch.int64 else "F32", list(v.shape),
                                   raw(v)) for n, v in state.items()}), strict=False)
    else:
        result = engine.load_state_dict(state, strict=False)
    assert isinstance(result, tiered.checkpoint.pretrained.LoadResult)
    assert result._fields == ("missing_keys", "unexpected_keys")
    assert sorted(result.missing_keys) == sorted(missing)
    assert len(result.missing_keys) == len(missing)
    assert result.unexpected_keys == ["blocks.7.fc.bias", "extra"]
    loaded = engine.full_state_dict()
    for name in loaded:
        expected = before[name] if name in missing else state[name]
        assert torch.equal(loaded[name], expected), name
    # The compute weights are the loaded ones too: the forward is a plain model's with them.
    plain = make_model()
    plain.load_state_dict(loaded)
    idx = batch(3)
    with torch.no_grad():
        assert torch.equal(engine(idx), plain(idx))
    assert math.isfinite(step(engine, optimizer, 2))
    engine.close()


# --- 8. tiered.initialize(model, weights=...) ------------------------------------------------

class Recorded:
    """Stands in for TierManager: records that one was made (tiers allocated)."""

    made = 0

    def __init__(self, *args, **kwargs):
        Recorded.made += 1
        self._real = real_tier_manager(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._real, name)


real_tier_manager = engine_module.TierManager


def _missing_strict(tmp_path):
    state = good_state()
    del state["blocks.1.fc.bias"]
    return state, ["blocks.1.fc.bias", "strict=False"]


def _wrong_shape(tmp_path):
    state = good_state()
    state[LAST_UNIT_KEY] = torch.zeros(VOCAB + 1, DIM)
    return state, [LAST_UNIT_KEY, str([VOCAB + 1, DIM]), str([VOCAB, DIM])]


def _integer(tmp_path):
    state = good_state()
    state["ln.weight"] = torch.ones(DIM, dtype=torch.int64)
    return state, ["ln.weight", "torch.int64"]


def _no_such_path(tmp_path):
    return str(tmp_path / "nowhere"), [str(tmp_path / "nowhere"), "no such file or folder"]


def _truncated(tmp_path):
    path = write_safetensors(tmp_path / "model.safetensors", f32_entries(good_state()))
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 1)
    return path, [path, "truncated"]


@pytest.mark.parametrize("tiling", [None, 4096], ids=["plain", "tiled"])
@pytest.mark.parametrize("case", [_missing_strict, _wrong_shape, _integer, _no_such_path,
                                  _truncated], ids=lambda case: case.__name__[1:])
def test_initialize_refuses_bad_weights_before_allocating_and_leaves_the_model(
        case, tiling, tmp_path, monkeypatch):
    model = make_model()
    original = {k: v.clone() for k, v in model.state_dict().items()}
    params = dict(model.named_parameters())
    weights, parts = case(tmp_path)
    overrides = {"tiling": {"max_unit_bytes": tiling}} if tiling else {}
    Recorded.made = 0
    monkeypatch.setattr(engine_module, "TierManager", Recorded)
    with pytest.raises(tiered.CheckpointError) as error:
        new_engine(model, weights=weights, **overrides)
    monkeypatch.undo()
    for part in parts:
        assert part in str(error.value), str(error.value)
    assert Recorded.made == 0, "tiers were allocated before the weights were checked"
    assert model not in engine_module._managed
    assert type(model.blocks[1].fc) is nn.Linear, "a tiled layer was not put back"
    assert dict(model.named_parameters()) == params  # the same Parameter objects, in place
    assert_same(model.state_dict(), original, "the refused model")
    engine, optimizer = new_engine(model, **overrides)  # without weights: it works as ever
    assert_same(engine.full_state_dict(), original, "initialized after the refusal")
    assert math.isfinite(step(engine, optimizer, 1))
    engine.close()


def test_initialize_with_strict_false_warns_naming_what_did_not_match():
    state = good_state()
    del state["blocks.1.fc.bias"]
    state["blocks.9.fc.bias"] = torch.zeros(4 * DIM)
    own = make_model().state_dict()["blocks.1.fc.bias"].clone()
    with pytest.warns(UserWarning) as caught:
        engine, optimizer = new_engine(make_model(), weights=state, strict=False)
    messages = [str(w.message) for w in caught]
    assert any("blocks.1.fc.bias" in m and "not in the state dict" in m for m in messages), \
        messages
    assert any("blocks.9.fc.bias" in m and "not in the model" in m for m in messages), messages
    loaded = engine.full_state_dict()
    assert torch.equal(loaded["blocks.1.fc.bias"], own)  # initialized as without weights
    assert_same({k: v for k, v in loaded.items() if k != "blocks.1.fc.bias"},
                {k: v for k, v in good_state().items() if k != "blocks.1.fc.bias"})
    assert math.isfinite(step(engine, optimizer, 1))
    engine.close()


def test_initialize_with_matching_weights_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        engine, _ = new_engine(make_model(), weights=good_state())
    assert_same(engine.full_state_dict(), good_state())
    engine.close()


# --- 9. a load refused on one rank of two ----------------------------------------------------

def _attempt(load) -> str:
    try:
        load()
    except tiered.CheckpointError as error:
        return str(error)
    return "loaded"


def _one_rank_refuses(rank: int, world: int, folder: str, good_dir: str) -> None:
    results = {}
    good = good_state()
    # initialize: rank 1's weights lack a key
    model = make_model()
    weights = dict(good)
    if rank == 1:
        del weights["blocks.1.fc.bias"]
    results["init"] = _attempt(lambda: new_engine(model, weights=weights))
    results["init managed"] = model in engine_module._managed
    engine, optimizer = new_engine(model)  # each rank takes the whole batch: a 1-rank run
    step(engine, optimizer, 1)
    results["before"] = engine.full_state_dict()
    # load_state_dict: rank 1's state dict has a wrong shape, rank 0's is good
    state = dict(good)
    if rank == 1:
        state[LAST_UNIT_KEY] = torch.zeros(VOCAB, DIM - 1)
    results["shape"] = _attempt(lambda: engine.load_state_dict(state))
    results["after shape"] = engine.full_state_dict()
    # load_pretrained: rank 0's path does not exist, rank 1's is good
    path = os.path.join(folder, "nowhere") if rank == 0 else good_dir
    results["path"] = _attempt(lambda: engine.load_pretrained(path))
    results["after path"] = engine.full_state_dict()
    step(engine, optimizer, 2)
    results["trained"] = engine.full_state_dict()
    # and both ranks good: it loads (the control)
    results["good"] = _attempt(lambda: engine.load_pretrained(good_dir))
    results["after good"] = engine.full_state_dict()
    engine.close()
    torch.save(results, os.path.join(folder, f"rank{rank}.pt"))


def test_a_load_refused_on_one_rank_is_refused_on_both_and_loads_nothing(tmp_path, exported,
                                                                         reference):
    run_ranks(2, _one_rank_refuses, str(tmp_path), str(exported / "single"))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    zero, one = ranks
    assert "blocks.1.fc.bias" in one["init"] and "strict=False" in one["init"], one["init"]
    assert "another rank cannot use the weights" in zero["init"], zero["init"]
    assert LAST_UNIT_KEY in one["shape"] and str([VOCAB, DIM - 1]) in one["shape"], one["shape"]
    assert "another rank cannot use the weights" in zero["shape"], zero["shape"]
    nowhere = str(tmp_path / "nowhere")
    assert nowhere in zero["path"] and "no such file" in zero["path"], zero["path"]
    assert "another rank cannot use the weights" in one["path"], one["path"]
    good = good_state()
    for rank, result in enumerate(ranks):
        assert not result["init managed"], rank
        for name in result["before"]:
            # Each rank's shards of each unit; the consolidated state shows both ranks' parts.
            assert torch.equal(result["before"][name], result["after shape"][name]), (rank, name)
            assert torch.equal(result["before"][name], result["after path"][name]), (rank, name)
        assert result["good"] == "loaded", (rank, result["good"])
        assert_same(result["after good"], good, f"rank {rank}'s good load")
        # two ranks on the same rows average to the one-rank gradient: the one-rank run
        assert_same(result["before"], reference[0], f"rank {rank} before")
        for name in reference[1]:
            torch.testing.assert_close(result["trained"][name], reference[1][name],
                                       rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {name}")


def test_a_load_after_a_forward_whose_backward_has_not_run_is_refused():
    """Every unit is released after this forward (the root holds no parameters), yet the
    backward still needs the weights that forward used."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    weights = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    engine, optimizer = tiered.initialize(model, device="cpu", compute_dtype="fp32")
    before = engine.full_state_dict()
    loss = engine(torch.randn(4, 8)).square().sum()
    with pytest.raises(tiered.CheckpointError, match="between a forward"):
        engine.load_state_dict(weights)
    loss.backward()
    assert_same(engine.full_state_dict(), before, "loaded before the backward")
    engine.load_state_dict(weights)  # after it: allowed
    with torch.no_grad():
        engine(torch.randn(4, 8))
    engine.load_state_dict(weights)  # after a forward without grad too
    engine.close()


def test_a_load_after_units_stepped_on_arrival_is_refused():
    engine, optimizer = tiered.initialize(make_model(), device="cpu", compute_dtype="fp32",
                                          optimizer={"lr": 1e-2, "accumulation_steps": 1})
    idx = batch(0)
    next_token_loss(engine(idx), idx).backward()  # each unit is stepped as it arrives
    with pytest.raises(tiered.CheckpointError, match="accumulation_steps"):
        engine.load_state_dict(good_state())
    optimizer.step()
    optimizer.zero_grad()
    engine.load_state_dict(good_state())
    assert_same(engine.full_state_dict(), good_state(), "after the step")
    engine.close()


def test_a_tied_parameter_is_checked_under_each_of_its_names():
    engine, _ = new_engine()
    state = good_state()
    state["head.weight"] = torch.zeros(3, 3)
    with pytest.raises(tiered.CheckpointError, match="head.weight"):
        engine.load_state_dict(state)
    engine.close()


def test_a_closed_engine_refuses_a_load():
    engine, _ = new_engine()
    engine.close()
    with pytest.raises(tiered.TieredError, match="closed"):
        engine.load_state_dict(good_state())


def _different_weights_per_rank(rank: int, world: int, out: str) -> None:
    weights = good_state()
    if rank == 1:
        weights = {k: v for k, v in weights.items() if not k.startswith("blocks.0.")}
    with tiered.init(device="cpu", compute_dtype="fp32"):
        model = make_model()
    try:
        tiered.initialize(model, weights=weights, strict=False)
        outcome = "initialized"
    except tiered.CheckpointError as error:
        outcome = str(error)
    with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
        f.write(outcome)


def test_ranks_given_weights_holding_other_units_refuse_instead_of_hanging(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_ranks(2, _different_weights_per_rank, str(tmp_path))
    for rank in range(2):
        assert "hold different parameters" in (tmp_path / f"rank{rank}.txt").read_text()
