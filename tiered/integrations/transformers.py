"""Hugging Face ``Trainer`` over a tiered engine: ``TieredTrainer``, its mixin, ``load_model``.

    model = load_model("path/to/checkpoint")                     # nothing materialized
    trainer = TieredTrainer(model=model, args=args, train_dataset=data, policy="configs/nvme.yaml")
    trainer.train()

[Note: Trainer over the engine]
Trainer's own loop runs unchanged (data order, accumulation, the scheduler, logging, callbacks,
evaluation); what it would do to a model's parameters is the engine's instead:
- The model is partitioned at construction (``tiered.initialize``), before ``Trainer`` moves
  it anywhere, with a policy whose optimizer section says what the ``TrainingArguments`` say:
  ``learning_rate``, the betas, ``adam_epsilon``, ``weight_decay`` with Trainer's own no-decay
  set (``get_decay_parameter_names``) as a param group of weight decay 0, and ``max_grad_norm``
  (``.inf`` when Trainer would not clip: it still logs the norm).
- The optimizer Trainer steps is the engine's ``TieredAdamW``, never wrapped by accelerate (whose
  wrapper would move its state dict, which lives in the tiers); the scheduler Trainer makes
  drives its ``param_groups``.
- The model Trainer calls is the engine, never wrapped in DDP: the engine reduces gradients
  itself. Clipping is the engine's, inside the update: Trainer's ``clip_grad_norm_`` over the
  model's parameters is not run, and the ``grad_norm`` logged is ``optimizer.last_grad_norm``
  (under the delayed update, the last finished update's).
- ``save_model`` exports the weights streamed from the tiers (``engine.save_pretrained``) with
  the model's config and generation config, a folder ``from_pretrained`` loads.
- A reference model the trainer takes beside the policy (trl's ``DPOTrainer(ref_model=...)``)
  gets an engine of its own, ``ref_engine``, under the same policy: the trainer only ever runs
  it under ``no_grad``, so it is frozen before it is partitioned, and the engine keeps its
  weights alone (no gradients, no optimizer states; through the node's service, a job of its
  own beside the policy's). Left a plain module, it would sit whole on the device.
An argument whose meaning the engine cannot give is refused at construction, by name.
"""
from __future__ import annotations

import contextlib
import inspect
import os
import warnings
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..tiers.quantized import torchao_logs_held_back

try:
    with torchao_logs_held_back():  # transformers imports torchao wherever it is installed
        import transformers
        from transformers import Trainer
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError("tiered.integrations.transformers needs Hugging Face transformers and "
                      "accelerate: pip install 'tiered[hf]'") from error

from ..checkpoint.folder import release_folder
from ..checkpoint.pretrained import listing
from ..checkpoint.sources import RenamedSource, WeightSource, open_source
from ..core.errors import TieredError
from ..engine import initialize
from ..engine.engine import TieredEngine
from ..engine.init import init, init_context_of, peft_base_of
from ..optim.groups import group_of
from ..policy.config import Policy, resolve
from ..policy.deepspeed import DEEPSPEED_ENV, mismatches, read_deepspeed

ADAMW_NAMES = ("adamw_torch", "adamw_torch_fused")
"""``TrainingArguments.optim`` values that mean ``torch.optim.AdamW``, which the engine runs."""

CHECKPOINT_TAG = "tiered"
"""The engine's checkpoint inside each of Trainer's ``checkpoint-<step>`` folders."""
SCHEDULER_FILE = "scheduler.pt"
"""Trainer's name for the scheduler's state in a checkpoint folder."""

_weights_of: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()
"""The checkpoint folder ``load_model`` built each model from, read when training starts."""


