"""A DeepSpeed config runs as it is (tiered/policy/deepspeed.py): the shapes DeepSpeed's
documentation and Hugging Face's examples publish (tests/data/deepspeed: ZeRO-3 offload to the
CPU, ZeRO-Infinity to NVMe with ``aio``, Hugging Face's ``"auto"`` one) map onto the Policy a YAML
would give, field by field; every key of them is honoured, ignored with a reason or left to the
training script; what tiered does not offer is refused by name, every refusal at once; ``tiered
policy from-deepspeed`` writes a YAML that resolves to the same Policy, and a run under the
DeepSpeed file is that YAML's bit for bit. ``tiered check-policy`` and ``tiered-launch`` read a
.json as real subprocesses, side by side.
"""
from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import yaml

import tiered
from tiered.launch.cli import main as tiered_cli
from tiered.policy.config import Policy, resolve
from tiered.policy.kinds import ComputeDtype, Tier
from tiered.policy.deepspeed import DEEPSPEED_ENV, Fate, mismatches, read_deepspeed

from helpers import REPO, clean_env, finish, same_bits
from helpers_models import MICRO, OPTIM, assert_parity, make_model, run_engine, train_torch

DATA = REPO / "tests" / "data" / "deepspeed"
FIXTURES = ("zero3_offload_cpu.json", "zero_infinity_nvme.json", "hf_zero3_auto.json")

TRAIN = {
    "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                          "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "overlap_comm": True, "reduce_bucket_size": 5e8},
    "optimizer": {"type": "AdamW", "params": {"lr": OPTIM["lr"], "betas": list(OPTIM["betas"]),
                                              "eps": OPTIM["eps"],
                                              "weight_decay": OPTIM["weight_decay"]}},
    "gradient_clipping": 1.0,
    "gradient_accumulation_steps": MICRO,
    "train_micro_batch_size_per_gpu": 4,
}
"""A ZeRO-3 CPU-offload config without bf16 or fp16 (fp32, as DeepSpeed computes then) whose
optimizer, clipping and accumulation are the parity tests' (tests/helpers_models.py)."""


def write_json(path: Path, data: dict) -> Path:
    path.write_text(json.dumps(data, indent=2))
    return path


def refusal(tmp_path: Path, data: dict) -> str:
    with pytest.raises(tiered.PolicyError) as info:
        resolve(str(write_json(tmp_path / "ds_config.json", data)))
    return str(info.value)


def leaves(data: dict, prefix: str = "") -> set[str]:
    """Every key path of ``data`` down to its values (the scheduler is one key)."""
    found = set()
    for name, value in data.items():
        key = f"{prefix}{name}"
        if isinstance(value, dict) and name != "scheduler":
            found |= leaves(value, key + ".")
        else:
            found.add(key)
    return found


# -- the published shapes, field by field --------------------------------------------------------

def test_zero3_offload_to_cpu_is_the_cpu_policy_with_the_configs_values():
    policy = resolve(str(DATA / "zero3_offload_cpu.json"))
    assert policy == Policy.from_dict({
        "compute_dtype": "bf16",
        "params": {"tier": "dram"}, "grads": {"tier": "dram"},
        "optimizer": {"tier": "dram", "lr": 3e-5, "betas": [0.9, 0.95], "eps": 1e-8,
                      "weight_decay": 0.1, "max_grad_norm": 1.0, "accumulation_steps": 4},
        "prefetch": {"hbm_bytes": 5 * 10**8 * 2}})  # elements of bf16
    assert policy.compute_dtype is ComputeDtype.BF16
    assert (policy.params.tier, policy.grads.tier, policy.optimizer.tier) == (Tier.DRAM,) * 3
    assert policy.optimizer.lr == 3e-5 and policy.optimizer.betas == (0.9, 0.95)
    assert policy.optimizer.sub_group_size == Policy().optimizer.sub_group_size  # CPU: unused


