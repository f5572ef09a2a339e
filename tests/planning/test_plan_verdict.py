"""``tiered plan``'s verdict (issue 33): a plan fits (with each tier's headroom) or does not
(which tier, by how much), and what would make it fit is offered only as planned; the budgets
come from the node's memory before any rates are measured; the same question gets the same
numbers; identical blocks counted once give the bytes of counting them all."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import yaml

from tiered.launch.cli import main
from tiered.launch.plan_model import batch_activations, model_on_meta, plan_model
from tiered.planning import node
from tiered.planning.blocks import repeated_blocks
from tiered.planning.longest import Growth, NvmeRoom, longest_sequences
from tiered.planning.node import NodeMemory, NodeRates, cached_node_rates
from tiered.policy.config import Policy
from tiered.policy.kinds import Tier

from helpers import REPO

transformers = pytest.importorskip("transformers")

MiB = 1 << 20


def rates(dram_bytes: int, **changes) -> NodeRates:
    """A GPU node of 64 MiB of device memory and ``dram_bytes`` of host memory."""
    return NodeRates(**{**dict(
        machine="a small node", measured_at=0.0, cpu_threads=4, cpu_adamw_params_per_s=1e9,
        cpu_one_pass_params_per_s=1e9, gpu_adamw_params_per_s=1e11, h2d_gbps=10.0,
        d2h_gbps=10.0, both_gbps=16.0, nvme_path="/drive", nvme_write_gbps=1.0,
        nvme_read_gbps=1.0, hbm_bytes=64 * MiB, dram_bytes=dram_bytes), **changes})


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """An 8-layer Llama config, an fp32 policy, and no rates measured here."""
    monkeypatch.setenv("TIERED_CACHE", str(tmp_path / "cache"))
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=8, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    config.save_pretrained(tmp_path / "model")
    return tmp_path


def write(path, data) -> str:
    path.write_text(json.dumps(data) if path.suffix == ".json" else yaml.safe_dump(data))
    return str(path)


def plan(capsys, folder, dram_bytes: int, *args: str, policy: dict | None = None,
         seq: str = "32") -> dict:
    """``tiered plan --json`` of the 8-layer model at batch 2 x ``seq`` on a node of
    ``dram_bytes``."""
    node_file = write(folder / "node.json", dataclasses.asdict(rates(dram_bytes)))
    policy_file = write(folder / "policy.yaml", {"compute_dtype": "fp32", **(policy or {})})
    assert main(["plan", str(folder / "model"), "--policy", policy_file, "--node", node_file,
                 "--batch", "2", "--seq", seq, *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_plan_that_fits_says_each_tiers_headroom_and_its_step(folder, capsys):
    planned = plan(capsys, folder, 64 * MiB)
    verdict = planned["verdict"]
    assert verdict["fits"] and not verdict["over"] and not verdict["suggestions"]
    hbm, dram = verdict["tiers"]
    assert dram["budget"] == 64 * MiB * 7 // 8 == planned["budgets"]["dram"]
    assert dram["headroom"] == dram["budget"] - planned["needed"]["dram"] > 0
    activations = planned["batch"]["activations"]
    assert hbm["needed"] == planned["needed"]["hbm"] + activations + 64 * MiB // 16
    assert planned["bound"] is not None  # a step predicted for a plan that fits
    main(["plan", str(folder / "model"), "--policy", str(folder / "policy.yaml"), "--node",
          str(folder / "node.json")])
    table = capsys.readouterr().out
    assert table.splitlines()[-1].startswith("verdict: fits (hbm ") and "MiB free" in table


def test_a_plan_that_does_not_fit_names_the_tier_and_offers_only_what_planned_fits(folder,
                                                                                   capsys):
    planned = plan(capsys, folder, 8 * MiB)
    verdict = planned["verdict"]
    assert not verdict["fits"] and planned["terms"] is None and planned["bound"] is None
    [over] = verdict["over"]
    assert over["tier"] == "dram" and over["budget"] == 8 * MiB * 7 // 8
    assert over["over"] == planned["needed"]["dram"] - over["budget"] > 0
    offered = {suggestion["change"]: suggestion for suggestion in verdict["suggestions"]}
    assert set(offered) == {"dram.spill: nvme with --nvme /drive", "optimizer.moments: int8",
                            "LoRA r16 (--lora 16)"}
    assert offered["dram.spill: nvme with --nvme /drive"]["bound"] == "NVMe"
    # Each as the user would ask for it: it fits, with the step offered.
    spilled = plan(capsys, folder, 8 * MiB, "--nvme", str(folder), policy={"dram": {
        "spill": "nvme"}})
    int8 = plan(capsys, folder, 8 * MiB, policy={"optimizer": {"moments": "int8"}})
    lora = plan(capsys, folder, 8 * MiB, "--lora", "16")
    for change, asked in (("optimizer.moments: int8", int8), ("LoRA r16 (--lora 16)", lora),
                          ("dram.spill: nvme with --nvme /drive", spilled)):
        assert asked["verdict"]["fits"], change
        assert offered[change]["step_s"] == pytest.approx(max(
            value for value in asked["terms"].values() if value is not None)), change
    # Checkpointing was tried and does not fit: not offered.
    assert "activation checkpointing (--checkpointing)" in verdict["tried"]
    assert not plan(capsys, folder, 8 * MiB, "--checkpointing")["verdict"]["fits"]
    main(["plan", str(folder / "model"), "--policy", str(folder / "policy.yaml"), "--node",
          str(folder / "node.json")])
    table = capsys.readouterr().out
    assert "predicted step: none, the plan does not fit" in table
    assert "verdict: does not fit: dram needs" in table and "  LoRA r16 (--lora 16): fits" in table


def test_placements_that_fit_only_together_are_offered_together(folder, capsys):
    """States on the device (hbm tiers) on a node of 4 MiB of device memory and 6 MiB of host
    memory: no change fits alone, two do together, and a third beside them is not offered."""
    on_device = {tier: {"tier": "hbm"} for tier in ("params", "grads", "optimizer")}
    small = dataclasses.replace(rates(6 * MiB), hbm_bytes=4 * MiB)
    node_file = write(folder / "node.json", dataclasses.asdict(small))

    def planned(**policy) -> dict:
        policy_file = write(folder / "policy.yaml", {"compute_dtype": "fp32", **policy})
        assert main(["plan", str(folder / "model"), "--policy", policy_file, "--node",
                     node_file, "--json"]) == 0
        return json.loads(capsys.readouterr().out)["verdict"]

    verdict = planned(**on_device)
    host = "params, grads and optimizer on tier dram (configs/cpu.yaml)"
    assert [suggestion["change"] for suggestion in verdict["suggestions"]] == [
        f"dram.spill: nvme with --nvme /drive and {host}", f"optimizer.moments: int8 and {host}"]
    on_host = {tier: {"tier": "dram"} for tier in ("params", "grads", "optimizer")}
    assert not planned(**on_host)["fits"]
    assert not planned(**on_device | {"optimizer": {"tier": "hbm", "moments": "int8"}})["fits"]
    assert planned(**on_host | {"optimizer": {"tier": "dram", "moments": "int8"}})["fits"]


def test_without_rates_the_budgets_are_this_nodes_memory_the_same_each_time(folder, capsys):
    policy_file = write(folder / "policy.yaml", {"compute_dtype": "fp32"})
    args = ["plan", str(folder / "model"), "--policy", policy_file, "--batch", "2", "--seq",
            "32", "--json"]
    answers = []
    for _ in range(2):
        assert main(args) == 0
        answers.append(capsys.readouterr().out)
    assert answers[0] == answers[1]
    verdict = json.loads(answers[0])["verdict"]
    memory = node.this_node_memory()
    budgets = {room["tier"]: room["budget"] for room in verdict["tiers"]}
    if memory.hbm_bytes is None:  # the CPU's RAM holds both tiers
        assert budgets == {"ram (hbm and dram together)": memory.dram_bytes * 7 // 8}
    else:
        assert budgets["dram"] == memory.dram_bytes * 7 // 8


def test_rates_measured_with_a_drive_serve_a_plan_without_one(folder):
    measured = rates(64 * MiB, machine=node._machine(node.usable_cores(), "/drive"))
    os.makedirs(node.cache_folder(), exist_ok=True)
    node._write(node._cache_file(measured.machine), measured)
    assert cached_node_rates(None) == measured
    assert cached_node_rates("/drive") == measured and cached_node_rates("/other") is None


def test_identical_blocks_counted_once_give_the_bytes_of_counting_all(folder):
    spec = str(folder / "model")
    policy = Policy.from_dict({"compute_dtype": "fp32", "optimizer": {"tier": "auto"},
                               "params": {"tier": "auto"}, "grads": {"tier": "auto"}})
    memory = NodeMemory(4 * MiB, 64 * MiB, "a small node's")
    for lora, checkpointing in ((None, False), (4, True)):
        model = model_on_meta(spec, lora, checkpointing)
        assert [blocks.count for blocks in repeated_blocks(model)] == [8]
        counted = [batch_activations(model, spec, policy, 2, 32, siblings=siblings)
                   for siblings in (True, False)]
        assert counted[0] == counted[1] and counted[0][0] > 0
        reports = [plan_model(model, policy, 1, None, (2, 32, *kept), memory)
                   for kept in counted]
        assert reports[0].needed == reports[1].needed and Tier.HBM in reports[0].needed
        assert reports[0].units == reports[1].units
    assert not any(param.device.type != "meta" for param in model.parameters())


def test_the_command_answers_through_a_real_process(folder):
    node_file = write(folder / "node.json", dataclasses.asdict(rates(8 * MiB)))
    policy_file = write(folder / "policy.yaml", {"compute_dtype": "fp32"})
    done = subprocess.run([sys.executable, "-m", "tiered.launch.cli", "plan",
                           str(folder / "model"), "--policy", policy_file, "--node", node_file],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, TIERED_CACHE=str(folder / "cache")))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    verdict = lines.index(next(line for line in lines if line.startswith("verdict: ")))
    assert lines[verdict].startswith("verdict: does not fit: dram needs")
    assert lines[verdict + 1] == "what makes it fit (each planned):"
    assert all(": fits" in line for line in lines[verdict + 2:]) and len(lines) > verdict + 2


def test_a_node_without_memory_known_cannot_place_tier_auto(folder, capsys):
    unknown = dataclasses.replace(rates(64 * MiB, hbm_bytes=None), dram_bytes=None)
    node_file = write(folder / "node.json", dataclasses.asdict(unknown))
    assert main(["plan", str(folder / "model"), "--policy",
                 os.path.join(REPO, "configs", "auto.yaml"), "--node", node_file]) == 2
    assert "set hbm.budget in the policy, or give --node" in capsys.readouterr().err


def test_the_longest_sequence_of_each_activation_tier_fits_and_one_step_longer_does_not(
        folder, capsys):
    """The longest sequences are solved from two counts (planning/longest.py); planning at
    them counts the activations anew: at the hbm length they fit beside the plan and its
    margin, a step longer they do not; at the dram length they fit the DRAM tier's room. (In
    this tiny model one layer's recomputation outweighs every checkpoint, so the device's
    share bounds the dram length below the hbm one.)"""
    policy = {"params": {"tier": "dram"}, "grads": {"tier": "dram"},
              "optimizer": {"tier": "dram"}}
    asked = plan(capsys, folder, 512 * MiB, "--checkpointing", policy=policy)
    longest = asked["sequences"]
    assert longest["batch"] == 2 and longest["on_device"] % 256 == 0 < longest["on_device"]

    def hbm_at(seq: int) -> dict:
        planned = plan(capsys, folder, 512 * MiB, "--checkpointing", policy=policy,
                       seq=str(seq))
        return planned, next(room for room in planned["verdict"]["tiers"]
                             if room["tier"] == "hbm")

    _, fitting = hbm_at(longest["on_device"])
    _, longer = hbm_at(longest["on_device"] + 256)
    assert fitting["over"] == 0 and longer["over"] > 0
    at_dram_length, _ = hbm_at(longest["in_dram"])
    dram_room = at_dram_length["budgets"]["dram"] - at_dram_length["needed"]["dram"]
    counted = at_dram_length["batch"]["activations"]
    assert counted <= dram_room and longest["in_dram"] > 0
    assert abs(longest["dram_bytes"] - counted) <= counted // 1000  # the line through two counts
    assert longest["copies_s"] == pytest.approx(2 * counted / 10e9, rel=1e-3)  # 10 GB/s each way
    main(["plan", str(folder / "model"), "--policy", str(folder / "policy.yaml"), "--node",
          str(folder / "node.json"), "--batch", "2", "--seq", "32", "--checkpointing"])
    assert f"longest sequence at batch 2: {longest['on_device']:,} tokens with activations " \
           f"in hbm, {longest['in_dram']:,} in dram" in capsys.readouterr().out


def test_the_longest_sequence_on_nvme_fills_the_dram_room_then_the_drives(folder, capsys):
    """With an NVMe path the activations may fill the DRAM room as a block and the NVMe budget
    as a file: a node of 40 MiB of DRAM holds a shorter sequence in dram than with the drive's 8
    MiB beside it. Planning at the nvme length with that block and file counts the activations
    anew: they fit the two, and the device keeps none of them; the file's step is its bytes
    written and read once at the node's NVMe rates. Without nvme.budget only the device's share
    bounds it, and the line says so."""
    policy = {"params": {"tier": "dram"}, "grads": {"tier": "dram"},
              "optimizer": {"tier": "dram"}, "activations": {"prefetch_bytes": 0},
              "nvme": {"budget": 8 * MiB, "block_size": 4096, "queue_depth": 2}}
    asked = plan(capsys, folder, 40 * MiB, "--checkpointing", "--nvme", str(folder),
                 policy=policy)
    longest = asked["sequences"]
    assert 0 < longest["in_dram"] < longest["on_nvme"] and longest["nvme_budgeted"]
    assert 0 < longest["nvme_bytes"] <= 8 * MiB
    assert longest["nvme_s"] == pytest.approx(2 * longest["nvme_bytes"] / 1e9)  # 1 GB/s each
    slots = 2 * 8192  # two slots of one queue of requests (plan.activation_slots)
    block = asked["budgets"]["dram"] - asked["needed"]["dram"] - slots
    assert longest["nvme_block"] == block
    at_length = plan(capsys, folder, 40 * MiB, "--checkpointing", "--nvme", str(folder),
                     seq=str(longest["on_nvme"]), policy={**policy, "activations": {
                         "tier": "nvme", "dram_bytes": block, "prefetch_bytes": 0,
                         "nvme_bytes": longest["nvme_bytes"]}})
    kept = at_length["batch"]
    assert kept["in_dram"] == block and 0 < kept["on_nvme"] <= longest["nvme_bytes"]
    on_device = kept["activations"] - kept["in_dram"] - kept["on_nvme"]
    assert on_device <= kept["activations"] // 1000  # the line through two counts
    assert at_length["verdict"]["fits"]  # the block in DRAM, the file in the NVMe budget
    unbudgeted = longest_sequences(1, Growth(0, 1000), Growth(0, 10), 1_000_000, 50_000_000,
                                   None, NvmeRoom(None, None, 0))
    assert unbudgeted.on_nvme == 99_840 and unbudgeted.nvme_bytes == 49_840_000  # the device's
    assert "the drive's space not counted without nvme.budget" in unbudgeted.line()


def test_no_longest_sequence_is_said_for_a_cpu_device(folder, capsys):
    assert plan(capsys, folder, 64 * MiB, policy={"device": "cpu"})["sequences"] is None


def test_tiles_take_the_logits_and_mlp_intermediates_out_of_the_planned_activations(
        folder, capsys):
    """--tile plans the model as tile_sequence computes it (tiered.ops.long_sequence): the
    forward keeps neither its MLPs' intermediates nor its logits, so the same batch keeps less
    and a longer sequence fits."""
    untiled = plan(capsys, folder, 512 * MiB, "--checkpointing")
    tiled = plan(capsys, folder, 512 * MiB, "--checkpointing", "--tile", "16")
    tokens, vocab, fp32 = 2 * 32, 256, 4
    assert untiled["batch"]["activations"] - tiled["batch"]["activations"] >= tokens * vocab * fp32
    assert tiled["sequences"]["on_device"] > untiled["sequences"]["on_device"]
    assert main(["plan", str(folder / "model"), "--tile", "16"]) == 2
    assert "--tile changes the activations only" in capsys.readouterr().err


def test_activations_in_dram_are_counted_in_the_block_not_in_hbm(folder, capsys):
    """With ``activations.tier: dram`` the batch's activations fill the DRAM block first (the
    plan's DRAM holds the block) and only the rest is the device's: the HBM tier needs that
    much less, and a larger batch fits."""
    on_device = plan(capsys, folder, 512 * MiB)
    block = on_device["batch"]["activations"] // 2
    in_dram = plan(capsys, folder, 512 * MiB,
                   policy={"activations": {"tier": "dram", "dram_bytes": block}})
    assert in_dram["batch"]["in_dram"] == block
    hbm = {answer["batch"]["in_dram"]: next(room for room in answer["verdict"]["tiers"]
                                            if room["tier"] == "hbm")["needed"]
           for answer in (on_device, in_dram)}
    assert hbm[0] - hbm[block] == block
    assert in_dram["needed"]["dram"] - on_device["needed"]["dram"] >= block
    assert in_dram["batch"]["largest"] > on_device["batch"]["largest"]


def test_activations_tier_auto_is_planned_where_the_engine_keeps_them(folder, capsys):
    """activations.tier: auto: on the device where they fit beside the plan and its margin (as
    the engine keeps them after its first step), else in the block as with dram."""
    on_device = plan(capsys, folder, 512 * MiB)
    kept = on_device["batch"]["activations"]
    fits = plan(capsys, folder, 512 * MiB,
                policy={"activations": {"tier": "auto", "dram_bytes": kept}})
    assert fits["batch"]["in_dram"] == 0
    crowded = plan(capsys, folder, 512 * MiB, "--seq", "2048",
                   policy={"activations": {"tier": "auto", "dram_bytes": kept}})
    assert crowded["batch"]["in_dram"] == kept


@pytest.fixture
def quantizable(folder):
    """An 8-layer Llama whose every linear weight nf4 takes (a whole number of its 64 x 256
    blocks), beside the folder's model."""
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=8, num_attention_heads=4,
                                      num_key_value_heads=4, max_position_embeddings=64)
    config.save_pretrained(folder / "quantizable")
    return folder / "quantizable"


def test_a_lora_base_dram_cannot_hold_is_offered_in_nf4_as_the_flag_plans_it(folder, quantizable,
                                                                             capsys):
    node_file = write(folder / "node.json", dataclasses.asdict(rates(4 * MiB)))

    def planned(*args: str, **policy) -> dict:
        policy_file = write(folder / "policy.yaml", {"compute_dtype": "fp32", **policy})
        assert main(["plan", str(quantizable), "--policy", policy_file, "--node", node_file,
                     "--lora", "4", *args, "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    asked = planned()
    assert not asked["verdict"]["fits"] and asked["verdict"]["over"][0]["tier"] == "dram"
    flag = planned("--frozen-dtype", "nf4")
    assert flag == planned(params={"frozen_dtype": "nf4"})  # the flag sets the policy's key
    assert flag["verdict"]["fits"] and flag["needed"]["dram"] < asked["needed"]["dram"] / 2
    offered = {suggestion["change"]: suggestion for suggestion in asked["verdict"]["suggestions"]}
    nf4 = offered["the frozen base in nf4 (--frozen-dtype nf4)"]
    assert nf4["step_s"] == pytest.approx(max(value for value in flag["terms"].values()
                                              if value is not None))