def load_model(path: str, cls: Any = None, *, policy=None, frozen_dtype: str | None = None,
               **kwargs) -> nn.Module:
    """The model of the checkpoint folder ``path``, built from its ``config.json`` under
    ``tiered.init``: no parameter is allocated here. ``TieredTrainer`` (or
    ``tiered.initialize(model, weights=path)``) reads the folder's safetensors straight into the
    tiers, each rank only its shards, so a folder larger than DRAM fine-tunes.

    ``cls``: the model class (default ``AutoModelForCausalLM``); ``policy``: as for
    ``tiered.init``; ``frozen_dtype`` (``"int8"``, ``"nf4"``): the policy's
    ``params.frozen_dtype``, QLoRA's base: the frozen linear weights (of a peft model made on
    this one) are quantized unit by unit as the folder is read; ``kwargs`` go to
    ``cls.from_config`` (``dtype``/``torch_dtype``, ``attn_implementation``,
    ``trust_remote_code``, ...)."""

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise TieredError(f"{path}: no config.json; load_model reads a checkpoint folder as "
                          f"save_pretrained writes it (config.json and safetensors)")
    cls = cls or transformers.AutoModelForCausalLM
    trust = kwargs.get("trust_remote_code", False)
    config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=trust)
    if frozen_dtype is not None:
        policy = resolve(policy, {"params": {"frozen_dtype": frozen_dtype}})
    with init(policy):
        model = cls.from_config(config, **kwargs)
    _weights_of[model] = path
    return model


def trainer_policy(args, model: nn.Module, policy, decay_names: list[str]) -> Policy:
    """``policy`` (as ``tiered.initialize`` takes it) with its optimizer and compute dtype set
    from the TrainingArguments (see [Note: Trainer over the engine]). The policy's own param
    groups stay, first; Trainer's no-decay group takes the no-decay parameters they leave. The
    compute dtype is the arguments' (bf16, fp16, else fp32), as in Trainer, whatever the
    policy's."""
    base = resolve(policy)
    groups = base.optimizer.param_groups
    no_decay = [name for name, param in model.named_parameters(remove_duplicate=False)
                if name not in decay_names and param.requires_grad
                and group_of((name,), groups) == 0]
    optimizer = dict(lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                     eps=args.adam_epsilon, weight_decay=args.weight_decay,
                     max_grad_norm=args.max_grad_norm if args.max_grad_norm > 0 else float("inf"),
                     # One backward a step, always: bf16 gradients stay bf16 (half the grads
                     # tier). With more, Trainer's last step of an epoch may take fewer.
                     accumulation_steps=1 if args.gradient_accumulation_steps == 1 else None)
    if no_decay and args.weight_decay != 0:
        optimizer["param_groups"] = base.to_dict()["optimizer"]["param_groups"] + [
            {"match": [_literal(name) for name in no_decay], "weight_decay": 0.0}]
    compute = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    return resolve(base, {"optimizer": optimizer, "compute_dtype": compute})


def _literal(name: str) -> str:
    """A shell pattern (param group ``match``) that matches ``name`` alone."""
    return "".join(f"[{c}]" if c in "*?[]" else c for c in name)


def refusals(args, given: dict[str, Any]) -> list[str]:
    """What the engine cannot honour among the TrainingArguments and the Trainer arguments
    ``given``, each said with what to do instead."""
    refused = []
    optim = getattr(args.optim, "value", args.optim)  # an OptimizerNames member
    if optim not in ADAMW_NAMES:
        refused.append(f"optim={optim!r}: the engine runs torch.optim.AdamW's update "
                       f"(optim in {list(ADAMW_NAMES)})")
    if args.optim_args:
        refused.append(f"optim_args={args.optim_args!r}: the engine's AdamW takes its settings "
                       f"from learning_rate, adam_beta1/2, adam_epsilon and weight_decay")
    if args.deepspeed:
        refused.append("deepspeed=...: tiered is the offload engine here; drop deepspeed (give "
                       "a DeepSpeed config file as policy=, which TieredTrainer reads)")
    if args.fsdp:
        refused.append(f"fsdp={args.fsdp!r}: tiered shards the model itself (ZeRO-3); drop fsdp")
    if args.torch_compile:
        refused.append("torch_compile=True: the engine gathers each unit in hooks around its "
                       "module, which a compiled model would bypass")
    if args.auto_find_batch_size:
        refused.append("auto_find_batch_size=True: the engine's memory is planned once, at "
                       "construction; set per_device_train_batch_size")
    if args.label_smoothing_factor:
        refused.append(f"label_smoothing_factor={args.label_smoothing_factor}: not supported by "
                       f"TieredTrainer yet; give compute_loss_func a smoothed loss")
    for flag in ("fp16_full_eval", "bf16_full_eval"):
        if getattr(args, flag, False):
            refused.append(f"{flag}=True: evaluation computes in the engine's compute dtype "
                           f"(bf16 or fp16 set it for training and evaluation alike)")
    if args.n_gpu > 1:
        refused.append(f"{args.n_gpu} GPUs in one process (DataParallel): start one process per "
                       f"GPU with tiered-launch")
    for name in ("model_init", "optimizers", "optimizer_cls_and_kwargs"):
        value = given.get(name)
        if value is not None and value != (None, None):
            refused.append(f"{name}=...: the optimizer and the model's partitioning are the "
                           f"engine's, made from the model and policy TieredTrainer is given")
    if given.get("peft_config") is not None:
        refused.append("peft_config=...: the engine takes the model as it is given; make the "
                       "peft model first (get_peft_model(model, config)) and pass it as model")
    return refused


