"""Refused weight loads: ``engine.load_state_dict``, ``engine.load_pretrained`` and
``tiered.initialize(model, weights=...)`` given bad input fail with a CheckpointError naming the
file, key or value at fault, and change nothing: the engine's weights stay bit for bit, its
optimizer state too (the run goes on exactly as if the load had never been tried), no file is
left open, and a refused ``initialize`` leaves the model as it came. With ``strict=False`` what
is missing keeps its value and the result lists what did not match.
"""
from __future__ import annotations

import ctypes
import gc
import importlib
import json
import math
import os
import shutil
import struct
import warnings

import pytest
import torch
from torch import nn

import tiered
from distributed import run_ranks
from gpt import GPT, next_token_loss

engine_module = importlib.import_module("tiered.engine.engine")

VOCAB, DIM, SEQ, ROWS = 64, 32, 16, 4
LAST_UNIT_KEY = "head.weight"  # in <root>, the unit loaded last: a half-load would show


def make_model(seed: int = 0, **kwargs) -> GPT:
    torch.manual_seed(seed)
    return GPT(VOCAB, DIM, 2, 2, max_seq=SEQ, **kwargs)


def new_engine(model: nn.Module | None = None, **overrides):
    return tiered.initialize(make_model() if model is None else model, device="cpu",
                             compute_dtype="fp32", optimizer={"lr": 1e-2}, **overrides)


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


def assert_same(actual: dict, expected: dict, what: str = "") -> None:
    assert list(actual) == list(expected), what
    changed = [name for name in expected if not torch.equal(actual[name], expected[name])]
    assert not changed, f"{what}: changed {changed}"


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


# --- fixtures -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference():
    """States of a run never offered a load: after step 1, and after step 2."""
    engine, optimizer = new_engine()
    step(engine, optimizer, 1)
    first = engine.full_state_dict()
    step(engine, optimizer, 2)
    second = engine.full_state_dict()
    engine.close()
    return first, second


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """good_state() as save_pretrained writes it: one file, and shards with an index."""
    root = tmp_path_factory.mktemp("exported")
    engine, _ = new_engine(make_model(seed=7))
    engine.save_pretrained(str(root / "single"))
    shards = engine.save_pretrained(str(root / "sharded"), max_shard_bytes=16 << 10)
    engine.close()
    assert "model.safetensors" in os.listdir(root / "single")
    assert len(shards) >= 3
    return root


@pytest.fixture
def trained(reference):
    """A fresh engine one step in (the reference's first state), closed after the test."""
    engine, optimizer = new_engine()
    step(engine, optimizer, 1)
    assert_same(engine.full_state_dict(), reference[0], "the runs should start the same")
    yield engine, optimizer
    engine.close()


def copy_of(folder, tmp_path, name: str = "copy"):
    target = tmp_path / name
    shutil.copytree(folder, target)
    return target


def refuse(engine, load, *in_message: str) -> str:
    """``load()`` raises a CheckpointError whose message holds each of ``in_message``, and
    leaves the engine's weights bit for bit as they were."""
    before = engine.full_state_dict()
    with pytest.raises(tiered.CheckpointError) as error:
        load()
    message = str(error.value)
    for part in in_message:
        assert part in message, f"{part!r} not in the message: {message}"
    assert_same(engine.full_state_dict(), before, f"half-loaded by a refused load ({message})")
    return message


def goes_on_as_never_loaded(engine, optimizer, reference) -> None:
    """The next step gives exactly the state of a run that never saw the refused load: the
    weights, the Adam moments and the step counts all stayed."""
    loss = step(engine, optimizer, 2)
    assert math.isfinite(loss)
    assert_same(engine.full_state_dict(), reference[1], "the step after the refusal")


# --- positive controls: the inputs the refusals below spoil do load --------------------------

