"""TieredTrainer against plain Hugging Face Trainer: the same tiny Llama, data and
TrainingArguments give the same weights and logs; resume is exact; exports load with
from_pretrained; load_model reads a folder straight into the tiers; what the engine cannot
honour is refused by name."""
from __future__ import annotations

import copy
import os

import pytest
import torch

from helpers import assert_same, left_behind
from helpers_hf import (STEPS, arguments, assert_close_states, config, dataset, llama, lora,
                        step_logs, train_plain)
from helpers_tiers import activations_on_nvme

transformers = pytest.importorskip("transformers")

import tiered  # noqa: E402
from tiered.integrations.transformers import TieredTrainer, TieredTrainerMixin, load_model  # noqa: E402

from finetune_hf import char_tokenizer, library_text, token_rows  # noqa: E402  (examples/)

CPU = {"device": "cpu"}


def tiered_run(model, args, data, policy=CPU, **kwargs):
    trainer = TieredTrainer(model=model, args=args, train_dataset=data, policy=policy, **kwargs)
    trainer.train()
    return trainer


@pytest.mark.parametrize("max_grad_norm", [1.0, 0.0])  # 0: Trainer logs the norm, never clips
def test_trains_as_plain_trainer_and_logs_the_same(tmp_path, max_grad_norm):
    data = dataset()
    expected, expected_logs = train_plain(
        llama(), arguments(tmp_path / "plain", max_grad_norm=max_grad_norm), data)
    trainer = tiered_run(llama(), arguments(tmp_path / "tiered", max_grad_norm=max_grad_norm),
                         data)
    got = trainer.engine.full_state_dict()
    logs = step_logs(trainer)
    trainer.engine.close()
    assert_close_states(got, expected)
    assert not torch.equal(got["lm_head.weight"], llama().state_dict()["lm_head.weight"])
    assert len(logs) == len(expected_logs) == STEPS
    for ours, theirs in zip(logs, expected_logs):
        assert ours["learning_rate"] == theirs["learning_rate"]
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-6)
        assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)


@pytest.mark.parametrize("schedule", ["linear", "constant_with_warmup", "polynomial",
                                      "cosine_with_restarts"])
def test_every_schedule_drives_the_engines_learning_rate(tmp_path, schedule):
    """The scheduler Trainer makes steps the engine's param groups: the same learning rates
    logged, and the same weights (3 steps, 1 of warm-up)."""
    data = dataset(rows=12)
    args = dict(lr_scheduler_type=schedule, max_steps=3, warmup_steps=1)
    expected, expected_logs = train_plain(llama(), arguments(tmp_path / "plain", **args), data)
    trainer = tiered_run(llama(), arguments(tmp_path / "tiered", **args), data)
    got = trainer.engine.full_state_dict()
    logs = step_logs(trainer)
    trainer.engine.close()
    assert [log["learning_rate"] for log in logs] == [
        log["learning_rate"] for log in expected_logs]
    assert_close_states(got, expected)


def test_load_model_passes_the_from_config_arguments_through(tmp_path):
    """dtype and attn_implementation reach the model's construction; an export keeps the
    dtype the model was given."""
    llama().save_pretrained(tmp_path / "base")
    model = load_model(str(tmp_path / "base"), policy=CPU, dtype=torch.bfloat16,
                       attn_implementation="eager")
    assert model.config._attn_implementation == "eager"
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    trainer = TieredTrainer(model=model, args=arguments(tmp_path / "run", bf16=True))
    trainer.save_model(str(tmp_path / "export"))
    trainer.engine.close()
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "export")
    assert loaded.config.dtype == torch.bfloat16


@pytest.mark.parametrize("activations, model", [("hbm", llama), ("dram", llama),
                                               ("dram", lambda: lora(llama())),
                                               ("nvme", lambda: lora(llama()))],
                         ids=["hbm", "dram", "dram-peft-lora", "nvme-peft-lora"])