def deepspeed_refusals(args, policy) -> list[str]:
    """A DeepSpeed config given as the policy (or, without one, to tiered-launch): its explicit
    values that differ from the TrainingArguments, refused as Hugging Face's DeepSpeed
    integration refuses them (its ``"auto"`` takes theirs, as trainer_policy does)."""
    if policy is None:
        policy = os.environ.get(DEEPSPEED_ENV)
    translation = read_deepspeed(policy) if isinstance(policy, (str, os.PathLike)) else None
    if translation is None:
        return []
    accumulation = args.gradient_accumulation_steps
    return mismatches(translation, {
        "optimizer.params.lr": args.learning_rate,
        "optimizer.params.betas": [args.adam_beta1, args.adam_beta2],
        "optimizer.params.eps": args.adam_epsilon,
        "optimizer.params.weight_decay": args.weight_decay,
        "gradient_clipping": args.max_grad_norm,
        "gradient_accumulation_steps": accumulation,
        "train_micro_batch_size_per_gpu": args.per_device_train_batch_size,
        "train_batch_size": args.world_size * args.per_device_train_batch_size * accumulation,
        "bf16.enabled": args.bf16,
        "fp16.enabled": args.fp16})


def reference_refusals(args, model: nn.Module, reference: nn.Module | None) -> list[str]:
    """What the engine cannot honour about the reference model of a trainer that takes one
    (``ref_model``: trl's DPOTrainer), each said with what to do instead."""
    refused = []
    if isinstance(reference, TieredEngine):
        refused.append("ref_model=<engine>: pass the reference model itself; TieredTrainer "
                       "initializes its engine")
    if getattr(args, "sync_ref_model", False):
        refused.append("sync_ref_model=True: trl mixes the policy's parameters into the "
                       "reference's in place, and both models' weights live in their engines' "
                       "tiers; keep the reference fixed")
    if reference is None and peft_base_of(model) is not None:
        refused.append("ref_model=None with a peft model: trl then computes the reference by "
                       "switching the adapters (to a copy it adds, or off), which sets their "
                       "requires_grad, fixed once the engine partitioned the model; pass the "
                       "base model as ref_model (load_model(path)): it gets an engine of its own")
    elif reference is None and not getattr(args, "precompute_ref_log_probs", False):
        refused.append("ref_model=None: trl would load a plain copy of the model, whole on the "
                       "device, beside the engine; pass ref_model (load_model(path)), which gets "
                       "an engine of its own, or set precompute_ref_log_probs=True")
    return refused


if TYPE_CHECKING:  # the mixin's methods read Trainer's attributes; transformers is optional
    from transformers import Trainer as _TrainerBase
else:
    _TrainerBase = object