@pytest.mark.parametrize("source", ["state dict", "folder", "file", "sharded"])
def test_the_unspoiled_inputs_load(source, trained, exported):
    engine, optimizer = trained
    good = good_state()
    if source == "state dict":
        result = engine.load_state_dict(good)
    else:
        path = {"folder": exported / "single", "file": exported / "single" / "model.safetensors",
                "sharded": exported / "sharded"}[source]
        result = engine.load_pretrained(str(path))
    assert result == ([], []) and isinstance(result, tiered.checkpoint.pretrained.LoadResult)
    assert_same(engine.full_state_dict(), good, "loaded")
    assert open_files_under(exported) == []
    assert math.isfinite(step(engine, optimizer, 2))


# --- 1. paths without usable weights ---------------------------------------------------------

def _nowhere(tmp_path, exported):
    return tmp_path / "does" / "not" / "exist", ["no such file or folder"]


def _empty_folder(tmp_path, exported):
    folder = tmp_path / "empty"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder, ["holds no model.safetensors and no model.safetensors.index.json"]


def _only_pickled(tmp_path, exported):
    folder = tmp_path / "pickled"
    folder.mkdir()
    torch.save(good_state(), folder / "pytorch_model.bin")
    return folder, ["pytorch_model.bin", "pickled", "does not read"]


def _pickled_file_named(tmp_path, exported):
    folder = tmp_path / "pickled"
    folder.mkdir()
    torch.save(good_state(), folder / "pytorch_model.bin")
    return folder / "pytorch_model.bin", ["not a tensor file"]


def _two_files_no_index(tmp_path, exported):
    folder = tmp_path / "two"
    folder.mkdir()
    shutil.copy(exported / "single" / "model.safetensors", folder / "a.safetensors")
    shutil.copy(exported / "single" / "model.safetensors", folder / "b.safetensors")
    return folder, ["no model.safetensors.index.json", "2 .safetensors files"]


@pytest.mark.parametrize("case", [_nowhere, _empty_folder, _only_pickled, _pickled_file_named,
                                  _two_files_no_index], ids=lambda case: case.__name__[1:])
def test_a_path_without_usable_weights_is_refused_by_name(case, trained, reference, tmp_path,
                                                          exported):
    engine, optimizer = trained
    path, parts = case(tmp_path, exported)
    refuse(engine, lambda: engine.load_pretrained(str(path)), str(path), *parts)
    goes_on_as_never_loaded(engine, optimizer, reference)


def test_weights_that_are_neither_a_path_nor_a_state_dict_are_refused(trained, reference):
    engine, optimizer = trained
    refuse(engine, lambda: engine.load_state_dict([1, 2, 3]), "got a list")
    refuse(engine, lambda: engine.load_pretrained(12), "got a int")
    goes_on_as_never_loaded(engine, optimizer, reference)


# --- 2. a broken index -----------------------------------------------------------------------

INDEX = "model.safetensors.index.json"


def test_a_malformed_index_is_refused_by_name(trained, reference, exported, tmp_path):
    engine, optimizer = trained
    folder = copy_of(exported / "sharded", tmp_path)
    text = (folder / INDEX).read_text()
    (folder / INDEX).write_text(text[:len(text) // 2])  # cut in the middle: not JSON
    refuse(engine, lambda: engine.load_pretrained(str(folder)), str(folder / INDEX),
           "cannot be read as an index")
    (folder / INDEX).write_text(json.dumps({"metadata": {}}))  # JSON, but no weight_map
    refuse(engine, lambda: engine.load_pretrained(str(folder)), str(folder / INDEX),
           "weight_map")
    goes_on_as_never_loaded(engine, optimizer, reference)


def test_an_index_listing_a_missing_shard_is_refused_naming_it(trained, reference, exported,
                                                               tmp_path):
    engine, optimizer = trained
    folder = copy_of(exported / "sharded", tmp_path)
    shards = sorted(set(json.loads((folder / INDEX).read_text())["weight_map"].values()))
    os.remove(folder / shards[-1])  # the last: the others open fine first
    refuse(engine, lambda: engine.load_pretrained(str(folder)), str(folder / INDEX), shards[-1])
    goes_on_as_never_loaded(engine, optimizer, reference)


def test_a_tensor_in_two_shards_is_refused_naming_both(trained, reference, tmp_path):
    engine, optimizer = trained
    state = good_state()
    folder = tmp_path / "dup"
    folder.mkdir()
    names = list(state)
    first, second = names[:len(names) // 2], names[len(names) // 2 - 1:]  # one name in both
    write_safetensors(folder / "a.safetensors", f32_entries({n: state[n] for n in first}))
    write_safetensors(folder / "b.safetensors", f32_entries({n: state[n] for n in second}))
    (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": {
        **{n: "a.safetensors" for n in first}, **{n: "b.safetensors" for n in second}}}))
    refuse(engine, lambda: engine.load_pretrained(str(folder)), repr(first[-1]),
           "a.safetensors", "b.safetensors")
    goes_on_as_never_loaded(engine, optimizer, reference)