def test_gradient_checkpointing_trains_as_plain_trainer(tmp_path, activations, model):
    """Hugging Face layers checkpoint their forward inside their call: the recomputation in
    backward runs no unit hook (see [Note: checkpointing inside the hooks]). With the
    activations in DRAM, the checkpointed inputs wait there (issue 34), peft's adapters over
    the model or not; on NVMe, past a DRAM block of one of them, the rest wait on the drive,
    and training is bit for bit what it is with them on the device."""
    data = dataset()
    args = dict(gradient_checkpointing=True, max_steps=3)
    expected, _ = train_plain(model(), arguments(tmp_path / "plain", **args), data)
    policy = dict(CPU, activations={"tier": activations, "dram_bytes": "16MiB", "min_bytes": 0})
    if activations == "nvme":
        (tmp_path / "nvme").mkdir()
        policy = dict(CPU, **activations_on_nvme(tmp_path / "nvme", "8KiB"))
    trainer = tiered_run(model(), arguments(tmp_path / "tiered", **args), data, policy)
    got = trainer.engine.full_state_dict()
    store = trainer.engine.runtime.activations
    offloaded, spill = store.offloaded_bytes, store.spill
    trainer.engine.close()
    assert_close_states(got, expected)
    assert (offloaded > 0) == (activations != "hbm")
    if activations == "nvme":
        assert spill is not None and spill.written_bytes > 0
        on_device = tiered_run(model(), arguments(tmp_path / "on_device", **args), data)
        assert_same(got, on_device.engine.full_state_dict(), "activations on NVMe")
        on_device.engine.close()
        assert left_behind(tmp_path / "nvme") == []


def test_no_decay_set_and_hyperparameters_follow_the_arguments(tmp_path):
    args = arguments(tmp_path, adam_beta1=0.8, adam_beta2=0.9, max_grad_norm=0.0)
    trainer = TieredTrainer(model=llama(), args=args, policy=CPU)
    optimizer = trainer.optimizer
    assert optimizer.max_grad_norm == float("inf")  # no clipping, but the norm is logged
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    assert all(g["betas"] == (0.8, 0.9) and g["eps"] == 1e-6 for g in optimizer.param_groups)
    no_decay = trainer.engine.policy.optimizer.param_groups[0].match
    assert sorted(no_decay) == ["model.layers.0.input_layernorm.weight",
                                "model.layers.0.post_attention_layernorm.weight",
                                "model.layers.1.input_layernorm.weight",
                                "model.layers.1.post_attention_layernorm.weight",
                                "model.norm.weight"]
    assert trainer.engine.num_parameters() == sum(p.numel() for p in llama().parameters())
    trainer.engine.close()


def test_resume_from_checkpoint_is_exact(tmp_path):
    """Stopped after step 3 with a checkpoint at 2 (the one save_total_limit keeps), then
    resumed: step 6's weights equal an uninterrupted run's, bit for bit."""
    data = dataset()

    class StopAt3(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 3

    def run(folder, resume=None, stop=False):
        args = arguments(folder, save_strategy="steps", save_steps=2, save_total_limit=1)
        trainer = TieredTrainer(model=llama(), args=args, train_dataset=data, policy=CPU,
                                callbacks=[StopAt3()] if stop else None)
        trainer.train(resume_from_checkpoint=resume)
        state = trainer.engine.full_state_dict()
        trainer.engine.close()
        return state, trainer

    uninterrupted, _ = run(tmp_path / "whole")
    run(tmp_path / "parts", stop=True)
    assert sorted(os.listdir(tmp_path / "parts")) == ["checkpoint-2"]
    resumed, trainer = run(tmp_path / "parts", resume=True)
    assert trainer.state.global_step == STEPS
    for name, value in uninterrupted.items():
        assert torch.equal(resumed[name], value), name


def test_resume_refuses_a_folder_without_the_engines_checkpoint(tmp_path):
    plain = transformers.Trainer(model=llama(), args=arguments(
        tmp_path, save_strategy="steps", save_steps=1, max_steps=1), train_dataset=dataset())
    plain.train()
    trainer = TieredTrainer(model=llama(), args=arguments(tmp_path), train_dataset=dataset(),
                            policy=CPU)
    with pytest.raises(tiered.TieredError, match=r"checkpoint-1: no tiered/ folder.*load_model"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    trainer.engine.close()


def test_save_model_loads_with_from_pretrained(tmp_path):
    data = dataset()
    trainer = tiered_run(llama(), arguments(tmp_path), data)
    trainer.save_model(str(tmp_path / "export"))
    batch = torch.stack([row["input_ids"] for row in data[:2]])
    with torch.no_grad():
        logits = trainer.engine(input_ids=batch).logits
    trained = trainer.engine.full_state_dict()
    trainer.engine.close()
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "export")
    assert loaded.config.hidden_size == 32 and loaded.config.num_hidden_layers == 2
    assert os.path.isfile(tmp_path / "export" / "generation_config.json")
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, trained[name]), name
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=batch).logits, logits)


