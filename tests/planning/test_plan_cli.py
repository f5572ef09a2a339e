"""``tiered plan MODEL``: a model planned with nothing allocated, from ``module:factory`` or a
Hugging Face config folder, gives the bytes ``initialize`` then allocates for the same model and
policy, and the placement it then makes; bad input is one line naming what is wrong."""
from __future__ import annotations

import json
import os

import pytest
import torch
import yaml

import tiered
from tiered.launch.cli import main
from tiered.placement.plan import StateKind
from tiered.planning.node import NodeRates
from tiered.policy.config import Policy

from helpers import REPO
from helpers_models import OPTIM, make_model
from helpers_placement import SUB_GROUP, mixed_budgets, units_per_tier

NODE = NodeRates(machine="the planned node", measured_at=0.0, cpu_threads=14,
                 cpu_adamw_params_per_s=4e9, cpu_one_pass_params_per_s=4e9,
                 gpu_adamw_params_per_s=1e11, h2d_gbps=50.0, d2h_gbps=50.0, both_gbps=80.0,
                 nvme_write_gbps=2.0, nvme_read_gbps=2.0, hbm_bytes=80 << 30,
                 dram_bytes=125 << 30)


def plan_json(capsys, *args: str) -> dict:
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def policy_file(tmp_path, config: str, **overrides) -> str:
    """``config`` on the CPU in fp32 with ``overrides``, as a file the command reads."""
    data = Policy.from_yaml(os.path.join(REPO, "configs", f"{config}.yaml"), dict(
        device="cpu", compute_dtype="fp32", nvme={"path": str(tmp_path)},
        optimizer=dict(OPTIM, betas=list(OPTIM["betas"]), sub_group_size=SUB_GROUP),
        **overrides)).to_dict()
    path = tmp_path / f"{config}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def assert_plan_is_what_initialize_allocates(planned: dict, engine) -> None:
    held = engine.memory_report()
    for tier in ("dram", "nvme"):
        assert planned["needed"].get(tier, 0) == held[tier]["current"], tier
    for kind in (StateKind.PARAM, StateKind.GRAD, StateKind.MASTER):
        assert planned["units"][kind.value] == units_per_tier(engine, kind), kind


@pytest.mark.parametrize("config", ["nvme", "auto"])
def test_a_factory_is_planned_as_initialize_allocates(config, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TIERED_CACHE", str(tmp_path / "cache"))  # no rates: the plan alone
    overrides = mixed_budgets(1) if config == "auto" else {}
    path = policy_file(tmp_path, config, **overrides)
    planned = plan_json(capsys, "helpers_models:make_model", "--policy", path)
    engine, _ = tiered.initialize(make_model(), path)
    assert_plan_is_what_initialize_allocates(planned, engine)
    engine.close()
    if config == "auto":  # the mixed placement of test_auto_placement
        assert planned["units"]["master"] == {"hbm": 1, "nvme": 1, "dram": 1}


def llama_folder(tmp_path, monkeypatch):
    """A 2-layer Llama config saved to a folder, the transformers module, and no node rates."""
    monkeypatch.setenv("TIERED_CACHE", str(tmp_path / "cache"))
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=32)
    config.save_pretrained(tmp_path / "model")
    return str(tmp_path / "model"), config, transformers


def assert_planned_as_it_runs(planned: dict, model, path: str) -> None:
    """``initialize`` allocates what was planned, and a step of ``planned``'s batch (4 x 16)
    keeps the activations counted on fake tensors."""
    engine, optimizer = tiered.initialize(model, path)
    assert_plan_is_what_initialize_allocates(planned, engine)
    ids = torch.randint(0, 128, (4, 16))
    engine(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    assert planned["batch"]["activations"] == engine.plan_report().measured.activations > 0
    engine.close()


def test_a_hugging_face_config_folder_is_planned_as_initialize_allocates(tmp_path, capsys,
                                                                           monkeypatch):
    folder, config, transformers = llama_folder(tmp_path, monkeypatch)
    path = policy_file(tmp_path, "cpu")
    planned = plan_json(capsys, folder, "--policy", path, "--batch", "4", "--seq", "16")
    assert_planned_as_it_runs(planned, transformers.AutoModelForCausalLM.from_config(config),
                              path)


def test_a_lora_fine_tune_with_checkpointing_is_planned_as_it_allocates_and_keeps(
        tmp_path, capsys, monkeypatch):
    """--lora and --checkpointing: the plan of the peft model initialize then holds, and the
    activations its checkpointed step keeps (each decoder layer's input, the loss's logits)."""
    folder, config, transformers = llama_folder(tmp_path, monkeypatch)
    peft = pytest.importorskip("peft")
    path = policy_file(tmp_path, "cpu")
    planned = plan_json(capsys, folder, "--policy", path, "--lora", "4", "--checkpointing",
                        "--batch", "4", "--seq", "16")
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert_planned_as_it_runs(planned, peft.get_peft_model(model, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")), path)
    without = plan_json(capsys, folder, "--policy", path, "--lora", "4", "--batch", "4",
                        "--seq", "16")
    assert without["batch"]["activations"] > 2 * planned["batch"]["activations"]


def test_another_nodes_rates_size_the_budgets_and_predict_the_step(tmp_path, capsys):
    node = tmp_path / "node.json"
    node.write_text(json.dumps(NODE.__dict__))
    auto = os.path.join(REPO, "configs", "auto.yaml")
    planned = plan_json(capsys, "helpers_models:make_model", "--policy", auto, "--node",
                        str(node), "--ranks", "2")
    assert planned["budgets"] == {"hbm": 80 << 30, "dram": (125 << 30) * 7 // 8 // 2}
    assert planned["units"]["master"] == {"hbm": 3}  # a toy: all of it fits the device
    assert planned["bound"] == "GPU update" and planned["rates_of"] == "the planned node"
    assert main(["plan", "helpers_models:make_model", "--policy", auto, "--node",
                 str(node)]) == 0
    table = capsys.readouterr().out
    assert "units: master" in table and "bound by GPU update" in table


@pytest.mark.parametrize("args, message", [
    (["no_such_module:f"], "No module named 'no_such_module'"),
    (["helpers_models:nothing_here"], "has no attribute 'nothing_here'"),
    (["helpers_models:batch"], "batch() failed: TypeError"),
    (["/no/such/folder"], "not module:factory"),
    (["helpers_models:make_model", "--ranks", "0"], "--ranks must be >= 1"),
    (["helpers_models:make_model", "--batch", "0", "--seq", "8"], "--batch must be >= 1"),
    (["helpers_models:make_model", "--batch", "8"], "--batch and --seq go together"),
    (["helpers_models:make_model", "--batch", "2", "--seq", "8", "--checkpointing"],
     "--checkpointing: MODEL 'helpers_models:make_model' is not a Hugging Face model"),
    (["helpers_models:make_model", "--checkpointing"], "give --batch and --seq too"),
    (["torch.nn:Transformer", "--batch", "2", "--seq", "8"],  # forward(src, tgt)
     "its forward on a (2, 8) batch of token ids on fake tensors failed"),
    (["helpers_models:make_model", "--node", "/no/such/node.json"], "--node /no/such"),
])
def test_bad_input_is_one_line_naming_it(args, message, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("TIERED_CACHE", str(tmp_path))  # no node measured here
    assert main(["plan", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and message in captured.err, captured.err
    assert len(captured.err.strip().splitlines()) == 1 and "Traceback" not in captured.err


def test_a_config_folder_without_a_config_is_refused(tmp_path, capsys):
    assert main(["plan", str(tmp_path)]) == 2
    assert "no config.json there" in capsys.readouterr().err