class TieredTrainerMixin(_TrainerBase):
    """Makes a ``transformers.Trainer`` subclass train through a tiered engine (see [Note:
    Trainer over the engine]): ``class MySFT(TieredTrainerMixin, SFTTrainer)``.

    Takes ``policy=`` (a YAML path, dict or ``tiered.Policy``; default: the one the model was
    built under, else the launcher's, as ``tiered.initialize``) besides the trainer's own
    arguments. After construction ``self.engine`` is the engine and ``self.optimizer`` its
    ``TieredAdamW``; ``self.model`` stays the model, whose parameters live in the tiers. A
    trainer that takes a reference model (``class TieredDPO(TieredTrainerMixin, DPOTrainer)``)
    has it partitioned, frozen, into ``self.ref_engine`` (None without one); close both."""

    def __init__(self, model: nn.Module | None = None, args=None, *pos, policy=None, **kwargs):
        if pos:
            raise TieredError("TieredTrainer takes its arguments after args= by name")
        if model is None:
            raise TieredError("TieredTrainer needs model=: the model to partition (model_init "
                              "is not supported)")
        if isinstance(model, TieredEngine):
            raise TieredError("TieredTrainer takes the model, not an engine: it initializes "
                              "the engine itself, from the model and policy")
        if not isinstance(model, nn.Module):
            raise TieredError(f"TieredTrainer takes a model object, not {type(model).__name__} "
                              f"{model!r}: build it first (load_model(path) for a folder)")
        if args is None:
            args = transformers.TrainingArguments(output_dir="tmp_trainer")
        refused = refusals(args, kwargs) + deepspeed_refusals(args, policy)
        reference = kwargs.get("ref_model")
        if "ref_model" in inspect.signature(super().__init__).parameters:
            refused += reference_refusals(args, model, reference)
        if refused:
            raise TieredError("TieredTrainer cannot honour these arguments:\n  - "
                              + "\n  - ".join(refused))
        kwargs.pop("optimizers", None)  # (None, None): the engine's take their place
        decay = Trainer.get_decay_parameter_names(self, model)
        with _start_weights(model) as (weights, strict):
            self.engine, optimizer = initialize(
                model, trainer_policy(args, model, _given_policy(model, policy), decay),
                weights=weights, strict=strict)
        self.ref_engine = None
        if reference is not None:
            try:
                self.ref_engine = _reference_engine(reference, args, policy)
            except BaseException:
                self.engine.close()  # no half-built trainer holds the tiers
                raise
        super().__init__(model=model, args=args, optimizers=(optimizer, None), **kwargs)
        # accelerate runs the backward as scaler.scale(loss).backward() when it has a scaler:
        # the engine's loss scale under fp16, else none (not a GradScaler of its own, which
        # accelerate makes from ACCELERATE_MIXED_PRECISION too, and which nothing unscales).
        self.accelerator.scaler = (_EngineLossScale(self.engine)
                                   if self.engine.scaler is not None else None)

    # -- the engine in place of what Trainer would wrap -----------------------------------------

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        return self.engine

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        if self._created_lr_scheduler:  # as Trainer: a new schedule for each train()
            self.lr_scheduler = None
            self._created_lr_scheduler = False
        self.create_scheduler(num_training_steps=max_steps)
        self.model_wrapped = self.engine
        # accelerate's optimizer_step_was_skipped (the loop steps the scheduler unless an fp16
        # overflow skipped the step) asks its optimizers, of which the engine's is not one.
        self.accelerator._optimizers.append(self.optimizer)
        if resume_from_checkpoint is not None:
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return self.engine, train_dataloader

    def create_optimizer(self, model=None):
        return self.optimizer  # the engine's, made at construction

    def _clip_grad_norm(self, model):
        return None  # the engine clips inside the update: policy optimizer.max_grad_norm

    def _get_grad_norm(self, model, grad_norm=None):
        return None  # known once the update has it: _maybe_log_save_evaluate reads it

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, model, *args, **kwargs):
        if self.control.should_log and self.state.global_step > self._globalstep_last_logged:
            grad_norm = self.optimizer.last_grad_norm
        return super()._maybe_log_save_evaluate(tr_loss, grad_norm, model, *args, **kwargs)

    # -- checkpoints ----------------------------------------------------------------------------

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The engine's checkpoint (every tier's state, atomically, each rank its part) under
        ``output_dir/tiered``, and the scheduler's state as Trainer saves it. The folder is
        given up at once: Trainer's rotation deletes it later (save_total_limit)."""
        self.engine.save_checkpoint(output_dir, CHECKPOINT_TAG)
        release_folder(self.engine, output_dir)
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_FILE))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """Checks the folder only: the engine's checkpoint is loaded with the optimizer's state
        (_load_optimizer_and_scheduler), after the scheduler is made, whose construction sets
        the learning rates that the checkpoint's param groups then restore."""
        if not os.path.isdir(os.path.join(resume_from_checkpoint, CHECKPOINT_TAG)):
            raise TieredError(
                f"{resume_from_checkpoint}: no {CHECKPOINT_TAG}/ folder, so not a checkpoint "
                f"TieredTrainer saved (its optimizer state would be lost); to start from its "
                f"weights alone, build the model with load_model({resume_from_checkpoint!r})")

    def _load_best_model(self) -> None:
        """``load_best_model_at_end``: the best checkpoint's weights and states, from the
        engine's own checkpoint (not its export, rounded to the model's dtype)."""
        best = self.state.best_model_checkpoint
        assert best is not None, "Trainer loads the best model only once it has one"
        self._load_engine_checkpoint(best)

    def _load_engine_checkpoint(self, folder: str) -> None:
        """The engine's checkpoint in one of Trainer's folders, which it then gives up."""
        self.engine.load_checkpoint(folder, CHECKPOINT_TAG)
        release_folder(self.engine, folder)

    def _save_scaler(self, output_dir: str) -> None:
        pass  # the fp16 loss scale is in the engine's checkpoint

    def _load_scaler(self, checkpoint: str | None) -> None:
        pass

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Weights, moments, step counts and each param group's hyperparameters from the
        engine's checkpoint in the folder, and the scheduler's position."""
        if checkpoint is None:
            return
        self._load_engine_checkpoint(checkpoint)
        path = os.path.join(checkpoint, SCHEDULER_FILE)
        if os.path.isfile(path) and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(torch.load(path, weights_only=True))

    # -- saving ---------------------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The trained weights as a folder ``from_pretrained`` loads: safetensors streamed from
        the tiers, the config and generation config, the tokenizer and the TrainingArguments;
        for a ``peft`` model its adapters as ``peft`` saves them (``adapter_model.safetensors``
        and ``adapter_config.json``, for ``PeftModel.from_pretrained``). Every rank must call it
        (each gathers its shards); rank 0 writes."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if output_dir is None:
            raise TieredError("save_model needs a folder: pass output_dir, or set it in the "
                              "TrainingArguments")
        model: Any = self.model  # a PeftModel here, whose save_pretrained takes the adapters
        if peft_base_of(model) is not None:
            adapters = _trainable_state(self.engine)
            model.save_pretrained(output_dir, state_dict=adapters,
                                  is_main_process=self.args.should_save)
        else:  # with the config and generation config
            self.engine.save_pretrained(output_dir, dtype=_weights_dtype(self.engine))
        if not self.args.should_save:
            return
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, "training_args.bin"))


def _given_policy(model: nn.Module, policy):
    """``policy`` as given to the trainer, else the one the model (or a peft model's base) was
    built under, as ``initialize`` takes it."""
    if policy is not None:
        return policy
    context = init_context_of(peft_base_of(model) or model)
    return context.policy if context is not None else None


def _reference_engine(reference: nn.Module, args, policy) -> TieredEngine:
    """The reference model's engine (see [Note: Trainer over the engine]): frozen first, so that
    it keeps no gradients and no optimizer states; the compute dtype is the arguments', as the
    policy's."""
    reference.requires_grad_(False)
    with _start_weights(reference) as (weights, strict):
        engine, _ = initialize(reference, trainer_policy(args, reference,
                                                         _given_policy(reference, policy), []),
                               weights=weights, strict=strict)
    return engine


def _trainable_state(engine: TieredEngine) -> dict[str, torch.Tensor]:
    """The trained parameters (a peft model's adapters) by state-dict name, fp32, on every rank;
    every unit is gathered in turn (a collective), the frozen ones' values dropped."""
    trained = {name for name, param in engine.named_parameters(remove_duplicate=False)
               if param.requires_grad}
    state = {}
    for flat, full in engine.consolidated_units():
        state.update({name: value for name, value in flat.by_name(full).items()
                      if name in trained})
    return state


def peft_base_name(name: str) -> str:
    """The base model's name of a ``peft`` model's parameter: without the ``base_model.model.``
    prefix, the ``base_layer`` a LoRA layer puts its wrapped layer under, and the
    ``original_module`` or ``modules_to_save.<adapter>`` of a layer trained whole
    (``modules_to_save``: its trained copy starts as the original)."""
    parts = name.removeprefix("base_model.model.").split(".")
    kept, skip = [], 0
    for part in parts:
        if skip:
            skip -= 1
        elif part == "modules_to_save":
            skip = 1  # and the adapter's name after it
        elif part not in ("base_layer", "original_module"):
            kept.append(part)
    return ".".join(kept)


@contextlib.contextmanager
def _start_weights(model: nn.Module):
    """The weights ``load_model`` built ``model`` (or a ``peft`` model's base) from, under the
    model's names, and whether to hold them to strict matching (``initialize``'s ``strict``).
    A peft model's LoRA adapters are not in a base checkpoint: they start as peft initializes
    them, not warned about; every other parameter must be there, under one of the base names it
    goes by (a tied one, or a trained copy of a tied layer, under any of its names)."""
    base = peft_base_of(model)
    path = _weights_of.get(model) or (_weights_of.get(base) if base is not None else None)
    if path is None:
        yield None, True
        return
    if base is None:
        yield path, True
        return
    names_of: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    aliases: dict[str, set[str]] = {}  # base name -> the base names of its parameter
    for names in names_of.values():
        bases = {peft_base_name(name) for name in names}
        for name in bases:
            aliases.setdefault(name, set()).update(bases)
    keys = list(model.state_dict().keys())
    checkpoint = open_source(path)
    source = RenamedSource(checkpoint, {key: _name_in(checkpoint, key, aliases) for key in keys})
    try:
        held = {name for names in names_of.values() for name in names}
        missing = [names[0] for names in names_of.values()
                   if not any(name in source.tensors or _is_adapter(name) for name in names)]
        missing += [key for key in keys if key not in held and key not in source.tensors]
        if missing:
            raise TieredError(f"{path} lacks {len(missing)} of the base model's weights: "
                              f"{listing(missing)}")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"tiered: \d+ parameters, buffers or "
                                    r"extra states are not in")
            yield source, False
    finally:
        source.close()