def test_zero_infinity_to_nvme_takes_the_path_the_aio_settings_and_the_loss_scale():
    policy = resolve(str(DATA / "zero_infinity_nvme.json"))
    assert policy == Policy.from_dict({
        "compute_dtype": "fp16",
        "params": {"tier": "nvme"}, "grads": {"tier": "dram"},
        "optimizer": {"tier": "nvme", "lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8,
                      "weight_decay": 0.01, "max_grad_norm": 1.0, "accumulation_steps": 1,
                      "sub_group_size": 10**9 // 1024 * 1024},
        "nvme": {"path": "/local_nvme", "block_size": 262144, "queue_depth": 32},
        "loss_scale": {"initial_scale": 2.0**16, "growth_interval": 1000},
        "prefetch": {"hbm_bytes": 10**7 * 2}})
    assert policy.uses_nvme and policy.nvme.path == "/local_nvme"
    assert policy.loss_scale.growth_factor == 2.0 and policy.loss_scale.backoff_factor == 0.5


def test_the_hf_auto_config_leaves_its_auto_values_to_the_trainer():
    """Hugging Face's integration fills "auto" from the TrainingArguments, as TieredTrainer
    does: the policy keeps tiered's defaults there; the offload and loss scale are the file's."""
    translation = read_deepspeed(DATA / "hf_zero3_auto.json")
    assert resolve(str(DATA / "hf_zero3_auto.json")) == Policy.from_dict({
        "params": {"tier": "dram"}, "grads": {"tier": "dram"}, "optimizer": {"tier": "dram"},
        "loss_scale": {"initial_scale": 2.0**16, "growth_interval": 1000}})
    left = {note.key for note in translation.notes if note.fate is Fate.SCRIPT}
    assert left == {"fp16.enabled", "bf16.enabled", "optimizer.params.lr",
                    "optimizer.params.betas", "optimizer.params.eps",
                    "optimizer.params.weight_decay", "scheduler", "gradient_accumulation_steps",
                    "gradient_clipping", "train_batch_size", "train_micro_batch_size_per_gpu"}
    assert translation.script_values == {}  # nothing for a trainer's arguments to contradict


@pytest.mark.parametrize("name", FIXTURES)
def test_every_key_of_a_published_config_is_honoured_ignored_or_left_to_the_script(name):
    translation = read_deepspeed(DATA / name)
    noted = {note.key for note in translation.notes}
    assert leaves(json.loads((DATA / name).read_text())) <= noted
    for note in translation.notes:
        assert note.says, note  # each with what became of it, or why not
    ignored = {note.key: note.says for note in translation.notes if note.fate is Fate.IGNORED}
    assert "units" in ignored["zero_optimization.reduce_bucket_size"]


@pytest.mark.parametrize("cpu_checkpointing", [True, False])
def test_cpu_checkpointing_keeps_the_activations_in_dram(tmp_path, cpu_checkpointing):
    """DeepSpeed's activation checkpointing section, every key of its documented shape: only
    where the checkpoints are kept means something to tiered (issue 34)."""
    data = {"zero_optimization": {"stage": 3},
            "activation_checkpointing": {
                "partition_activations": True, "cpu_checkpointing": cpu_checkpointing,
                "contiguous_memory_optimization": False, "number_checkpoints": None,
                "synchronize_checkpoint_boundary": False, "profile": False}}
    path = write_json(tmp_path / "ds.json", data)
    translation = read_deepspeed(path)
    assert leaves(data) <= {note.key for note in translation.notes}
    tier = resolve(str(path)).activations.tier
    assert tier is (Tier.DRAM if cpu_checkpointing else Tier.HBM)


def test_a_config_without_bf16_or_fp16_computes_in_fp32_and_without_offload_on_the_gpu(tmp_path):
    path = write_json(tmp_path / "ds.json", {"zero_optimization": {"stage": 3}})
    assert resolve(str(path)) == Policy.from_dict({
        "compute_dtype": "fp32", "params": {"tier": "hbm"}, "grads": {"tier": "hbm"},
        "optimizer": {"tier": "hbm"}})


def test_adam_is_adamw_zero_clipping_none_a_zero_prefetch_bucket_off_and_auto_tiereds_own(
        tmp_path):
    policy = resolve(str(write_json(tmp_path / "ds.json", {
        "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 0,
                              "offload_optimizer": {"device": "nvme", "nvme_path": "/x"},
                              "sub_group_size": "auto"},
        "optimizer": {"type": "adam", "params": {"adam_w_mode": False, "weight_decay": 0}},
        "gradient_clipping": 0.0})))
    assert policy.optimizer.max_grad_norm is None and policy.optimizer.weight_decay == 0
    assert policy.prefetch.enabled is False
    assert policy.optimizer.sub_group_size == Policy().optimizer.sub_group_size


def test_bf16_master_weights_and_optimizer_states_are_the_compact_states(tmp_path):
    policy = resolve(str(write_json(tmp_path / "ds.json", {
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                              "offload_optimizer": {"device": "cpu"}},
        "bf16": {"enabled": True, "bf16_master_weights_and_grads": True,
                 "bf16_optimizer_states": True}})))
    assert (policy.optimizer.master.value, policy.optimizer.moments.value) == ("bf16", "bf16")


