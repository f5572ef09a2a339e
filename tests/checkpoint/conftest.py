"""Fixtures of the checkpoint folders' tests (hardening, which checkpoints a folder keeps)."""
from __future__ import annotations

import pytest

from helpers_checkpoint import small_engine, two_checkpoints


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A folder with 'zeta' saved after one step and 'alpha' after two (so the names' order
    is not the steps'), and the states they hold."""
    return two_checkpoints(tmp_path_factory.mktemp("saved") / "ck")


@pytest.fixture(scope="module")
def engine():
    """One engine for the loads of a module: a refused one changes nothing, which each checks."""
    engine, _ = small_engine()
    yield engine
    engine.close()
