"""The policy layer (YAML -> frozen tiered.Policy) and byte sizes. A policy checked against the
machine (budgets, ``tiered check-policy``) is tests/policy/test_policy_checks.py.

Every bad input must give a PolicyError whose message is the whole clue: the file, the key path,
the value and what is allowed.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

import tiered
from tiered.core.sizes import parse_size
from tiered.launch.cli import main as tiered_cli
from tiered.policy.config import (POLICY_ENV, NvmePolicy, OptimizerPolicy, ParamsPolicy, Policy,
                                  TracePolicy, resolve)
from tiered.policy.kinds import ComputeDtype, Tier
from helpers import REPO

CONFIGS = REPO / "configs"


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def policy_error(data=None, *, yaml_text: str | None = None, tmp_path: Path | None = None) -> str:
    """The message of the PolicyError that ``data`` (a dict) or ``yaml_text`` (a file) raises."""
    with pytest.raises(tiered.PolicyError) as info:
        if yaml_text is None:
            Policy.from_dict(data, source="test.yaml")
        else:
            Policy.from_yaml(write(tmp_path / "policy.yaml", yaml_text))
    return str(info.value)


# -- loading ----------------------------------------------------------------------------------

def test_cpu_yaml_equals_builtin_defaults():
    assert Policy.from_yaml(CONFIGS / "cpu.yaml") == Policy()
    assert resolve(str(CONFIGS / "cpu.yaml")) == Policy()


def test_builtin_defaults_are_the_documented_values():
    p = Policy()
    assert p.compute_dtype.value == "auto" and p.device.value == "auto"  # test_compute_dtype.py
    assert (p.params.tier, p.grads.tier, p.optimizer.tier) == (Tier.DRAM, Tier.DRAM, Tier.DRAM)
    assert (p.optimizer.lr, p.optimizer.betas, p.optimizer.eps) == (1e-4, (0.9, 0.999), 1e-8)
    assert p.optimizer.weight_decay == 0.0 and p.optimizer.max_grad_norm is None
    assert p.nvme.path is None and p.hbm.budget is None and p.dram.budget is None
    assert not p.dram.huge_pages
    assert not p.uses_nvme


def test_gpu_yaml_puts_everything_in_hbm():
    p = Policy.from_yaml(CONFIGS / "gpu.yaml")
    assert (p.params.tier, p.grads.tier, p.optimizer.tier) == (Tier.HBM, Tier.HBM, Tier.HBM)


def test_nvme_yaml_needs_a_path_and_takes_one_as_override(tmp_path):
    with pytest.raises(tiered.PolicyError, match="nvme.path is required"):
        Policy.from_yaml(CONFIGS / "nvme.yaml")
    p = resolve(str(CONFIGS / "nvme.yaml"), {"nvme": {"path": str(tmp_path)}})
    assert (p.params.tier, p.grads.tier, p.optimizer.tier) == (Tier.NVME, Tier.DRAM, Tier.NVME)
    assert p.nvme.path == str(tmp_path) and p.uses_nvme


def test_dict_with_missing_keys_takes_defaults():
    p = Policy.from_dict({"compute_dtype": "fp32", "optimizer": {"lr": 3e-4}})
    assert p.compute_dtype.value == "fp32"
    assert p.optimizer.lr == 3e-4
    assert p.optimizer.betas == Policy().optimizer.betas
    assert p.optimizer.eps == Policy().optimizer.eps
    assert dataclasses.replace(p, compute_dtype=Policy().compute_dtype,
                               optimizer=Policy().optimizer) == Policy()
    assert Policy.from_dict({}) == Policy() == Policy.from_dict(None)


def test_empty_yaml_file_is_the_defaults(tmp_path):
    assert Policy.from_yaml(write(tmp_path / "empty.yaml", "# nothing set\n")) == Policy()


def test_yaml_values_become_typed_fields(tmp_path):
    path = write(tmp_path / "p.yaml", """
compute_dtype: fp16
device: cpu
params: {tier: nvme}
grads: {tier: dram}
optimizer: {tier: nvme, lr: 1e-3, betas: [0.8, 0.95], eps: 1.0e-6, weight_decay: 0.1,
            max_grad_norm: 1}