def test_evaluate_and_predict_touch_no_state(tmp_path):
    data = dataset()
    plain = transformers.Trainer(model=llama(), args=arguments(tmp_path / "plain"))
    expected = plain.evaluate(eval_dataset=data[:6])["eval_loss"]
    trainer = tiered_run(llama(), arguments(tmp_path / "tiered", max_steps=2), data)
    before, steps = trainer.engine.full_state_dict(), trainer.optimizer.steps_taken
    trainer.predict(data[:4])
    trainer.evaluate(eval_dataset=data[:6])
    after = trainer.engine.full_state_dict()
    assert trainer.optimizer.steps_taken == steps
    assert all(torch.equal(after[name], value) for name, value in before.items())
    trainer.engine.close()
    fresh = TieredTrainer(model=llama(), args=arguments(tmp_path / "fresh"), policy=CPU)
    assert fresh.evaluate(eval_dataset=data[:6])["eval_loss"] == pytest.approx(expected,
                                                                               rel=1e-6)
    fresh.engine.close()


def test_load_model_reads_the_folder_when_training_starts(tmp_path):
    """Built with nothing allocated; its weights come from the folder, never initialized, and
    training matches plain Trainer on ``from_pretrained`` of the same folder."""
    llama(tie_word_embeddings=True).save_pretrained(tmp_path / "base")
    model = load_model(str(tmp_path / "base"), policy=CPU)
    assert all(p.is_meta for p in model.parameters())
    data = dataset()
    trainer = tiered_run(model, arguments(tmp_path / "tiered"), data)
    got = trainer.engine.full_state_dict()
    trainer.engine.close()
    plain = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "base")
    expected, _ = train_plain(plain, arguments(tmp_path / "plain"), data)
    assert_close_states(got, expected)


def test_generate_and_peft_counting_work_on_a_tiered_model(tmp_path):
    """``model.parameters()`` holds the placeholders: ``generate`` finds the device (greedy
    tokens equal the eager model's, also through a peft model), peft counts the trainable
    parameters."""
    prompt = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        expected = llama().generate(prompt, max_new_tokens=6, do_sample=False)
    trainer = TieredTrainer(model=llama(), args=arguments(tmp_path), policy=CPU)
    with torch.no_grad():
        assert torch.equal(trainer.model.generate(prompt, max_new_tokens=6, do_sample=False),
                           expected)
    trainer.engine.close()
    trainer = TieredTrainer(model=lora(llama()), args=arguments(tmp_path), policy=CPU)
    trainable, total = trainer.model.get_nb_trainable_parameters()
    assert (trainable, total) == (896, sum(p.numel() for p in llama().parameters()) + 896)
    with torch.no_grad():  # through the wrapped model (see [Note: entering the model below
        # its root]); lora_B is zero, so the base model's tokens
        assert torch.equal(trainer.model.generate(input_ids=prompt, max_new_tokens=6,
                                                  do_sample=False), expected)
    trainer.engine.close()


def test_load_model_needs_a_config(tmp_path):
    with pytest.raises(tiered.TieredError, match="no config.json"):
        load_model(str(tmp_path))


def test_a_model_built_under_init_takes_its_own_initialization(tmp_path):
    """transformers models initialize in _init_weights, not reset_parameters (RMSNorm has
    none): under tiered.init that is what initialize runs, so the norms are ones and the
    linear layers draw from the config's initializer_range, as eagerly. Its export carries
    its config: from_pretrained builds the same model (not the class's default size)."""
    with tiered.init(CPU, compute_dtype="fp32"):
        model = transformers.LlamaForCausalLM(config())
    engine, _ = tiered.initialize(model)
    state = engine.full_state_dict()
    engine.save_pretrained(str(tmp_path))
    engine.close()
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.to_diff_dict() == config().to_diff_dict() | {"dtype": "float32"}
    assert all(torch.equal(value, state[name]) for name, value in loaded.state_dict().items())
    eager = llama().state_dict()
    assert state.keys() == eager.keys()
    for name, value in state.items():
        if "norm" in name:
            assert torch.equal(value, torch.ones_like(value)), name
        else:
            assert value.std().item() == pytest.approx(0.02, rel=0.3), name
            assert abs(value.mean().item()) < 0.01, name


