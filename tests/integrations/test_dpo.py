"""trl's DPOTrainer through TieredTrainerMixin: the policy and its frozen reference model each in
an engine of its own train as plain DPOTrainer does (the same losses, rewards and weights), in
one process and under tiered-launch, where the node's service holds the two engines of the
process as two jobs; what the engines cannot give a reference is refused by name.

The launch, mostly its processes' starts (importing torch, transformers, trl and tiered), runs
beside the tests in this process (``launched``)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from helpers import CONFIGS, REPO, clean_env, finish
from helpers_hf import (STEPS, assert_close_states, dpo_arguments, llama, lora, preferences,
                        step_logs)

trl = pytest.importorskip("trl")
pytest.importorskip("datasets")

import tiered  # noqa: E402
from tiered.integrations.transformers import TieredTrainerMixin  # noqa: E402

from finetune_hf import char_tokenizer  # noqa: E402  (examples/)

CPU = {"device": "cpu"}
DPO_METRICS = ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected")
"""What DPOTrainer logs besides the loss: a reward is beta times the policy's log-probability
less the reference's, so a reference computed wrongly shows here first."""


class TieredDPOTrainer(TieredTrainerMixin, trl.DPOTrainer):
    pass


LAUNCHED = "test_under_the_launcher_the_service_holds_the_two_engines_as_two_jobs"


@pytest.fixture(scope="module", autouse=True)
def launched(request, tmp_path_factory):
    """Where that test is selected, its launch, started as this module's first test starts and
    waited for in a thread (as the test waited, with its timeout of 180 s): its folder and its
    future (CompletedProcess)."""
    if not any(getattr(item, "module", None) is request.module and item.name == LAUNCHED
               for item in request.session.items):
        yield None
        return
    out = tmp_path_factory.mktemp("dpo-launch") / "out"
    out.mkdir()
    process = subprocess.Popen(
        [sys.executable, "-m", "tiered.launch.launcher", "--policy", str(CONFIGS / "cpu.yaml"),
         "--job", "dpo", str(REPO / "tests" / "scripts" / "hf_dpo.py"), str(out)],
        cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with ThreadPoolExecutor(max_workers=1) as pool:  # (its exit waits for the run)
        yield out, pool.submit(finish, process, 180)


def train_plain(model, args, **kwargs):
    """Plain DPOTrainer's final policy weights and its per-step logs."""
    trainer = trl.DPOTrainer(model=model, args=args, train_dataset=preferences(),
                             processing_class=char_tokenizer(), **kwargs)
    trainer.train()
    return ({name: value.detach().clone() for name, value in model.state_dict().items()},
            step_logs(trainer))


def assert_same_logs(logs, expected_logs):
    assert len(logs) == len(expected_logs) == STEPS
    for ours, theirs in zip(logs, expected_logs):
        assert ours["learning_rate"] == theirs["learning_rate"]
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-6)
        assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)
        for key in DPO_METRICS:
            assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("precomputed", [False, True])
def test_dpo_trains_as_plain_dpo(tmp_path, precomputed):
    """The reference model in an engine of its own, frozen: it holds its fp32 weights alone
    (under a quarter of what the policy's engine holds: weights, gradients and two moments) and
    ends as it started. Precomputed: no reference model; the policy's own log-probabilities,
    taken before training, are the reference's."""
    def reference():
        return {} if precomputed else {"ref_model": llama()}

    args = dict(precompute_ref_log_probs=precomputed)
    expected, expected_logs = train_plain(llama(), dpo_arguments(tmp_path / "plain", **args),
                                          **reference())
    trainer = TieredDPOTrainer(model=llama(), args=dpo_arguments(tmp_path / "tiered", **args),
                               train_dataset=preferences(), processing_class=char_tokenizer(),
                               policy=CPU, **reference())
    trainer.train()
    got = trainer.engine.full_state_dict()
    logs = step_logs(trainer)
    policy_held = trainer.engine.memory_report()["dram"]["current"]
    trainer.engine.close()
    assert_close_states(got, expected)
    assert_same_logs(logs, expected_logs)
    if precomputed:
        assert trainer.ref_engine is None
        return
    ref = trainer.ref_engine
    assert ref.num_parameters(trainable_only=True) == 0
    held = ref.memory_report()["dram"]["current"]
    assert 4 * ref.num_parameters() <= held < policy_held / 4
    untouched = ref.full_state_dict()
    ref.close()
    for name, value in llama().state_dict().items():
        assert torch.equal(untouched[name], value), name


def test_a_lora_policy_against_its_base_model_trains_as_plain_dpo(tmp_path):
    """trl's own reference for a peft model (its adapters switched, to a copy it adds or off)
    is refused (below); the base model given as the reference, in an engine of its own, gives
    the reference a fresh adapter would."""
    expected, expected_logs = train_plain(lora(llama()), dpo_arguments(tmp_path / "plain"),
                                          ref_model=llama())
    trainer = TieredDPOTrainer(model=lora(llama()), ref_model=llama(),
                               args=dpo_arguments(tmp_path / "tiered"),
                               train_dataset=preferences(), processing_class=char_tokenizer(),
                               policy=CPU)
    trainer.train()
    got = trainer.engine.full_state_dict()
    logs = step_logs(trainer)
    trainer.engine.close()
    trainer.ref_engine.close()
    assert_close_states(got, expected)
    assert_same_logs(logs, expected_logs)


@pytest.mark.parametrize("given, message", [
    (dict(sync_ref_model=True), "sync_ref_model=True"),
    (dict(peft=True, reference=False), "ref_model=None with a peft model: .* switching"),
    (dict(reference=False), "ref_model=None: trl would load a plain copy"),
    (dict(engine=True), "ref_model=<engine>"),
])
def test_what_the_engines_cannot_give_a_reference_is_refused_by_name(tmp_path, given, message):
    """Refused before an engine takes either model: their weights are still readable (an
    engine's placeholders raise on use), the reference not frozen."""
    model = lora(llama()) if given.get("peft") else llama()
    reference = llama() if given.get("reference", True) else None
    engine = tiered.initialize(reference, CPU)[0] if given.get("engine") else None
    args = dpo_arguments(tmp_path, sync_ref_model=given.get("sync_ref_model", False))
    try:
        with pytest.raises(tiered.TieredError, match="cannot honour") as refused:
            TieredDPOTrainer(model=model, ref_model=engine or reference, args=args,
                             train_dataset=preferences(), processing_class=char_tokenizer(),
                             policy=CPU)
    finally:
        if engine is not None:
            engine.close()
    assert re.search(message, str(refused.value)), refused.value
    assert all(torch.isfinite(p).all() for p in model.parameters())
    if reference is not None and engine is None:
        assert all(p.requires_grad and torch.isfinite(p).all() for p in reference.parameters())


def test_under_the_launcher_the_service_holds_the_two_engines_as_two_jobs(tmp_path, launched):
    """One rank of tiered-launch (configs/cpu.yaml, fp32 from the arguments): the policy's and
    the reference's engines are jobs ``dpo`` and ``dpo#1`` at the node's service, and train as
    plain DPOTrainer in one process does."""
    out, run = launched
    run = run.result()
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads((out / "run.json").read_text())
    assert seen["jobs"] == ["dpo", "dpo#1"]
    expected, expected_logs = train_plain(llama(), dpo_arguments(tmp_path / "plain"),
                                          ref_model=llama())
    assert_close_states(torch.load(out / "state.pt"), expected)
    assert_same_logs(seen["logs"], expected_logs)
