"""Policies a user's bad day brings (issue 17, items 10, 11, 12 and 16): ``~`` in an NVMe path,
budgets larger than this rank's share of the node, negative and exponent-notation sizes, a
read-only file system, and a machine without a GPU, where the "HBM" tier is the same RAM as
the DRAM tier. ``tiered check-policy`` runs as a real subprocess; the read-only file system is
a real read-only tmpfs (as root; skipped otherwise)."""
from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
import yaml
from torch import nn

import tiered
from tiered.core.sizes import format_size, parse_size
from tiered.launch.launcher import policy_from_args
from tiered.policy.config import POLICY_ENV, Policy

from helpers import REPO, mounted

CONFIGS = REPO / "configs"


def start_check_policy(*args: str, home: Path | None = None) -> subprocess.Popen:
    """``tiered check-policy args`` started (several run side by side: each imports torch)."""
    env = {k: v for k, v in os.environ.items() if k != POLICY_ENV}
    env["CUDA_VISIBLE_DEVICES"] = ""  # no GPU, whatever this machine has
    if home is not None:
        env["HOME"] = str(home)
    return subprocess.Popen([sys.executable, "-m", "tiered.launch.cli", "check-policy", *args],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def finish(process: subprocess.Popen) -> subprocess.CompletedProcess:
    out, err = process.communicate(timeout=120)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def check_policy(*args: str) -> subprocess.CompletedProcess:
    return finish(start_check_policy(*args))


# -- item 10: ~ in nvme.path ----------------------------------------------------------------------

def test_a_tilde_in_the_nvme_path_is_the_home_folder_from_yaml_overrides_and_the_command(
        tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / "ssd").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    policy_file = tmp_path / "nvme.yaml"
    policy_file.write_text("params: {tier: nvme}\nnvme: {path: ~/ssd}\n")
    commands = [start_check_policy(*args, home=home)
                for args in ([str(policy_file)], [str(CONFIGS / "nvme.yaml"), "--nvme", "~/ssd"])]
    assert Policy.from_yaml(policy_file).nvme.path == str(home / "ssd")
    assert Policy.from_yaml(CONFIGS / "nvme.yaml",
                            {"nvme": {"path": "~/ssd"}}).nvme.path == str(home / "ssd")
    # tiered-launch --nvme "~/ssd" (quoted, so no shell expanded it), read as the launcher does
    assert policy_from_args(str(CONFIGS / "nvme.yaml"), "~/ssd").nvme.path == str(home / "ssd")
    # The engine makes its run folder there (not in a folder named "~" of the working one).
    engine, _ = tiered.initialize(nn.Linear(4, 4), str(policy_file), device="cpu")
    try:
        assert os.path.dirname(engine.manager.nvme.run_dir) == str(home / "ssd")
    finally:
        engine.close()
    for command in commands:
        result = finish(command)
        assert result.returncode == 0, result.stderr
        assert yaml.safe_load(result.stdout)["nvme"]["path"] == str(home / "ssd")
    assert not (REPO / "~").exists()


# -- item 11: budgets past this rank's share of the node ----------------------------------------

@pytest.mark.parametrize("tier, budget", [("dram", "100TiB"), ("nvme", 10**32)])
def test_a_budget_larger_than_this_ranks_share_is_refused_naming_it(tmp_path, tier, budget):
    # As the README says: 100 TiB of DRAM and 10**32 bytes of NVMe were accepted and trained
    # on; past the memory the OOM killer ends a run without a word, past the free space an
    # extent's fallocate fails midway.
    overrides = {"nvme": {"path": str(tmp_path)}}
    overrides[tier] = {**overrides.get(tier, {}), "budget": budget}
    with pytest.raises(tiered.BudgetError) as info:
        tiered.initialize(nn.Linear(8, 8), str(CONFIGS / "nvme.yaml"), device="cpu",
                          **overrides)
    message = str(info.value)
    assert "\n" not in message, message
    assert f"{tier}.budget {format_size(parse_size(budget))} is more than this rank may use, " \
        in message, message
    given, share = info.value.shortfalls[tier]
    machine = (psutil.virtual_memory().total if tier == "dram"
               else os.statvfs(tmp_path).f_blocks * os.statvfs(tmp_path).f_frsize)
    assert given == parse_size(budget) and 0 < share <= machine
    assert f"{format_size(share)} (" in message
    assert ("memory" if tier == "dram" else "free space") in message, message
    assert os.listdir(tmp_path) == []  # refused before any extent; its run folder is gone


# -- item 12: sizes and a read-only file system -------------------------------------------------

def test_a_negative_size_is_said_to_be_negative_and_1e9_is_a_billion_bytes(tmp_path):
    with pytest.raises(tiered.PolicyError, match=r"dram\.budget: a byte size must not be "
                                                 r"negative, got '-5GiB'"):
        Policy.from_dict({"dram": {"budget": "-5GiB"}})
    with pytest.raises(tiered.PolicyError, match="must not be negative"):
        Policy.from_dict({"hbm": {"budget": -4096}})
    # PyYAML reads 1e9 as the string "1e9" (YAML 1.1 wants a dot); YAML 1.2 and JSON read a
    # number, and code may pass 1e9: all of them are the same billion bytes.
    policy_file = tmp_path / "p.yaml"
    policy_file.write_text("dram: {budget: 1e9}\nhbm: {budget: 2.5E9}\n")
    assert isinstance(yaml.safe_load(policy_file.read_text())["dram"]["budget"], str)
    policy = Policy.from_yaml(policy_file)
    assert (policy.dram.budget, policy.hbm.budget) == (10**9, 2_500_000_000)
    assert Policy.from_dict({"dram": {"budget": 1e9}}).dram.budget == 10**9
    with pytest.raises(tiered.PolicyError, match="whole number of bytes"):
        Policy.from_dict({"dram": {"budget": "1e-3"}})


def test_a_read_only_file_system_is_said_to_be_read_only(tmp_path):
    with mounted(tmp_path, "tmpfs", "ro,size=1m") as root:
        with pytest.raises(tiered.NvmeError) as info:
            tiered.initialize(nn.Linear(4, 4), str(CONFIGS / "nvme.yaml"), device="cpu",
                              nvme={"path": root})
        assert info.value.errno == errno.EROFS
        assert str(info.value) == (f"NVMe path {root} is on a read-only file system; pass a "
                                   f"folder on a writable one")
        result = check_policy(str(CONFIGS / "nvme.yaml"), "--nvme", root)
        assert result.returncode == 2 and "read-only file system" in result.stderr


# -- item 16: a machine without a GPU -----------------------------------------------------------

def test_check_policy_says_the_device_and_what_a_rank_may_hold_on_a_machine_without_a_gpu(
        tmp_path):
    policy_file = tmp_path / "big.yaml"
    policy_file.write_text("device: cuda\nhbm: {budget: 64GiB}\ndram: {budget: 100TiB}\n")
    gpu, big = start_check_policy(str(CONFIGS / "gpu.yaml")), start_check_policy(str(policy_file))
    result = finish(gpu)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    comments = [line for line in result.stdout.splitlines() if line.startswith("#")]
    assert comments[0].startswith("# device on this machine: cpu (torch sees no CUDA device)")
    assert "hbm tier and the dram tier share it" in comments[0]
    assert "of RAM in hbm and dram together" in comments[1]
    assert yaml.safe_load(result.stdout) == Policy.from_yaml(CONFIGS / "gpu.yaml").to_dict()
    # Budgets this machine cannot hold are said before a run would be refused for them.
    result = finish(big)
    assert result.returncode == 0, result.stderr
    warnings = result.stderr.splitlines()
    assert warnings[0] == ("tiered: warning: device is cuda but torch sees no CUDA device here: "
                           "initialize refuses this policy on this machine")
    assert any(line.startswith("tiered: warning: dram.budget 100.00 TiB is more than this rank "
                               "may use, ") for line in warnings), warnings


def test_on_the_cpu_device_hbm_and_dram_budgets_split_the_ram_instead_of_counting_it_twice():
    engine, _ = tiered.initialize(nn.Linear(64, 64), str(CONFIGS / "gpu.yaml"), device="cpu")
    try:
        report = engine.memory_report()
    finally:
        engine.close()
    ram = psutil.virtual_memory().total
    assert report["hbm"]["budget"] + report["dram"]["budget"] <= ram, report
    assert report["hbm"]["peak"] <= report["hbm"]["budget"]


BOTH_PAST_THE_RAM = textwrap.dedent("""
    import resource, sys
    import psutil
    import torch
    from torch import nn
    import tiered
    # Safety for the code before the fix, which accepted this plan: past this limit an
    # allocation fails in this process instead of the machine swapping or killing others.
    soft = psutil.Process().memory_info().vms + (1 << 30)
    resource.setrlimit(resource.RLIMIT_AS, (soft, soft))
    ram = tiered.tiers.dram.default_budget(1)
    side = int((ram / 18 / 64) ** 0.5)
    # fp32 weights in "HBM" (4 bytes a parameter and the working set) and AdamW in DRAM (16):
    # each fits the RAM alone, the two together do not.
    with tiered.init(device="cpu"):
        model = nn.Sequential(*(nn.Linear(side, side, bias=False) for _ in range(64)))
    try:
        tiered.initialize(model, device="cpu", compute_dtype="fp32", params={"tier": "hbm"},
                          prefetch={"enabled": False})
    except tiered.BudgetError as error:
        print("REFUSED", sorted(error.shortfalls), error)
    except BaseException as error:
        print("FAILED", type(error).__name__, error)
    else:
        print("ACCEPTED")
""")


def test_on_the_cpu_device_a_plan_whose_hbm_and_dram_together_pass_the_ram_is_refused():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "examples")]))
    env.pop(POLICY_ENV, None)
    result = subprocess.run([sys.executable, "-c", BOTH_PAST_THE_RAM], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("REFUSED ['dram', 'hbm'] on the CPU device the hbm and dram "
                                    "tiers are the same RAM"), result.stdout
    assert "this rank may use" in result.stdout and "memory" in result.stdout