def test_fp16_scales_through_the_engine_and_a_skipped_step_holds_the_schedule(tmp_path):
    """fp16: accelerate's backward scales the loss by the engine's loss scale. An initial scale
    of 2**40 overflows fp16 gradients: those steps are skipped, the scale halved each time, and
    the scheduler is not stepped for them, as Trainer does with a GradScaler; then it trains."""
    policy = dict(CPU, loss_scale={"initial_scale": 2.0 ** 40})
    trainer = TieredTrainer(model=llama(), args=arguments(tmp_path, fp16=True, max_steps=40,
                                                          learning_rate=3e-3),
                            train_dataset=token_rows(char_tokenizer(), 160, 32),
                            policy=policy)
    trainer.train()
    skipped = trainer.optimizer.skipped_steps
    losses = [log["loss"] for log in step_logs(trainer)]
    assert trainer.engine.policy.compute_dtype.value == "fp16"
    assert 10 <= skipped < 40  # 2**40 down to the largest scale fp16 gradients fit
    assert trainer.engine.scaler.scale <= 2.0 ** (40 - skipped)
    assert trainer.lr_scheduler.last_epoch == 40 - skipped
    assert losses[-1] < losses[0]
    trainer.engine.close()


@pytest.mark.parametrize("given, message", [
    (dict(optim="adafactor"), "optim='adafactor'"),
    (dict(optim="adamw_torch", optim_args="foo=1"), "optim_args='foo=1'"),
    (dict(torch_compile=True), "torch_compile=True"),
    (dict(auto_find_batch_size=True), "auto_find_batch_size=True"),
    (dict(fsdp=True), "fsdp=True"),
    (dict(label_smoothing_factor=0.1), "label_smoothing_factor=0.1"),
    (dict(bf16_full_eval=True), "bf16_full_eval=True"),
])
def test_arguments_it_cannot_honour_are_refused_by_name(tmp_path, given, message):
    model = llama()
    with pytest.raises(tiered.TieredError, match="cannot honour") as refused:
        TieredTrainer(model=model, args=arguments(tmp_path, **given), policy=CPU)
    assert message in str(refused.value)
    assert len(list(model.parameters())) > 0  # refused before the engine took the model


def test_trainer_arguments_it_cannot_honour_are_refused(tmp_path):
    model = llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(tiered.TieredError, match="optimizers=..."):
        TieredTrainer(model=model, args=arguments(tmp_path), optimizers=(optimizer, None))
    with pytest.raises(tiered.TieredError, match="peft_config=...: .*get_peft_model"):
        TieredTrainer(model=model, args=arguments(tmp_path), peft_config=object())
    with pytest.raises(tiered.TieredError, match="a model object, not str 'meta-llama/x'"):
        TieredTrainer(model="meta-llama/x", args=arguments(tmp_path))
    with pytest.raises(tiered.TieredError, match="takes the model, not an engine"):
        engine, _ = tiered.initialize(copy.deepcopy(model), CPU)
        try:
            TieredTrainer(model=engine, args=arguments(tmp_path))
        finally:
            engine.close()


# -- peft ------------------------------------------------------------------------------------------

def test_lora_trains_as_plain_peft_and_saves_an_adapter_peft_loads(tmp_path):
    from peft import PeftModel

    data = dataset()
    expected, expected_logs = train_plain(lora(llama()), arguments(tmp_path / "plain"), data)
    trainer = tiered_run(lora(llama()), arguments(tmp_path / "tiered"), data)
    # per layer: q_proj's A (4x32) and B (32x4), v_proj's A (4x32) and B (16x4)
    assert trainer.engine.num_parameters(trainable_only=True) == 2 * (128 + 128 + 128 + 64)
    got = trainer.engine.full_state_dict()
    assert_close_states(got, expected)
    assert [log["loss"] for log in step_logs(trainer)] == pytest.approx(
        [log["loss"] for log in expected_logs], rel=1e-6)
    trainer.save_model(str(tmp_path / "adapter"))
    batch = torch.stack([row["input_ids"] for row in data[:2]])
    with torch.no_grad():
        logits = trainer.engine(input_ids=batch).logits
    trainer.engine.close(restore_weights=True)  # the trained model, a plain one again
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(
        os.listdir(tmp_path / "adapter"))
    loaded = PeftModel.from_pretrained(llama(), tmp_path / "adapter")
    with torch.no_grad():
        for merged in (loaded.merge_and_unload(), trainer.model.merge_and_unload()):
            torch.testing.assert_close(merged(input_ids=batch).logits, logits)