# -- refused by name, every refusal at once ------------------------------------------------------

@pytest.mark.parametrize("change, fragment", [
    ({"zero_optimization": {"stage": 2}}, "zero_optimization.stage is 2: tiered runs ZeRO stage 3"),
    ({"zero_optimization": {"stage": 1}}, "zero_optimization.stage is 1"),
    ({"zero_optimization": {}}, "zero_optimization.stage is not given (DeepSpeed's default: 0"),
    ({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}},
     "optimizer.type is 'Lamb': tiered runs AdamW only"),
    ({"optimizer": {"type": "OneBitAdam"}}, "allowed: Adam, AdamW"),
    ({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False, "weight_decay": 0.01}}},
     "optimizer.params.adam_w_mode is false: Adam with L2 regularization"),
    ({"optimizer": {"type": "AdamW", "params": {"amsgrad": True}}},
     "optimizer.params.amsgrad is true"),
    ({"fp16": {"enabled": True, "loss_scale": 128}}, "fp16.loss_scale is 128: a static loss "
     "scale; tiered scales fp16 losses dynamically only (allowed: 0)"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "DeepSpeed takes one of them"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}},
     "zero_optimization.offload_param.device is 'gpu'; allowed: cpu | nvme | none"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"pin_memory": True}}},
     "zero_optimization.offload_optimizer.device is not given; allowed: cpu | nvme | none"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}},
     "zero_optimization.offload_optimizer.ratio is 0.3"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/a"},
                            "offload_optimizer": {"device": "nvme", "nvme_path": "/b"}}},
     "under one nvme.path"),
    ({"zero_optimization": {"stage": 3, "cpu_offload": True}}, "zero_optimization.cpu_offload"),
    ({"amp": {"enabled": True}}, "amp.enabled is true: NVIDIA Apex AMP"),
    ({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket": 1}},
     "DeepSpeed key 'zero_optimization.stage3_prefetch_bucket' is not one tiered reads; did you "
     "mean 'stage3_prefetch_bucket_size'?"),
    ({"pipeline": {"stages": 2}}, "DeepSpeed key 'pipeline' is not one tiered reads; allowed "
     "here: zero_optimization, aio"),
    ({"params": {"tier": "nvme"}}, "'params' is a tiered policy key, in a DeepSpeed config"),
])
def test_what_tiered_does_not_offer_is_refused_by_name(change, fragment, tmp_path):
    data = {"zero_optimization": {"stage": 3}, **change}
    message = refusal(tmp_path, data)
    assert message.startswith(f"{tmp_path / 'ds_config.json'}: "), message
    assert fragment in message


def test_every_refusal_of_a_file_is_reported_at_once(tmp_path):
    message = refusal(tmp_path, {
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu",
                                                                "pin_memroy": True}},
        "optimizer": {"type": "Lamb"}, "gradient_clipping": -1, "train_batch_size": "lots"})
    lines = message.splitlines()
    assert lines[0] == "5 errors:", message
    assert "stage is 2" in lines[1] and "did you mean 'pin_memory'?" in lines[2]
    assert "'Lamb'" in lines[3] and "gradient_clipping is -1" in lines[4]
    assert "train_batch_size is 'lots': expected a whole number" in lines[5]


def test_explicit_values_that_differ_from_the_trainers_are_refused_auto_ones_are_not():
    translation = read_deepspeed(DATA / "zero3_offload_cpu.json")
    trainer = {"optimizer.params.lr": 3e-5, "optimizer.params.betas": [0.9, 0.95],
               "gradient_clipping": 1.0, "gradient_accumulation_steps": 4,
               "train_micro_batch_size_per_gpu": 8, "train_batch_size": 32,
               "bf16.enabled": True}
    assert mismatches(translation, trainer) == []
    found = mismatches(translation, {**trainer, "optimizer.params.lr": 1e-3,
                                     "train_batch_size": 64})
    assert found == [
        f"optimizer.params.lr is 3e-05 in {DATA / 'zero3_offload_cpu.json'} but learning_rate "
        f"is 0.001: set one to the other, or \"auto\" in the config",
        f"train_batch_size is 32 in {DATA / 'zero3_offload_cpu.json'} but world size x "
        f"per_device_train_batch_size x gradient_accumulation_steps is 64: set one to the "
        f"other, or \"auto\" in the config"]
    assert mismatches(read_deepspeed(DATA / "hf_zero3_auto.json"), trainer) == []


