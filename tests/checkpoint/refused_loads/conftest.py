"""Fixtures of the refused-load tests: a reference run never offered a load, the weights it
is offered as save_pretrained writes them, and a fresh engine one step in."""
from __future__ import annotations

import os

import pytest
from refusals import make_model, new_engine, step

from helpers import assert_same


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