nvme: {path: /mnt/nvme, budget: 1.5GB}
hbm: {budget: 70GiB}
dram: {budget: 4096, huge_pages: true}
loss_scale: {initial_scale: 1024, growth_interval: 100}
units: {classes: [Block]}
""")
    p = Policy.from_yaml(path)
    assert p.compute_dtype.torch_dtype is torch.float16
    assert p.device.value == "cpu"
    assert p.optimizer.lr == 1e-3  # YAML reads 1e-3 as a string; the policy makes it a float
    assert p.optimizer.betas == (0.8, 0.95) and isinstance(p.optimizer.betas, tuple)
    assert p.optimizer.max_grad_norm == 1.0 and isinstance(p.optimizer.max_grad_norm, float)
    assert p.nvme.path == "/mnt/nvme"
    assert p.nvme.budget == 1_500_000_000
    assert p.hbm.budget == 70 * 2**30
    assert p.dram.budget == 4096 and p.dram.huge_pages is True
    assert p.loss_scale.initial_scale == 1024.0 and p.loss_scale.growth_interval == 100
    assert p.units.classes == ("Block",)


# -- sizes ------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, expected", [
    (4096, 4096),
    (0, 0),
    (4096.0, 4096),
    ("4096", 4096),
    ("512B", 512),
    ("70GiB", 70 * 2**30),
    ("1.5GB", 1_500_000_000),
    ("512 MiB", 512 * 2**20),
    ("1kib", 1024),
    ("2TB", 2 * 10**12),
    ("1.5KiB", 1536),
    ("8.2MB", 8_200_000),   # float arithmetic made this 8199999
    ("4.1KB", 4100),
])
def test_parse_size_accepts_ints_and_unit_strings(value, expected):
    assert parse_size(value) == expected
    assert isinstance(parse_size(value), int)


@pytest.mark.parametrize("value", ["12 parsecs", "GB", "", "-1GB", "1.5.0GB", -5, 1.5, True, None,
                                   [4096]])
def test_parse_size_rejects_what_is_not_a_byte_size(value):
    with pytest.raises(ValueError) as info:
        parse_size(value)
    message = str(info.value)
    assert repr(value) in message or str(value) in message
    assert "byte size" in message


# -- to_dict, frozen, resolve -----------------------------------------------------------------

NON_DEFAULT = {
    "compute_dtype": "fp16",
    "device": "cpu",
    "params": {"tier": "nvme"},
    "grads": {"tier": "dram"},
    "optimizer": {"tier": "nvme", "lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6,
                  "weight_decay": 0.1, "max_grad_norm": 1.0},
    "nvme": {"path": "/mnt/nvme0", "budget": "2GiB"},
    "hbm": {"budget": "70GiB"},
    "dram": {"budget": 123456},
    "loss_scale": {"initial_scale": 1024.0, "growth_factor": 4.0, "backoff_factor": 0.25,
                   "growth_interval": 10},
    "units": {"classes": ["Block", "Embedding"]},
}


def test_to_dict_is_the_schema_in_plain_types():
    d = Policy.from_dict(NON_DEFAULT).to_dict()
    assert d["compute_dtype"] == "fp16" and type(d["compute_dtype"]) is str
    assert d["params"] == {"tier": "nvme", "frozen_dtype": "compute"}
    assert d["optimizer"]["betas"] == [0.8, 0.95]
    assert d["nvme"] == {"path": "/mnt/nvme0", "budget": 2 * 2**30, "block_size": 1 << 20,
                         "queue_depth": 16}
    assert d["hbm"]["budget"] == 70 * 2**30
    assert d["units"]["classes"] == ["Block", "Embedding"]
    assert set(d) == {"compute_dtype", "device", "params", "grads", "optimizer", "nvme", "hbm",
                      "dram", "loss_scale", "units", "cpu", "prefetch", "activations", "trace",
                      "tiling"}
    assert d["activations"] == {"tier": "hbm", "dram_bytes": 1 << 30, "min_bytes": 1 << 20,
                                "prefetch_bytes": 256 << 20, "nvme_bytes": 64 << 30}


@pytest.mark.parametrize("policy", [Policy(), Policy.from_dict(NON_DEFAULT)], ids=["defaults", "custom"])
def test_to_dict_round_trips_through_json_and_yaml(policy, tmp_path):
    d = policy.to_dict()
    assert Policy.from_dict(d) == policy
    assert Policy.from_dict(json.loads(json.dumps(d))) == policy
    assert Policy.from_dict(yaml.safe_load(yaml.safe_dump(d))) == policy
    path = write(tmp_path / "dumped.yaml", yaml.safe_dump(d, sort_keys=False))
    assert Policy.from_yaml(path) == policy


def test_policy_is_frozen():
    p = Policy()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.compute_dtype = "fp32"
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.optimizer.lr = 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.nvme.path = "/tmp"
    assert p == Policy()


def test_replace_merges_schema_overrides():
    p = Policy().replace(optimizer={"lr": 1e-3}, compute_dtype="fp32")
    assert p.optimizer.lr == 1e-3 and p.compute_dtype.value == "fp32"
    assert p.optimizer.betas == Policy().optimizer.betas
    assert Policy().optimizer.lr == 1e-4  # the original is untouched


def test_resolve_none_without_env_is_the_defaults(monkeypatch):
    monkeypatch.delenv(POLICY_ENV, raising=False)
    assert resolve(None) == Policy()
    assert resolve(None, {"compute_dtype": "fp32"}).compute_dtype.value == "fp32"


def test_resolve_none_takes_the_launcher_policy_from_env(monkeypatch):
    launched = Policy.from_dict(NON_DEFAULT)
    monkeypatch.setenv(POLICY_ENV, json.dumps(launched.to_dict()))
    assert resolve(None) == launched
    merged = resolve(None, {"optimizer": {"lr": 1e-2}})
    assert merged.optimizer.lr == 1e-2
    assert merged.optimizer.betas == (0.8, 0.95) and merged.optimizer.tier is Tier.NVME
    assert merged.nvme.path == "/mnt/nvme0"


def test_resolve_overrides_deep_merge_into_a_file():
    p = resolve(str(CONFIGS / "cpu.yaml"), {"optimizer": {"lr": 1e-3}})
    assert p.optimizer.lr == 1e-3
    assert dataclasses.replace(p.optimizer, lr=Policy().optimizer.lr) == Policy().optimizer
    assert p.params == Policy().params and p.compute_dtype == Policy().compute_dtype


def test_resolve_accepts_a_dict_and_a_policy():
    assert resolve({"compute_dtype": "fp32"}).compute_dtype.value == "fp32"
    merged = resolve({"optimizer": {"lr": 5e-4, "eps": 1e-6}}, {"optimizer": {"lr": 1e-3}})
    assert (merged.optimizer.lr, merged.optimizer.eps) == (1e-3, 1e-6)
    p = Policy.from_dict(NON_DEFAULT)
    assert resolve(p) is p
    q = resolve(p, {"optimizer": {"weight_decay": 0.5}})
    assert q.optimizer.weight_decay == 0.5 and q.optimizer.lr == 3e-4


def test_resolve_rejects_other_types():
    with pytest.raises(tiered.PolicyError, match="YAML path, a dict or a tiered.Policy, got int"):
        resolve(42)


# -- errors -----------------------------------------------------------------------------------

def test_malformed_yaml_names_file_and_line(tmp_path):
    message = policy_error(yaml_text="compute_dtype: bf16\nparams:\n\ttier: dram\n",
                           tmp_path=tmp_path)
    assert str(tmp_path / "policy.yaml") in message
    assert "malformed YAML" in message
    assert "line 3" in message


def test_unclosed_flow_mapping_is_malformed_yaml(tmp_path):
    message = policy_error(yaml_text="optimizer: {lr: 1.0e-4\nparams: {tier: dram}\n",
                           tmp_path=tmp_path)
    assert str(tmp_path / "policy.yaml") in message and "malformed YAML at line" in message


def test_missing_file_names_it(tmp_path):
    with pytest.raises(tiered.PolicyError) as info:
        Policy.from_yaml(tmp_path / "nope.yaml")
    assert str(tmp_path / "nope.yaml") in str(info.value) and "does not exist" in str(info.value)


def test_non_utf8_file_is_a_policy_error(tmp_path):
    path = tmp_path / "binary.yaml"
    path.write_bytes(b"compute_dtype: bf16\nparams: {tier: \xff\xfe}\n")
    with pytest.raises(tiered.PolicyError) as info:
        Policy.from_yaml(path)
    assert str(path) in str(info.value) and "UTF-8" in str(info.value)


def test_unknown_key_names_the_key_path_and_allowed_keys(tmp_path):
    message = policy_error(yaml_text="optimizer: {tier: dram, lrr: 1.0e-3}\n", tmp_path=tmp_path)
    assert str(tmp_path / "policy.yaml") in message
    assert "optimizer.lrr" in message
    for allowed in ("tier", "lr", "betas", "eps", "weight_decay", "max_grad_norm"):
        assert allowed in message.split("allowed here:")[1]


def test_unknown_top_level_key_lists_the_sections():
    message = policy_error({"optimiser": {"lr": 1e-3}})
    assert "'optimiser'" in message
    for section in ("compute_dtype", "params", "grads", "optimizer", "nvme", "hbm", "dram"):
        assert section in message


@pytest.mark.parametrize("key", ["params", "grads", "optimizer"])
def test_bad_tier_names_key_and_allowed_tiers(key):
    message = policy_error({key: {"tier": "ssd"}})
    assert f"{key}.tier" in message and "'ssd'" in message
    assert "hbm | dram | nvme" in message


@pytest.mark.parametrize("key, value, allowed", [
    ("compute_dtype", "fp8", "bf16 | fp16 | fp32"),
    ("device", "tpu", "auto | cpu | cuda"),
])
def test_bad_enum_value_names_what_is_allowed(key, value, allowed):
    message = policy_error({key: value})
    assert key in message and repr(value) in message and allowed in message


@pytest.mark.parametrize("key", ["nvme", "hbm", "dram"])
def test_bad_size_string_names_key_value_and_units(key, tmp_path):
    message = policy_error(yaml_text=f"{key}: {{budget: 12 parsecs}}\n", tmp_path=tmp_path)
    assert str(tmp_path / "policy.yaml") in message
    assert f"{key}.budget" in message and "'12 parsecs'" in message
    assert "GiB" in message and "GB" in message


@pytest.mark.parametrize("tiers", [{"params": {"tier": "nvme"}},
                                   {"optimizer": {"tier": "nvme"}},
                                   {"params": {"tier": "nvme"}, "optimizer": {"tier": "nvme"}}])
def test_nvme_tier_without_nvme_path_is_refused(tiers):
    message = policy_error(tiers)
    assert "nvme.path is required" in message and "--nvme" in message
    assert Policy.from_dict({**tiers, "nvme": {"path": "/somewhere"}}).uses_nvme


@pytest.mark.parametrize("optimizer_tier, grads_tier, expected", [
    ("hbm", "dram", "hbm"),
    ("dram", "hbm", "dram"),
    ("nvme", "hbm", "dram"),
])
def test_grads_tier_must_match_the_optimizer_tier(optimizer_tier, grads_tier, expected):
    data = {"optimizer": {"tier": optimizer_tier}, "grads": {"tier": grads_tier},
            "nvme": {"path": "/x"}}
    message = policy_error(data)
    assert f"grads.tier must be '{expected}'" in message
    assert f"optimizer.tier is '{optimizer_tier}'" in message


def test_grads_tier_cannot_be_nvme():
    message = policy_error({"grads": {"tier": "nvme"}})
    assert "grads" in message and "tier must be hbm, dram or auto" in message and "'nvme'" in message


def test_top_level_must_be_a_mapping(tmp_path):
    message = policy_error(yaml_text="- params\n- grads\n", tmp_path=tmp_path)
    assert str(tmp_path / "policy.yaml") in message
    assert "top level must be a mapping" in message and "list" in message
    assert "must be a mapping" in policy_error(["compute_dtype"])


def test_a_section_must_be_a_mapping():
    message = policy_error({"params": "dram"})
    assert "test.yaml" in message and "params must be a mapping" in message and "'dram'" in message


@pytest.mark.parametrize("betas", [[0.9, 1.0], [-0.1, 0.999], [1.5, 0.9]])
def test_betas_out_of_range(betas):
    message = policy_error({"optimizer": {"betas": betas}})
    assert "optimizer" in message and "betas must each be in [0, 1)" in message
    assert str(betas) in message


def test_betas_must_be_two_numbers():
    message = policy_error({"optimizer": {"betas": [0.9]}})
    assert "optimizer.betas" in message and "two numbers" in message


@pytest.mark.parametrize("optimizer, fragment", [
    ({"lr": -1.0}, "lr must be >= 0"),
    ({"eps": 0.0}, "eps must be > 0"),
    ({"weight_decay": -0.1}, "weight_decay must be >= 0"),
    ({"max_grad_norm": 0.0}, "max_grad_norm must be > 0"),
])
def test_optimizer_range_checks(optimizer, fragment):
    message = policy_error({"optimizer": optimizer})
    assert "optimizer" in message and fragment in message


# Each of these used to slip through: a raw TypeError (not a PolicyError) for null or a list,
# NaN past every range check, YAML's `yes` read as lr 1.0, growth_interval 2.5 cut to 2.
@pytest.mark.parametrize("yaml_text, key", [
    ("optimizer: {lr: null}", "optimizer.lr"),
    ("optimizer: {lr: [1]}", "optimizer.lr"),
    ("optimizer: {lr: .nan}", "optimizer.lr"),
    ("optimizer: {eps: .nan}", "optimizer.eps"),
    ("optimizer: {lr: yes}", "optimizer.lr"),
    ("optimizer: {betas: [null, 0.9]}", "optimizer.betas"),
    ("optimizer: {max_grad_norm: .nan}", "optimizer.max_grad_norm"),
    ("optimizer: {max_grad_norm: -.inf}", "optimizer.max_grad_norm"),
    ("loss_scale: {growth_interval: null}", "loss_scale.growth_interval"),
    ("loss_scale: {growth_interval: 2.5}", "loss_scale.growth_interval"),
    ("dram: {huge_pages: 1}", "dram.huge_pages"),
])
def test_non_numbers_are_policy_errors_naming_the_key(yaml_text, key, tmp_path):
    message = policy_error(yaml_text=yaml_text + "\n", tmp_path=tmp_path)
    assert str(tmp_path / "policy.yaml") in message and key in message


@pytest.mark.parametrize("groups, fragment", [
    (3, "optimizer.param_groups must be a list of mappings"),
    (["*.bias"], "optimizer.param_groups[0] must be a mapping"),
    ([{"match": "*.bias", "wd": 0}], "unknown key 'optimizer.param_groups[0].wd'"),
    ([{"lr": 1e-3}], "optimizer.param_groups[0]: match is required"),
    ([{"match": []}], "optimizer.param_groups[0].match: expected a non-empty list"),
    ([{"match": "*"}, {"match": "*", "weight_decay": -1}],
     "optimizer.param_groups[1]: weight_decay must be >= 0"),
])
def test_param_groups_errors_name_the_group_and_key(groups, fragment):
    assert fragment in policy_error({"optimizer": {"param_groups": groups}})


def test_param_groups_parse_round_trip_and_default_to_the_optimizer():
    policy = Policy.from_dict({"optimizer": {"param_groups": [
        {"match": "*.bias", "weight_decay": 0}, {"match": ["pos", "*ln*"], "lr": "1e-3"}]}})
    first, second = policy.optimizer.param_groups
    assert first.match == ("*.bias",) and first.weight_decay == 0.0 and first.lr is None
    assert second.match == ("pos", "*ln*") and second.lr == 1e-3 and second.betas is None
    assert Policy.from_dict(policy.to_dict()) == policy
    assert Policy.from_dict({"optimizer": {"param_groups": None}}).optimizer.param_groups == ()


def test_units_classes_must_be_a_list_of_names():
    message = policy_error({"units": {"classes": "Block"}})
    assert "units.classes" in message and "list of module class names" in message


@pytest.mark.parametrize("yaml_text, key, line, first", [
    ("params: {tier: dram}\ngrads: {tier: dram}\nparams: {tier: hbm}\n", "params", 3, 1),
    ("compute_dtype: fp32\nparams: {tier: dram, tier: hbm}\n", "tier", 2, 2),
], ids=["section", "flow-mapping"])
def test_a_key_given_twice_names_file_line_and_key(yaml_text, key, line, first, tmp_path):
    # PyYAML kept the last silently: the first params (or tier) meant nothing.
    message = policy_error(yaml_text=yaml_text, tmp_path=tmp_path)
    assert str(tmp_path / "policy.yaml") in message
    assert f"at line {line}" in message
    assert f"the key {key!r} is given twice (first at line {first})" in message


def test_a_key_a_yaml_merge_brought_in_may_be_overridden(tmp_path):
    path = write(tmp_path / "merge.yaml", "params: &dram {tier: dram}\n"
                                          "optimizer: {<<: *dram, tier: hbm}\n"
                                          "grads: {tier: hbm}\n")
    assert Policy.from_yaml(path).optimizer.tier is Tier.HBM


def test_a_mapping_merged_into_another_keeps_only_its_own_keys_as_its_own(tmp_path):
    # Building the first group copies the keys it merges into the anchored node, where a check
    # made while building the second saw "lr" twice.
    path = write(tmp_path / "merge.yaml",
                 "optimizer:\n"
                 "  param_groups:\n"
                 "    - {<<: &norms {<<: {weight_decay: 0.0, lr: 1.0e-4}, match: '*norm*', "
                 "lr: 2.0e-4}}\n"
                 "    - *norms\n")
    groups = Policy.from_yaml(path).optimizer.param_groups
    assert [(g.match, g.lr, g.weight_decay) for g in groups] == [(("*norm*",), 2e-4, 0.0)] * 2


@pytest.mark.parametrize("yaml_text, key, value", [
    ("nvme: {path: 5}", "nvme.path", "5"),
    ("nvme: {path: [a]}", "nvme.path", "['a']"),
    ("trace: {path: [a]}", "trace.path", "['a']"),
], ids=["nvme-number", "nvme-list", "trace-list"])
def test_a_path_must_be_a_string(yaml_text, key, value, tmp_path):
    # str() used to make them the paths "5" and "['a']".
    message = policy_error(yaml_text=yaml_text + "\n", tmp_path=tmp_path)
    assert f"{key}: expected a path (a string), got {value}" in message


def test_a_path_object_given_in_code_is_a_path(tmp_path):
    assert Policy.from_dict({"nvme": {"path": tmp_path}}).nvme.path == str(tmp_path)
    # Built in code too: to_dict() must stay JSON (a checkpoint's manifest holds it).
    policy = Policy(nvme=NvmePolicy(path=tmp_path), trace=TracePolicy(path=tmp_path / "t.json"))
    assert json.loads(json.dumps(policy.to_dict()))["nvme"]["path"] == str(tmp_path)
    assert policy.trace.path == str(tmp_path / "t.json")


@pytest.mark.parametrize("compute_dtype, max_unit_bytes, element", [
    ("fp32", 0, 4), ("fp32", 3, 4), ("bf16", 1, 2)])
def test_tiling_below_one_element_is_refused(compute_dtype, max_unit_bytes, element):
    # It used to pass here and fail in tiling: ZeroDivisionError, or a ValueError naming splits.
    policy = {"compute_dtype": compute_dtype, "tiling": {"max_unit_bytes": max_unit_bytes}}
    message = policy_error(policy)
    assert "test.yaml" in message and f"got {max_unit_bytes}" in message
    assert f"tiling.max_unit_bytes must be null or at least {element} bytes" in message
    policy["tiling"]["max_unit_bytes"] = element
    assert Policy.from_dict(policy).tiling.max_unit_bytes == element


@pytest.mark.parametrize("yaml_text, fragment", [
    ("optimizer: {lr: fast}", "optimizer.lr: expected a number, got 'fast'"),
    ("loss_scale: {growth_interval: many}",
     "loss_scale.growth_interval: expected a whole number, got 'many'"),
], ids=["float", "int"])
def test_a_word_where_a_number_belongs_names_key_and_value(yaml_text, fragment, tmp_path):
    # float() said only "could not convert string to float: 'fast'".
    message = policy_error(yaml_text=yaml_text + "\n", tmp_path=tmp_path)
    assert str(tmp_path / "policy.yaml") in message and fragment in message


# -- overrides: their errors are theirs -------------------------------------------------------

CPU_YAML = str(CONFIGS / "cpu.yaml")


@pytest.mark.parametrize("overrides, fragment", [
    ({"bogus": 1}, "unknown key 'bogus'"),
    ({"optimizer": {"lr": "x"}}, "optimizer.lr: expected a number, got 'x'"),
    ({"params": {"tier": "nvme"}}, "nvme.path is required"),  # the file has no path for it
], ids=["unknown-key", "bad-value", "cross-field"])
def test_an_error_the_overrides_bring_names_them_not_the_file(overrides, fragment):
    with pytest.raises(tiered.PolicyError) as info:
        tiered.initialize(nn.Linear(4, 4), CPU_YAML, **overrides)
    message = str(info.value)
    assert message.startswith(f"{CPU_YAML} with overrides {overrides!r}: "), message
    assert fragment in message


def test_an_error_of_the_file_alone_is_still_the_files(tmp_path):
    path = write(tmp_path / "slow.yaml", "optimizer: {lr: fast}\n")
    with pytest.raises(tiered.PolicyError) as info:
        resolve(str(path), {"compute_dtype": "fp32"})
    assert str(info.value).startswith(f"{path}: optimizer.lr"), str(info.value)


def test_an_override_may_complete_the_file_and_still_be_named_for_its_own_error(tmp_path):
    nvme = {"path": str(tmp_path)}
    assert resolve(str(CONFIGS / "nvme.yaml"), {"nvme": nvme}).nvme.path == str(tmp_path)
    assert resolve(str(write(tmp_path / "path.yaml", f"nvme: {{path: {tmp_path}}}\n")),
                   {"params": {"tier": "nvme"}}).params.tier is Tier.NVME
    with pytest.raises(tiered.PolicyError) as info:  # nvme.yaml alone lacks the path
        resolve(str(CONFIGS / "nvme.yaml"), {"nvme": nvme, "bogus": 1})
    assert " with overrides " in str(info.value) and "unknown key 'bogus'" in str(info.value)


@pytest.mark.parametrize("base, source", [
    (None, "the built-in defaults"), (Policy(), "a tiered.Policy"), ({}, "<dict>"),
], ids=["defaults", "policy", "dict"])
def test_override_errors_name_their_base(base, source, monkeypatch):
    monkeypatch.delenv(POLICY_ENV, raising=False)
    with pytest.raises(tiered.PolicyError) as info:
        resolve(base, {"bogus": 1})
    assert str(info.value).startswith(f"{source} with overrides {{'bogus': 1}}: unknown key ")


def test_override_errors_of_tiered_init_and_of_a_launched_rank_name_the_overrides(monkeypatch):
    monkeypatch.delenv(POLICY_ENV, raising=False)
    with pytest.raises(tiered.PolicyError) as info:
        tiered.init(CPU_YAML, bogus=1)
    assert str(info.value).startswith(f"{CPU_YAML} with overrides {{'bogus': 1}}: ")
    monkeypatch.setenv(POLICY_ENV, json.dumps(Policy().to_dict()))
    with pytest.raises(tiered.PolicyError) as info:
        resolve(None, {"bogus": 1})
    assert str(info.value).startswith(f"${POLICY_ENV} (from tiered-launch) with overrides ")


# -- tiered.Policy built in code --------------------------------------------------------------

@pytest.mark.parametrize("fields, key, example", [
    ({"compute_dtype": "bf16"}, "compute_dtype must be a ComputeDtype, got 'bf16'",
     "Policy.from_dict({'compute_dtype': 'bf16'})"),
    ({"params": {"tier": "nvme"}}, "params must be a ParamsPolicy, got {'tier': 'nvme'}",
     "Policy.from_dict({'params': {'tier': 'nvme'}})"),
    ({"params": ParamsPolicy("nvme")}, "params.tier must be a Tier, got 'nvme'",
     "Policy.from_dict({'params': {'tier': 'nvme'}})"),
    ({"optimizer": OptimizerPolicy(param_groups=({"match": "*.bias"},))},
     "optimizer.param_groups[0] must be a ParamGroupPolicy, got {'match': '*.bias'}",
     "Policy.from_dict({'optimizer': {'param_groups': [{'match': '*.bias'}]}})"),
], ids=["enum", "section", "enum-in-section", "section-in-list"])
def test_a_plain_value_in_a_policy_built_in_code_is_refused(fields, key, example):
    # It used to fail deep in initialize: 'str' object has no attribute 'torch_dtype'.
    with pytest.raises(tiered.PolicyError) as info:
        Policy(**fields)
    assert key in str(info.value) and example in str(info.value)


def test_a_policy_built_in_code_from_enums_and_sections_is_the_one_from_dict(tmp_path):
    built = Policy(compute_dtype=ComputeDtype.FP32, params=ParamsPolicy(Tier.NVME),
                   nvme=NvmePolicy(path=str(tmp_path)))
    assert built == Policy.from_dict({"compute_dtype": "fp32", "params": {"tier": "nvme"},
                                      "nvme": {"path": str(tmp_path)}})


def test_an_infinite_max_grad_norm_measures_without_clipping(tmp_path):
    """``.inf`` is clip_grad_norm_'s max_norm=inf: the norm is taken, nothing is clipped."""
    path = tmp_path / "policy.yaml"
    path.write_text("optimizer: {max_grad_norm: .inf}\n")
    assert tiered.Policy.from_yaml(path).optimizer.max_grad_norm == float("inf")