def test_a_tiered_policy_in_json_is_still_a_tiered_policy(tmp_path):
    path = write_json(tmp_path / "policy.json", {"optimizer": {"lr": 1e-3}})
    assert read_deepspeed(path) is None
    assert resolve(str(path)).optimizer.lr == 1e-3


# -- the YAML round trip and a run ---------------------------------------------------------------

def from_deepspeed(path: Path, capsys, *flags: str) -> str:
    assert tiered_cli(["policy", "from-deepspeed", str(path), *flags]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("name", FIXTURES)
def test_the_written_yaml_resolves_to_the_same_policy_with_the_notes_as_comments(
        name, tmp_path, capsys):
    text = from_deepspeed(DATA / name, capsys)
    written = tmp_path / "policy.yaml"
    written.write_text(text)
    assert Policy.from_yaml(written) == resolve(str(DATA / name))
    translation = read_deepspeed(DATA / name)
    comments = [line for line in text.splitlines() if line.startswith("#")]
    for note in translation.notes:
        assert any(f"#   {note.key}: " in line for line in comments), note
    assert yaml.safe_load(text) == (translation.policy or None)


def test_from_deepspeed_takes_the_nvme_path_a_config_leaves_out(tmp_path, capsys):
    data = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}}
    path = write_json(tmp_path / "ds.json", data)
    assert tiered_cli(["policy", "from-deepspeed", str(path)]) == 2
    assert "nvme.path is required" in capsys.readouterr().err
    text = from_deepspeed(path, capsys, "--nvme", str(tmp_path))
    assert yaml.safe_load(text)["nvme"] == {"path": str(tmp_path)}
    assert tiered_cli(["policy", "from-deepspeed", str(DATA.parent.parent / "conftest.py")]) == 2


def test_a_run_under_the_deepspeed_config_is_the_yamls_bit_for_bit_and_plain_adamws(
        tmp_path, capsys):
    ds = write_json(tmp_path / "ds_config.json", TRAIN)
    written = tmp_path / "policy.yaml"
    written.write_text(from_deepspeed(ds, capsys))
    states = []
    for policy in (ds, written):
        engine, optimizer = tiered.initialize(make_model(), str(policy), device="cpu")
        try:
            assert engine.policy.compute_dtype is ComputeDtype.FP32
            states.append(run_engine(engine, optimizer))
        finally:
            engine.close()
    assert list(states[0]) == list(states[1])
    for name in states[0]:
        assert same_bits(states[0][name], states[1][name]), name
    # The config's lr, betas, eps, weight decay, clipping and accumulation reached the update.
    model = make_model()
    reference = train_torch(model, torch.optim.AdamW(model.parameters(), **OPTIM),
                            max_grad_norm=1.0)
    assert_parity(states[0], reference)


# -- check-policy and tiered-launch, real subprocesses side by side ------------------------------

