"""``compute_dtype: auto``, the shipped default: bf16 where the device computes it natively,
fp32 elsewhere (on an AVX2-only EPYC bf16 ran the README's example 13 times slower), made
concrete once, at initialize, and said in its log line and by ``tiered check-policy``. The CPU's
flags are faked through TIERED_CPUINFO (device/bf16.py)."""
from __future__ import annotations

import logging

import pytest
import torch

import tiered
from tiered.core.errors import TieredError
from tiered.device.bf16 import CPUINFO_ENV, bf16_support
from tiered.launch.cli import main
from tiered.placement.plan import StateKind
from tiered.policy.config import Policy, resolve_compute_dtype
from tiered.policy.kinds import ComputeDtype

from helpers import REPO
from helpers_models import make_model

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
flags\t\t: fpu sse2 avx avx2 fma {extra}
bugs\t\t: sysret_ss_attrs

processor\t: 1
flags\t\t: fpu sse2 avx avx2 fma {extra}
"""


def fake_cpu(monkeypatch, tmp_path, extra: str = "") -> None:
    """This process (and its children) read a CPU with these flags besides AVX2's."""
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO.format(extra=extra))
    monkeypatch.setenv(CPUINFO_ENV, str(path))


@pytest.mark.parametrize("extra, native, why", [
    ("", False, "this CPU has no native bf16: neither avx512_bf16 nor amx_bf16"),
    ("avx512f avx512bw", False, "this CPU has no native bf16: neither avx512_bf16 nor amx_bf16"),
    ("avx512f avx512_bf16", True, "this CPU has avx512_bf16"),
    ("amx_tile amx_bf16", True, "this CPU has amx_bf16"),
], ids=["avx2", "avx512 without bf16", "avx512_bf16", "amx"])
def test_a_cpu_computes_bf16_natively_with_avx512_bf16_or_amx(monkeypatch, tmp_path, extra,
                                                              native, why):
    fake_cpu(monkeypatch, tmp_path, extra)
    support = bf16_support(torch.device("cpu"))
    assert (support.native, support.why) == (native, why)
    policy, said = resolve_compute_dtype(Policy(), torch.device("cpu"))
    chosen = ComputeDtype.BF16 if native else ComputeDtype.FP32
    assert policy == Policy(compute_dtype=chosen)
    assert said == f"{chosen.value} (auto: {why})"


def test_a_cpu_whose_flags_cannot_be_read_computes_in_fp32(monkeypatch, tmp_path):
    monkeypatch.setenv(CPUINFO_ENV, str(tmp_path / "absent"))
    policy, said = resolve_compute_dtype(Policy(), torch.device("cpu"))
    assert policy.compute_dtype is ComputeDtype.FP32
    assert said == "fp32 (auto: this CPU's flags cannot be read, so no native bf16 is assumed)"


def test_a_dtype_the_policy_names_is_kept_and_auto_asks_the_ranks_to_agree(monkeypatch,
                                                                            tmp_path):
    fake_cpu(monkeypatch, tmp_path, "avx512_bf16")
    asked = []

    def agree(ok: bool) -> bool:
        asked.append(ok)
        return False  # another rank's CPU lacks it
    for named in (ComputeDtype.BF16, ComputeDtype.FP16, ComputeDtype.FP32):
        policy = Policy(compute_dtype=named)
        assert resolve_compute_dtype(policy, torch.device("cpu"), agree) == (
            policy, f"{named.value} (the policy's)")
    assert asked == []  # a collective only under auto, where every rank calls it
    policy, said = resolve_compute_dtype(Policy(), torch.device("cpu"), agree)
    assert asked == [True] and policy.compute_dtype is ComputeDtype.FP32
    assert said == "fp32 (auto: another rank's device has no native bf16)"


def test_auto_is_the_default_of_code_and_of_every_shipped_policy_and_has_no_torch_dtype():
    assert Policy().compute_dtype is ComputeDtype.AUTO
    for name in ("cpu", "gpu", "nvme", "auto"):
        data = Policy.from_yaml(REPO / "configs" / f"{name}.yaml", {"nvme": {"path": "/x"}})
        assert data.compute_dtype is ComputeDtype.AUTO, name
    with pytest.raises(TieredError, match="no torch dtype until resolve_compute_dtype"):
        ComputeDtype.AUTO.torch_dtype


@pytest.mark.parametrize("extra, dtype", [("", torch.float32), ("avx512_bf16", torch.bfloat16)])
def test_initialize_resolves_auto_once_and_says_so(monkeypatch, tmp_path, caplog, extra, dtype):
    fake_cpu(monkeypatch, tmp_path, extra)
    with caplog.at_level(logging.INFO, logger="tiered"):
        engine, _ = tiered.initialize(make_model(), device="cpu")
    try:
        assert engine.policy.compute_dtype.torch_dtype is dtype  # what everything downstream sees
        assert engine.manager.shards[(0, StateKind.PARAM)].dtype is dtype
    finally:
        engine.close()
    said = next(r.getMessage() for r in caplog.records if "tiered: device" in r.getMessage())
    why = ("fp32 (auto: this CPU has no native bf16" if dtype is torch.float32
           else "bf16 (auto: this CPU has avx512_bf16)")
    assert said.startswith(f"tiered: device cpu (cpu), compute dtype {why}")


def test_check_policy_shows_auto_and_what_it_is_here(monkeypatch, tmp_path, capsys):
    fake_cpu(monkeypatch, tmp_path)
    assert main(["check-policy", str(REPO / "configs" / "cpu.yaml")]) == 0
    out = capsys.readouterr().out
    assert "# compute_dtype on this machine: fp32 (auto: this CPU has no native bf16" in out
    assert "\ncompute_dtype: auto\n" in out
    named = tmp_path / "bf16.yaml"
    named.write_text("compute_dtype: bf16\n")
    assert main(["check-policy", str(named)]) == 0
    out = capsys.readouterr().out
    assert "compute_dtype on this machine" not in out and "\ncompute_dtype: bf16\n" in out