def test_lora_over_load_model_starts_from_the_base_model(tmp_path):
    """Under tiered.init the adapters are built on the meta device: they take peft's own
    initialization when materialized (lora_B zeros, lora_A kaiming-uniform), never
    nn.Linear's, and the base weights come from the folder under peft's renamed keys; so before
    any step the model computes exactly what the base model does."""
    base = llama()
    base.save_pretrained(tmp_path / "base")
    model = lora(load_model(str(tmp_path / "base"), policy=CPU))
    trainer = TieredTrainer(model=model, args=arguments(tmp_path / "run", max_steps=2),
                            train_dataset=dataset(), policy=CPU)
    state = trainer.engine.full_state_dict()
    adapters = {name: value for name, value in state.items() if ".lora_" in name}
    assert len(adapters) == 8
    for name, value in adapters.items():
        if ".lora_B." in name:
            assert torch.equal(value, torch.zeros_like(value)), name
        else:  # kaiming_uniform_(a=sqrt(5)): within 1/sqrt(fan_in)
            assert 0 < value.abs().max().item() <= 32 ** -0.5, name
    batch = torch.stack([row["input_ids"] for row in dataset()[:2]])
    with torch.no_grad():
        torch.testing.assert_close(trainer.engine(input_ids=batch).logits,
                                   base(input_ids=batch).logits, rtol=0, atol=0)
    trainer.train()
    trained = trainer.engine.full_state_dict()
    trainer.engine.close()
    for name, value in base.state_dict().items():  # frozen: the folder's, untouched
        ours = "base_model.model." + name.replace("q_proj.", "q_proj.base_layer.").replace(
            "v_proj.", "v_proj.base_layer.")
        assert torch.equal(trained[ours], value), name
    assert not torch.equal(trained[next(n for n in adapters if ".lora_B." in n)],
                           adapters[next(n for n in adapters if ".lora_B." in n)])


