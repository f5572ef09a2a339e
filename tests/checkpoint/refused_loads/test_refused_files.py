"""Refused weight loads, what is wrong with the files: ``engine.load_pretrained`` given a path
without usable weights, a broken index, a truncated file or a header tiered does not read fails
with a CheckpointError naming the file at fault, changes nothing (the run goes on exactly as if
the load had never been tried) and leaves no file open."""
from __future__ import annotations

import gc
import json
import math
import os
import shutil
import struct
import warnings

import pytest
import torch
from refusals import (DIM, INDEX, LAST_UNIT_KEY, SEQ, copy_of, f32_entries, goes_on_as_never_loaded,
                      good_state, open_files_under, raw, step, write_safetensors)

import tiered

from helpers import assert_same, refused

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
    refused(engine, lambda: engine.load_pretrained(str(path)), str(path), *parts)
    goes_on_as_never_loaded(engine, optimizer, reference)


def test_weights_that_are_neither_a_path_nor_a_state_dict_are_refused(trained, reference):
    engine, optimizer = trained
    refused(engine, lambda: engine.load_state_dict([1, 2, 3]), "got a list")
    refused(engine, lambda: engine.load_pretrained(12), "got a int")
    goes_on_as_never_loaded(engine, optimizer, reference)


# --- 2. a broken index -----------------------------------------------------------------------

def test_a_malformed_index_is_refused_by_name(trained, reference, exported, tmp_path):
    engine, optimizer = trained
    folder = copy_of(exported / "sharded", tmp_path)
    text = (folder / INDEX).read_text()
    (folder / INDEX).write_text(text[:len(text) // 2])  # cut in the middle: not JSON
    refused(engine, lambda: engine.load_pretrained(str(folder)), str(folder / INDEX),
            "cannot be read as an index")
    (folder / INDEX).write_text(json.dumps({"metadata": {}}))  # JSON, but no weight_map
    refused(engine, lambda: engine.load_pretrained(str(folder)), str(folder / INDEX),
            "weight_map")
    goes_on_as_never_loaded(engine, optimizer, reference)


def test_an_index_listing_a_missing_shard_is_refused_naming_it(trained, reference, exported,
                                                               tmp_path):
    engine, optimizer = trained
    folder = copy_of(exported / "sharded", tmp_path)
    shards = sorted(set(json.loads((folder / INDEX).read_text())["weight_map"].values()))
    os.remove(folder / shards[-1])  # the last: the others open fine first
    refused(engine, lambda: engine.load_pretrained(str(folder)), str(folder / INDEX), shards[-1])
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
    refused(engine, lambda: engine.load_pretrained(str(folder)), repr(first[-1]),
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
    refused(engine, lambda: engine.load_pretrained(str(folder)), str(path), "truncated")
    goes_on_as_never_loaded(engine, optimizer, reference)


def test_a_truncated_last_shard_is_refused_naming_it(trained, reference, exported, tmp_path):
    engine, optimizer = trained
    folder = copy_of(exported / "sharded", tmp_path)
    shards = sorted(set(json.loads((folder / INDEX).read_text())["weight_map"].values()))
    last = folder / shards[-1]
    last.write_bytes(last.read_bytes()[:-3])
    message = refused(engine, lambda: engine.load_pretrained(str(folder)), str(last), "truncated")
    assert all(shard not in message for shard in shards[:-1]), message
    goes_on_as_never_loaded(engine, optimizer, reference)


# --- 4. what a file's header says ------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["F8_E4M3", "F8_E5M2", "C64"])
def test_a_parameter_in_a_dtype_it_does_not_load_from_is_refused_naming_it(dtype, trained,
                                                                           reference, tmp_path):
    # The file is read (a buffer may be F8 or complex), but no weight loads from quantized F8
    # without its scales, nor from a complex tensor.
    engine, optimizer = trained
    entries = f32_entries(good_state())
    shape = entries[LAST_UNIT_KEY][1]
    itemsize = {"F8_E4M3": 1, "F8_E5M2": 1, "C64": 8}[dtype]
    entries[LAST_UNIT_KEY] = (dtype, shape, b"\x01" * (math.prod(shape) * itemsize))
    path = write_safetensors(tmp_path / "model.safetensors", entries)
    refused(engine, lambda: engine.load_pretrained(path), path, LAST_UNIT_KEY, dtype,
            "F32, BF16, F16 or F64")
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
    refused(engine, lambda: engine.load_pretrained(str(path)), str(path))
    goes_on_as_never_loaded(engine, optimizer, reference)



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
    if kind == "F8 weight":
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


@pytest.mark.parametrize("kind", ["wrong shape", "missing under strict", "F8 weight",
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