# --- 3. truncated files ----------------------------------------------------------------------

@pytest.mark.parametrize("keep", ["4 bytes", "half the header", "half the data",
                                  "all but one byte"])
def test_a_truncated_file_is_refused_by_name(keep, trained, reference, exported, tmp_path):
    engine, optimizer = trained
    folder = copy_of(exported / "single", tmp_path)
    path = folder / "model.safetensors"
    data = path.read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    size = {"4 bytes": 4, "half the header": 8 + header_len // 2,
            "half the data": (8 + header_len + len(data)) // 2,
            "all but one byte": len(data) - 1}[keep]
    path.write_bytes(data[:size])
    refuse(engine, lambda: engine.load_pretrained(str(folder)), str(path), "truncated")
    goes_on_as_never_loaded(engine, optimizer, reference)


def test_a_truncated_last_shard_is_refused_naming_it(trained, reference, exported, tmp_path):
    engine, optimizer = trained
    folder = copy_of(exported / "sharded", tmp_path)
    shards = sorted(set(json.loads((folder / INDEX).read_text())["weight_map"].values()))
    last = folder / shards[-1]
    last.write_bytes(last.read_bytes()[:-3])
    message = refuse(engine, lambda: engine.load_pretrained(str(folder)), str(last), "truncated")
    assert all(shard not in message for shard in shards[:-1]), message
    goes_on_as_never_loaded(engine, optimizer, reference)


# --- 4. what a file's header says ------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["F8_E4M3", "F8_E5M2", "C64"])
def test_a_tensor_of_a_dtype_tiered_does_not_read_is_refused_naming_it(dtype, trained,
                                                                       reference, tmp_path):
    engine, optimizer = trained
    entries = f32_entries(good_state())
    shape = entries[LAST_UNIT_KEY][1]
    itemsize = {"F8_E4M3": 1, "F8_E5M2": 1, "C64": 8}[dtype]
    entries[LAST_UNIT_KEY] = (dtype, shape, b"\x01" * (math.prod(shape) * itemsize))
    path = write_safetensors(tmp_path / "model.safetensors", entries)
    refuse(engine, lambda: engine.load_pretrained(path), path, repr(LAST_UNIT_KEY), dtype)
    goes_on_as_never_loaded(engine, optimizer, reference)


def test_the_hand_written_file_loads_when_its_dtypes_are_readable(trained, tmp_path):
    # The control of the test above: the same file with F32 there loads, and F16 too.
    engine, _ = trained
    state = good_state()
    entries = f32_entries(state)
    entries["ln.weight"] = ("F16", list(state["ln.weight"].shape), raw(state["ln.weight"].half()))
    path = write_safetensors(tmp_path / "model.safetensors", entries)
    assert engine.load_pretrained(path) == ([], [])
    loaded = engine.full_state_dict()
    assert torch.equal(loaded["ln.weight"], state["ln.weight"].half().float())
    assert_same({k: v for k, v in loaded.items() if k != "ln.weight"},
                {k: v for k, v in state.items() if k != "ln.weight"})