def started(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", *map(str, args)], cwd=REPO, env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def commands(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """check-policy of a good .json, tiered-launch of a good and of a refused one, at once."""
    where = tmp_path_factory.mktemp("deepspeed")
    # The script runs one backward a step.
    good = write_json(where / "ds_config.json", {**TRAIN, "gradient_accumulation_steps": 1})
    bad = write_json(where / "stage2.json", {"zero_optimization": {"stage": 2},
                                             "optimizer": {"type": "Lamb"}})
    nvme = where / "nvme"
    nvme.mkdir()
    (where / "out").mkdir()
    runs = {
        "check": ("tiered.launch.cli", "check-policy", DATA / "zero_infinity_nvme.json",
                  "--nvme", nvme),
        "launch": ("tiered.launch.launcher", "--no-daemon", "--policy", good,
                   REPO / "tests" / "scripts" / "launch_train.py", where / "out"),
        "launch refused": ("tiered.launch.launcher", "--no-daemon", "--policy", bad,
                           REPO / "tests" / "scripts" / "launch_train.py", where / "out"),
    }
    with ThreadPoolExecutor(len(runs)) as pool:
        futures = {name: pool.submit(lambda args: finish(started(*args)), args)
                   for name, args in runs.items()}
        results = {name: future.result() for name, future in futures.items()}
    results["where"] = where
    return results


def test_check_policy_prints_a_deepspeed_config_resolved_with_its_notes(commands):
    result = commands["check"]
    assert result.returncode == 0, result.stderr
    assert "#   zero_optimization.offload_param.device: 'nvme': params.tier: nvme" in \
        result.stdout
    assert "#   zero_optimization.offload_param.buffer_count: 5: the engine sizes" in \
        result.stdout
    nvme = str(commands["where"] / "nvme")
    assert Policy.from_dict(yaml.safe_load(result.stdout)) == resolve(
        str(DATA / "zero_infinity_nvme.json"), {"nvme": {"path": nvme}})


def test_a_refused_deepspeed_config_is_every_error_without_a_traceback(commands, capsys):
    """Exit 2 and the errors alone: from tiered-launch before any rank starts, and from
    check-policy (the same code path, here in this process)."""
    launched = commands["launch refused"]
    assert tiered_cli(["check-policy", str(commands["where"] / "stage2.json")]) == 2
    for prog, code, stderr in (("tiered-launch", launched.returncode, launched.stderr),
                               ("tiered", 2, capsys.readouterr().err)):
        assert code == 2, stderr
        assert "Traceback" not in stderr and "[rank" not in stderr
        lines = stderr.splitlines()
        assert lines[0] == f"{prog}: error: 2 errors:" and len(lines) == 3, stderr
        assert "stage2.json: zero_optimization.stage is 2" in lines[1]
        assert "stage2.json: optimizer.type is 'Lamb'" in lines[2]


def test_tiered_launch_runs_a_script_under_a_deepspeed_config(commands):
    result = commands["launch"]
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    notes = [line for line in result.stderr.splitlines() if "tiered-launch: note:" in line]
    assert notes[0] == ("tiered-launch: note: train_micro_batch_size_per_gpu: 4: the batch is "
                        "the script's data loader's (TieredTrainer's must equal it: "
                        "per_device_train_batch_size)")
    assert "a DeepSpeed config, 12 keys honoured, 4 ignored" in notes[-1]
    seen = json.loads((commands["where"] / "out" / "rank0.json").read_text())
    good = commands["where"] / "ds_config.json"
    assert Policy.from_dict(seen["policy"]) == resolve(str(good))  # what the rank ran under


# -- TieredTrainer(policy="ds_config.json") ------------------------------------------------------

def test_tiered_trainer_takes_auto_from_its_arguments_and_refuses_values_that_differ(
        tmp_path, monkeypatch):
    """As Hugging Face's DeepSpeed integration: "auto" is the TrainingArguments' value, an
    explicit one must equal it (refused by name before the engine takes the model), whether
    the config is given to the trainer or to tiered-launch (which names it to the ranks)."""
    # Here, not at the top: without the optional transformers only this test is skipped.
    pytest.importorskip("transformers")
    from helpers_hf import arguments, llama

    from tiered.integrations.transformers import TieredTrainer, deepspeed_refusals

    args = arguments(tmp_path, learning_rate=1e-3, per_device_train_batch_size=8,
                     gradient_accumulation_steps=4, max_grad_norm=1.0, weight_decay=0.1,
                     adam_beta2=0.95)
    with pytest.raises(tiered.TieredError, match="cannot honour") as refused:
        TieredTrainer(model=llama(), args=args, policy=str(DATA / "zero3_offload_cpu.json"))
    assert "optimizer.params.lr is 3e-05 in" in str(refused.value)
    assert "but learning_rate is 0.001" in str(refused.value)
    assert "bf16.enabled is true in" in str(refused.value)  # the arguments compute in fp32
    given = deepspeed_refusals(args, str(DATA / "zero3_offload_cpu.json"))
    assert deepspeed_refusals(args, None) == []
    monkeypatch.setenv(DEEPSPEED_ENV, str(DATA / "zero3_offload_cpu.json"))  # as tiered-launch
    assert deepspeed_refusals(args, None) == given != []

    trainer = TieredTrainer(model=llama(), args=args, policy=str(DATA / "hf_zero3_auto.json"))
    try:
        policy = trainer.engine.policy
        assert (policy.optimizer.lr, policy.optimizer.betas, policy.optimizer.max_grad_norm) == (
            1e-3, (0.9, 0.95), 1.0)
        assert policy.compute_dtype is ComputeDtype.FP32
        assert (policy.params.tier, policy.optimizer.tier) == (Tier.DRAM, Tier.DRAM)
        assert policy.loss_scale.growth_interval == 1000  # the file's, for fp16
    finally:
        trainer.engine.close()