def _name_in(checkpoint: WeightSource, key: str, aliases: dict[str, set[str]]) -> str:
    """The checkpoint's name for the peft model's ``key``: its base name, else another base
    name of the same parameter that the checkpoint has."""
    own = peft_base_name(key)
    others = sorted(aliases.get(own, set()) - {own})
    return next((name for name in [own, *others] if name in checkpoint.tensors), own)


def _is_adapter(name: str) -> bool:
    """A parameter a LoRA layer adds (``lora_A``, ``lora_B``, the embedding adapters, DoRA's
    magnitude): no base checkpoint holds it."""
    return any(part.startswith("lora_") for part in name.split("."))


class _EngineLossScale:
    """What accelerate's backward scales the loss with under fp16 (its GradScaler's place):
    the engine's loss scale, which its optimizer unscales, skips and adjusts."""

    def __init__(self, engine: TieredEngine):
        self.engine = engine

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.engine.scaled_loss(loss)

    def get_scale(self) -> float:
        scaler = self.engine.scaler
        assert scaler is not None, "accelerate scales only an fp16 engine's loss"
        return scaler.scale

    def unscale_(self, optimizer) -> None:
        raise TieredError("the engine unscales fp16 gradients inside its update, and clips "
                          "there too: set max_grad_norm in the TrainingArguments instead of "
                          "clipping with accelerate")


def _weights_dtype(engine: TieredEngine) -> torch.dtype:
    """The dtype the model gave its (first) parameter: what an export writes, as the model's
    own ``save_pretrained`` would."""
    return engine.runtime.flats[0].spec.params[0].dtype


class TieredTrainer(TieredTrainerMixin, Trainer):
    """``transformers.Trainer`` training through a tiered engine; takes ``policy=`` besides
    Trainer's arguments (see TieredTrainerMixin)."""
