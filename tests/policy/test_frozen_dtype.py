"""``params.frozen_dtype``: how units of frozen parameters keep their linear layers' weights
(compute | int8 | nf4), read from a file, a mapping and overrides as every key is, and a wrong
value refused naming the key and what is allowed."""
from __future__ import annotations

import subprocess
import sys

import pytest

import tiered
from tiered.policy.config import Policy
from tiered.policy.kinds import FrozenDtype


def test_the_default_keeps_frozen_weights_in_the_compute_dtype():
    assert Policy().params.frozen_dtype is FrozenDtype.COMPUTE


def test_frozen_dtype_is_read_from_a_file_and_overridden(tmp_path):
    path = tmp_path / "qlora.yaml"
    path.write_text("params: {tier: dram, frozen_dtype: nf4}\n")
    assert Policy.from_yaml(path).params.frozen_dtype is FrozenDtype.NF4
    policy = Policy.from_yaml(path, {"params": {"frozen_dtype": "int8"}})
    assert policy.params.frozen_dtype is FrozenDtype.INT8
    assert policy.params.tier.value == "dram"  # the other keys of the section stay
    assert policy.replace(params={"frozen_dtype": "compute"}).params.frozen_dtype \
        is FrozenDtype.COMPUTE
    assert Policy.from_dict(policy.to_dict()) == policy  # as ranks receive it


@pytest.mark.parametrize("value", ["fp4", "bf16", 4, None])
def test_a_wrong_frozen_dtype_is_refused_naming_the_key_and_the_choices(value):
    with pytest.raises(tiered.PolicyError) as info:
        Policy.from_dict({"params": {"frozen_dtype": value}})
    assert str(info.value) == (f"<dict>: params.frozen_dtype is {value!r}; allowed: "
                               f"compute | int8 | nf4")


def test_reading_the_policy_does_not_import_torchao():
    # Quantizing imports torchao (seconds of a process's start); a policy that names a
    # format, and the engine's modules, must not.
    code = ("import sys, tiered, tiered.engine.engine, tiered.tiers.quantized; "
            "tiered.Policy.from_dict({'params': {'frozen_dtype': 'nf4'}}); "
            "print('torchao' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "False"