@pytest.mark.parametrize("header", [b"[1, 2, 3]", b'{"head.weight": {"dtype": "F32", '
                                    b'"shape": "ab", "data_offsets": [0, 4]}}'],
                         ids=["not an object", "shape of strings"])
def test_a_foreign_header_is_a_checkpoint_error_naming_the_file(header, trained, reference,
                                                                tmp_path):
    engine, optimizer = trained
    header += b" " * (-len(header) % 8)
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 64)
    refuse(engine, lambda: engine.load_pretrained(str(path)), str(path))
    goes_on_as_never_loaded(engine, optimizer, reference)


# --- 5. names, shapes and dtypes that do not match the model ---------------------------------

@pytest.mark.parametrize("key,wrong", [(LAST_UNIT_KEY, (VOCAB, DIM - 1)),
                                       ("blocks.1.fc.bias", (4 * DIM, 1)),
                                       ("pos", (SEQ // 2, DIM))])
def test_a_wrong_shape_is_refused_naming_the_key_and_both_shapes(key, wrong, trained, reference):
    engine, optimizer = trained
    state = good_state()
    right = list(state[key].shape)
    state[key] = torch.zeros(wrong)
    refuse(engine, lambda: engine.load_state_dict(state), "the state dict", key,
           str(list(wrong)), str(right))
    refuse(engine, lambda: engine.load_state_dict(state, strict=False), key, str(list(wrong)))
    goes_on_as_never_loaded(engine, optimizer, reference)


def test_a_wrong_shape_in_a_file_names_the_file_too(trained, reference, tmp_path):
    engine, optimizer = trained
    state = good_state()
    state["pos"] = state["pos"][:SEQ // 2].clone()
    path = write_safetensors(tmp_path / "model.safetensors", f32_entries(state))
    refuse(engine, lambda: engine.load_pretrained(path), path, "pos", str([SEQ // 2, DIM]),
           str([SEQ, DIM]))
    goes_on_as_never_loaded(engine, optimizer, reference)


def test_a_missing_key_is_refused_under_strict_listing_it(trained, reference):
    engine, optimizer = trained
    state = good_state()
    del state["blocks.1.fc.bias"]
    refuse(engine, lambda: engine.load_state_dict(state), "blocks.1.fc.bias", "1 missing",
           "strict=False")
    goes_on_as_never_loaded(engine, optimizer, reference)


def test_an_unexpected_key_is_refused_under_strict_listing_it(trained, reference):
    engine, optimizer = trained
    state = good_state()
    state["blocks.2.fc.bias"] = torch.zeros(4 * DIM)
    message = refuse(engine, lambda: engine.load_state_dict(state), "blocks.2.fc.bias",
                     "1 unexpected", "strict=False")
    assert "missing:" not in message, message
    goes_on_as_never_loaded(engine, optimizer, reference)


def test_missing_and_unexpected_keys_are_both_listed(trained, reference, tmp_path):
    engine, optimizer = trained
    state = good_state()
    del state["emb.weight"], state[LAST_UNIT_KEY]
    state["lm_head.weight"] = torch.zeros(VOCAB, DIM)
    path = write_safetensors(tmp_path / "model.safetensors", f32_entries(state))
    refuse(engine, lambda: engine.load_pretrained(path), path, "2 missing", "emb.weight",
           LAST_UNIT_KEY, "1 unexpected", "lm_head.weight", "strict=False")
    goes_on_as_never_loaded(engine, optimizer, reference)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_a_parameter_given_as_an_integer_tensor_is_refused(dtype, trained, reference):
    engine, optimizer = trained
    state = good_state()
    state["ln.weight"] = torch.ones(DIM, dtype=dtype)
    refuse(engine, lambda: engine.load_state_dict(state), "ln.weight", str(dtype),
           "floating-point")
    refuse(engine, lambda: engine.load_state_dict(state, strict=False), "ln.weight", str(dtype))
    goes_on_as_never_loaded(engine, optimizer, reference)


def test_an_integer_parameter_in_a_file_is_refused(trained, reference, tmp_path):
    engine, optimizer = trained
    entries = f32_entries(good_state())
    entries[LAST_UNIT_KEY] = ("I64", [VOCAB, DIM], raw(torch.ones(VOCAB, DIM, dtype=torch.int64)))
    path = write_safetensors(tmp_path / "model.safetensors", entries)
    refuse(engine, lambda: engine.load_pretrained(path), path, LAST_UNIT_KEY, "torch.int64")
    goes_on_as_never_loaded(engine, optimizer, reference)


def test_a_value_that_is_not_a_tensor_is_refused_naming_its_key(trained, reference):
    engine, optimizer = trained
    state = good_state()
    state["ln.bias"] = [0.0] * DIM
    refuse(engine, lambda: engine.load_state_dict(state), "'ln.bias'", "list", "not a tensor")
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
    message = refuse(engine, lambda: engine.load_state_dict(state), "blocks.1.fc.weight",
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
    refuse(engine, lambda: engine.load_state_dict(state), "scale", "[9]", "[8]")
    state["scale"] = torch.full((8,), 5.0)
    state["scratch"] = torch.ones(3)
    refuse(engine, lambda: engine.load_state_dict(state), "1 unexpected", "scratch")
    del state["scale"]
    result = engine.load_state_dict(state, strict=False)
    assert result == (["scale"], ["scratch"])
    loaded = engine.full_state_dict()
    assert torch.equal(loaded["scale"], before["scale"])
    assert torch.equal(engine.module.scratch, torch.zeros(3))
    assert_same({k: v for k, v in loaded.items() if k != "scale"},
                {k: state[k] for k in loaded if k != "scale"})
    engine.close()


# --- a refused load lets go of the files it opened -------------------------------------------

def _spoiled(kind: str, exported, tmp_path):
    if kind == "wrong shape":
        state = good_state()
        state["pos"] = state["pos"][:SEQ // 2].clone()
        return write_safetensors(tmp_path / "model.safetensors", f32_entries(state))
    if kind == "missing under strict":
        state = good_state()
        del state["pos"]
        return write_safetensors(tmp_path / "model.safetensors", f32_entries(state))
    if kind == "unreadable dtype":
        entries = f32_entries(good_state())
        entries["pos"] = ("F8_E4M3", [SEQ, DIM], b"\0" * SEQ * DIM)
        return write_safetensors(tmp_path / "model.safetensors", entries)
    folder = copy_of(exported / "sharded", tmp_path)  # "truncated shard"
    shards = sorted(set(json.loads((folder / INDEX).read_text())["weight_map"].values()))
    (folder / shards[-1]).write_bytes((folder / shards[-1]).read_bytes()[:-3])
    return str(folder)


def _refused(engine, path) -> None:
    try:
        engine.load_pretrained(path)
    except tiered.CheckpointError:
        return
    raise AssertionError("loaded")


@pytest.mark.parametrize("kind", ["wrong shape", "missing under strict", "unreadable dtype",
                                  "truncated shard"])
def test_a_refused_load_leaves_no_file_open(kind, trained, exported, tmp_path):
    engine, _ = trained
    path = _spoiled(kind, exported, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc_was = gc.isenabled()
        gc.disable()  # what the load opened must be closed by it, not by the GC
        try:
            _refused(engine, path)
            still_open = open_files_under(tmp_path)
        finally:
            if gc_was:
                gc.enable()
    assert still_open == [], f"left open after the refusal: {still_open}"


# --- 7. strict=False -------------------------------------------------------------------------

@pytest.mark.parametrize("policy,source", [("cpu", "state dict"), ("cpu", "file"),
                                           ("nvme", "state dict")])
def test_strict_false_loads_what_matches_and_keeps_the_rest(policy, source, tmp_path):
    engine, optimizer = tiered.initialize(
        make_model(), os.path.join(os.path.dirname(__file__), "..", "configs", f"{policy}.yaml"),
        device="cpu", compute_dtype="fp32", nvme={"path": str(tmp_path)},
        optimizer={"lr": 1e-2})
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