def test_sft_trainer_with_the_mixin_trains(tmp_path):
    """trl's SFTTrainer (which subclasses Trainer, and turns gradient checkpointing on) gets the
    engine through the mixin; on real text its loss falls."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")

    class TieredSFTTrainer(TieredTrainerMixin, trl.SFTTrainer):
        pass

    args = trl.SFTConfig(output_dir=str(tmp_path), max_steps=16, per_device_train_batch_size=4,
                         learning_rate=3e-3, logging_steps=4, report_to="none", use_cpu=True,
                         disable_tqdm=True, max_length=64, save_strategy="no")
    text = library_text(64 * 60)
    trainer = TieredSFTTrainer(
        model=llama(), args=args, processing_class=char_tokenizer(), policy=CPU,
        train_dataset=datasets.Dataset.from_dict({"text": [text[i:i + 60]
                                                            for i in range(0, len(text), 60)]}))
    assert trainer.args.gradient_checkpointing
    trainer.train()
    losses = [log["loss"] for log in step_logs(trainer)]
    trainer.engine.close()
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.3, losses


def test_the_example_fine_tunes_lora_adapters_offline(tmp_path, monkeypatch, capsys):
    """examples/finetune_hf.py at a tiny size (its run through tiered-launch is the README's;
    the launcher's part is tests/integrations/test_hf_launch.py's): it makes its base checkpoint, trains LoRA
    adapters on standard-library text, and saves an adapter peft loads onto the base."""
    from peft import PeftModel

    import finetune_hf

    out = tmp_path / "ft"
    monkeypatch.setattr("sys.argv", ["finetune_hf.py", "--out", str(out), "--lora", "4",
                                     "--steps", "6", "--layers", "2", "--dim", "64", "--seq",
                                     "32", "--batch", "4"])
    finetune_hf.main()
    printed = capsys.readouterr().out
    # 2 layers x (q, k, v, o) x (A: 4x64 + B: 64x4)
    assert "4,096 of 115,136 parameters train" in printed, printed
    model = PeftModel.from_pretrained(
        transformers.LlamaForCausalLM.from_pretrained(out / "base"), out / "final")
    assert model.peft_config["default"].r == 4


@pytest.mark.parametrize("tied", [False, True])
def test_lora_modules_to_save_start_as_the_base_layer(tmp_path, tied):
    """peft's modules_to_save trains a copy of a whole layer, which starts as the original:
    over load_model both read the base checkpoint's weight, also where the head is tied to the
    embedding (the checkpoint holds it under the embedding's name only). The trainer takes the
    policy load_model was given (none is passed to it here)."""
    peft = pytest.importorskip("peft")
    base = llama(tie_word_embeddings=tied)
    base.save_pretrained(tmp_path / "base")
    model = peft.get_peft_model(load_model(str(tmp_path / "base"), policy=CPU), peft.LoraConfig(
        r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    trainer = TieredTrainer(model=model, args=arguments(tmp_path / "run"))
    assert trainer.engine.device.type == "cpu" and trainer.engine.policy.device.value == "cpu"
    state = trainer.engine.full_state_dict()
    trainer.engine.close()
    for name in ("original_module", "modules_to_save.default"):
        assert torch.equal(state[f"base_model.model.lm_head.{name}.weight"],
                           base.state_dict()["lm_head.weight"]), name


def test_lora_inits_under_tiered_init_as_peft_builds_them_or_are_refused_by_name(tmp_path):
    """init_lora_weights=False leaves the adapters as their layers' own init makes them (no
    NaN left); DoRA's magnitude comes from the base weights, which are not loaded yet: refused
    by name."""
    peft = pytest.importorskip("peft")
    llama().save_pretrained(tmp_path / "base")
    plain = peft.get_peft_model(load_model(str(tmp_path / "base"), policy=CPU), peft.LoraConfig(
        r=4, target_modules=["q_proj"], init_lora_weights=False))
    trainer = TieredTrainer(model=plain, args=arguments(tmp_path / "run"))
    lora_b = [value for name, value in trainer.engine.full_state_dict().items()
              if ".lora_B." in name]
    trainer.engine.close()
    assert lora_b and all(value.abs().max() > 0 for value in lora_b)
    dora = peft.get_peft_model(load_model(str(tmp_path / "base"), policy=CPU), peft.LoraConfig(
        r=4, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(tiered.TieredError, match="adapter 'default': tiered.init builds LoRA"):
        TieredTrainer(model=dora, args=arguments(tmp_path / "run"))


def test_load_best_model_at_end_takes_the_best_checkpoints_states(tmp_path, monkeypatch):
    """The best checkpoint's weights come back from the engine's own checkpoint; they equal
    its export. (The eval loss falls at every evaluation here, so "best" is made the highest:
    step 2's, not the last.) A GradScaler accelerate would make from its environment is not
    used: the engine has no loss scale in fp32."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    args = arguments(tmp_path, eval_strategy="steps", eval_steps=2, save_strategy="steps",
                     save_steps=2, load_best_model_at_end=True, metric_for_best_model="eval_loss",
                     greater_is_better=True)
    trainer = tiered_run(llama(), args, dataset(), eval_dataset=dataset(rows=4))
    assert trainer.accelerator.scaler is None
    best = trainer.state.best_model_checkpoint
    assert best == str(tmp_path / "checkpoint-2")
    state = trainer.engine.full_state_dict()
    trainer.engine.close()
    exported = transformers.LlamaForCausalLM.from_pretrained(best).state_dict()
    assert all(torch.equal(state[name], value) for name, value in exported.items())


def test_the_examples_tokenizer_decodes_the_text_it_encoded(tmp_path):
    """The example's character tokenizer gives back the text, not its characters joined by
    spaces ("d e f   m a i n"), also once saved and loaded as a checkpoint's tokenizer is."""
    text = "def main():\n    return {'a': 1}  # the end\n"
    tokenizer = char_tokenizer()
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text) and tokenizer.decode(ids) == text
    tokenizer.save_pretrained(tmp_path)
    assert transformers.AutoTokenizer.from_pretrained(tmp_path).decode(ids) == text