def test_a_reserve_without_tier_auto_is_refused_by_name():
    """hbm.reserve is read by the planner of tier: auto alone: elsewhere it would be a
    setting that silently does nothing."""
    message = policy_error({"hbm": {"reserve": "1GiB"}})
    assert "hbm.reserve" in message and "tier: auto" in message


def test_every_error_of_a_file_is_reported_at_once_with_the_nearest_key(tmp_path):
    """A user fixes a policy in one pass, not one error a run: each unknown key, with the
    allowed key nearest to it, and each value that does not parse, a line each, in file order;
    exit 2 from ``tiered check-policy``."""
    path = write(tmp_path / "typos.yaml", "optimzer: {lr: 1e-3}\nparams: {tier: dramm}\n"
                                          "dram: {budget: lots, spil: nvme}\n")
    with pytest.raises(tiered.PolicyError) as info:
        resolve(str(path))
    lines = str(info.value).splitlines()
    assert lines[0] == "4 errors:"
    assert lines[1].startswith(f"{path}: unknown key 'optimzer'; did you mean 'optimizer'? "
                               f"allowed here: compute_dtype, device, params")
    assert lines[2] == f"{path}: params.tier is 'dramm'; allowed: hbm | dram | nvme | auto"
    assert lines[3].startswith(f"{path}: dram.budget: expected a byte size")
    assert lines[4] == (f"{path}: unknown key 'dram.spil'; did you mean 'spill'? allowed here: "
                        f"budget, spill, huge_pages")
    assert tiered_cli(["check-policy", str(path)]) == 2


def test_an_unknown_key_with_nothing_near_lists_what_is_allowed(tmp_path):
    path = write(tmp_path / "far.yaml", "optimizer: {zzzz: 1}\n")
    with pytest.raises(tiered.PolicyError, match=r"unknown key 'optimizer.zzzz'; allowed here: "
                                                 r"tier, lr, betas"):
        resolve(str(path))
