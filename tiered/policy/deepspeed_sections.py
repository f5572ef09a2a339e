"""The tables of how each DeepSpeed config key is read, a section each (the reader and the kinds
of handler: deepspeed_keys.py); ``TOP_LEVEL`` reads a whole file."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..tiers.moments import piece_granule
from .deepspeed_keys import (AUTO, INVALID, SCRIPT_VALUES, Fate, Reader, default_only, enabled,
                             given_value, half_precision, honoured, ignored, positive, shown)
from .values import as_betas, as_bool, as_number, as_path, as_whole_number


def _stage(reader: Reader, key: str, value: Any) -> None:
    if value == 3 and not isinstance(value, bool):
        reader.note(key, value, Fate.HONOURED, "tiered partitions weights, gradients and "
                    "optimizer states across ranks (ZeRO-3), always")
    else:
        reader.refuse(key, f"is {value!r}: tiered runs ZeRO stage 3 only (weights, gradients "
                      f"and optimizer states partitioned; stage 1 and 2 keep whole weights on "
                      f"every GPU, which it does not offer); allowed: 3")


OFFLOAD_TIERS = {"cpu": "dram", "nvme": "nvme", "none": "hbm"}
"""The tier an offload device means; ``none`` (or no offload section) keeps it on the GPU."""


def _offload_device(reader: Reader, key: str, value: Any, given: bool = True) -> None:
    if value not in OFFLOAD_TIERS:
        reader.refuse(key, f"is {value!r}; allowed: {' | '.join(OFFLOAD_TIERS)}")
        return
    noted = value if given else None
    tier = OFFLOAD_TIERS[value]
    if key.split(".")[1] == "offload_param":
        reader.set(key, noted, "params.tier", tier)
    else:
        reader.set(key, noted, "optimizer.tier", tier, "the update runs where its states are")
        grads = "hbm" if tier == "hbm" else "dram"
        reader.set(key, noted, "grads.tier", grads, "where the optimizer reads them")


def _nvme_path(reader: Reader, key: str, value: Any) -> None:
    section = key.rsplit(".", 1)[0]
    if reader.at(f"{section}.device") != "nvme":
        reader.note(key, value, Fate.IGNORED, "the device is not nvme")
        return
    path = reader.parse(key, value, as_path)
    if path is INVALID:
        return
    other = reader.policy.get("nvme", {}).get("path")
    if other is not None and other != path:
        reader.refuse(key, f"is {path!r} but the other offload's nvme_path is {other!r}: tiered "
                      f"keeps weights and optimizer states under one nvme.path")
        return
    reader.set(key, value, "nvme.path", path)


PINNED = "tiered's DRAM tier is always pinned (the node's pool, or the rank's own slabs)"


def _offload(table: Mapping[str, Callable]) -> Callable:
    """An offload section, whose device DeepSpeed requires."""
    def handle(reader: Reader, key: str, value: Any) -> None:
        if isinstance(value, Mapping) and "device" not in value:
            reader.refuse(f"{key}.device", "is not given; allowed: cpu | nvme | none")
        reader.section(value, key, table)
    return handle


OFFLOAD_PARAM = {
    "device": _offload_device,
    "nvme_path": _nvme_path,
    "pin_memory": ignored(PINNED),
    "buffer_count": ignored("the engine sizes its read-ahead buffers itself (prefetch)"),
    "buffer_size": ignored("the engine sizes its read-ahead buffers itself (prefetch)"),
    "max_in_cpu": ignored("NVMe weights are read into pinned buffers ahead of their gather "
                          "(prefetch.dram_bytes), not cached in DRAM"),
}


def _sub_group_size(reader: Reader, key: str, value: Any) -> None:
    if reader.at("zero_optimization.offload_optimizer.device") != "nvme":
        reader.note(key, value, Fate.IGNORED, "tiered's sub-groups are the pieces optimizer "
                    "states stream from NVMe in; the CPU or GPU update steps each unit whole")
        return
    elements = given_value(reader, key, value, positive(as_number))
    if elements is INVALID:
        return
    moments = torch.bfloat16 if reader.at("bf16.bf16_optimizer_states") is True else torch.float32
    granule = piece_granule([torch.float32, moments])
    rounded = max(granule, int(elements) // granule * granule)
    why = "" if rounded == elements else f"rounded to whole {granule}-element blocks"
    reader.set(key, value, "optimizer.sub_group_size", rounded, why)


OFFLOAD_OPTIMIZER = {
    "device": _offload_device,
    "nvme_path": _nvme_path,
    "pin_memory": ignored(PINNED),
    "buffer_count": ignored("optimizer states stream through three pinned buffer sets "
                            "(read ahead, stepped, written back), sized by sub_group_size"),
    "fast_init": ignored("the engine sets up its NVMe optimizer states itself"),
    "pipeline_read": ignored("NVMe reads of optimizer states overlap the update, always"),
    "pipeline_write": ignored("NVMe writes of optimizer states overlap the update, always"),
    "ratio": default_only(1, "tiered steps every offloaded state on the CPU; a policy's "
                          "tier: auto keeps whole units on the GPU as its budget allows"),
}


def _prefetch_bucket(reader: Reader, key: str, value: Any) -> None:
    if value == AUTO:
        reader.note(key, value, Fate.IGNORED, "tiered's own: twice the largest module's bytes "
                    "(prefetch.hbm_bytes: null)")
        return
    elements = reader.parse(key, value, as_whole_number)
    if elements is INVALID:
        return
    if elements == 0:
        reader.set(key, value, "prefetch.enabled", False, "no parameters gathered ahead")
    else:
        reader.set(key, value, "prefetch.hbm_bytes", elements * reader.element_bytes,
                   f"{reader.element_bytes} bytes an element")


OWN_UNITS = ("tiered gathers and reduce-scatters each unit's flat buffer whole: its units "
             "(units.classes) are its buckets")

ZERO = {
    "stage": _stage,
    "offload_param": _offload(OFFLOAD_PARAM),
    "offload_optimizer": _offload(OFFLOAD_OPTIMIZER),
    "overlap_comm": ignored("tiered overlaps always: each unit's reduce-scatter and copy off "
                            "the device run on a side stream as soon as its gradient is whole"),
    "contiguous_gradients": ignored("each unit's gradient is one flat buffer already"),
    "reduce_bucket_size": ignored(OWN_UNITS),
    "allgather_bucket_size": ignored(OWN_UNITS),
    "allgather_partitions": ignored(OWN_UNITS),
    "reduce_scatter": ignored(OWN_UNITS),
    "stage3_prefetch_bucket_size": _prefetch_bucket,
    "stage3_max_live_parameters": ignored(
        "tiered holds the units in use and prefetch.hbm_bytes of those ahead; hbm.budget "
        "bounds the rest"),
    "stage3_max_reuse_distance": ignored(
        "a unit stays gathered while its module is among the next prefetch.depth modules of "
        "the recorded order (counted in modules, not parameters)"),
    "stage3_param_persistence_threshold": ignored(
        "tiered partitions every parameter with its unit; a small one rides in its block's"),
    "stage3_module_granularity_threshold": ignored(
        "tiered's units are the model's repeated blocks (units.classes)"),
    "sub_group_size": _sub_group_size,
    "stage3_gather_16bit_weights_on_model_save": ignored(
        "engine.save_pretrained and TieredTrainer.save_model always gather the whole weights"),
    "stage3_gather_fp16_weights_on_model_save": ignored(
        "engine.save_pretrained and TieredTrainer.save_model always gather the whole weights"),
    "round_robin_gradients": ignored("a stage 1 and 2 setting in DeepSpeed"),
    "elastic_checkpoint": ignored("a stage 1 and 2 setting in DeepSpeed"),
    "ignore_unused_parameters": ignored("a stage 2 setting in DeepSpeed; tiered steps the "
                                        "parameters that got a gradient"),
    "load_from_fp32_weights": ignored("tiered's checkpoints hold the fp32 master weights and "
                                      "load them"),
    "memory_efficient_linear": ignored("a gathered unit's weights are freed after its "
                                       "forward whatever autograd saved, and gathered again "
                                       "for backward"),
    "log_trace_cache_warnings": ignored("tiered says in its log when the recorded order "
                                        "changes"),
    "cpu_offload": default_only(False, "the deprecated stage 1 and 2 form; use "
                                "offload_optimizer"),
    "zero_quantized_weights": default_only(False, "ZeRO++ quantized communication: tiered "
                                           "gathers weights unquantized"),
    "zero_quantized_gradients": default_only(False, "ZeRO++ quantized communication: tiered "
                                             "reduces gradients unquantized"),
    "zero_hpz_partition_size": default_only(1, "ZeRO++ hierarchical partitioning: tiered "
                                            "partitions over every rank"),
}

AIO = {
    "block_size": honoured("nvme.block_size", as_whole_number),
    "queue_depth": honoured("nvme.queue_depth", as_whole_number),
    "thread_count": ignored("reads and writes each have their own threads, queue_depth "
                            "requests in flight"),
    "intra_op_parallelism": ignored("reads and writes each have their own threads, "
                                    "queue_depth requests in flight"),
    "single_submit": ignored("tiered keeps queue_depth requests in flight per direction"),
    "overlap_events": ignored("tiered keeps queue_depth requests in flight per direction"),
    "use_gds": default_only(False, "GPUDirect Storage: tiered reads NVMe into pinned DRAM"),
}


def _precision(dtype: str) -> Callable:
    def enabled(reader: Reader, key: str, value: Any) -> None:
        flag = given_value(reader, key, value, as_bool)
        if flag is INVALID:
            return
        reader.script_values[key.replace("bfloat16", "bf16")] = flag
        other = "fp16" if dtype == "bf16" else "bf16"
        if flag and reader.policy.get("compute_dtype") == other:
            reader.refuse(key, f"is true with {other}.enabled true: DeepSpeed takes one of them")
        elif flag:
            reader.set(key, value, "compute_dtype", dtype)
        else:
            reader.note(key, value, Fate.IGNORED, f"{dtype} is off")
    return enabled


def _bf16_state(policy_key: str, how: str, default: str) -> Callable:
    """A bf16 flag of DeepSpeed's for one kind of optimizer state: true keeps it in bf16 as
    ``policy_key`` says (``how``: what that means here), false is tiered's ``default``."""
    def handle(reader: Reader, key: str, value: Any) -> None:
        if reader.parse(key, value, as_bool) is True:
            reader.set(key, value, policy_key, "bf16", how)
        elif value is False:
            reader.note(key, value, Fate.IGNORED, f"{default}, tiered's default")
    return handle


BF16 = {
    "enabled": _precision("bf16"),
    "bf16_master_weights_and_grads": _bf16_state(
        "optimizer.master", "the bf16 weights are the master, updated with stochastic rounding",
        "fp32 master weights"),
    "bf16_optimizer_states": _bf16_state(
        "optimizer.moments", "stochastically rounded; computed in fp32", "fp32 moments"),
    "immediate_grad_update": ignored("tiered adds each gradient into its grads tier as it "
                                     "arrives"),
    "check_grad_overflow": ignored("bf16 needs no loss scale; the update sees any inf"),
}


def _fp16_key(handle: Callable) -> Callable:
    """A loss-scale key: honoured when fp16 is on (or "auto"), ignored when it is off."""
    def when_on(reader: Reader, key: str, value: Any) -> None:
        if enabled(reader.at("fp16")) in (True, AUTO):
            handle(reader, key, value)
        else:
            reader.note(key, value, Fate.IGNORED, "fp16 is off")
    return when_on


def _loss_scale(reader: Reader, key: str, value: Any) -> None:
    if value == 0 and not isinstance(value, bool):
        reader.note(key, value, Fate.HONOURED, "dynamic loss scaling (loss_scale section)")
    else:
        reader.refuse(key, f"is {shown(value)}: a static loss scale; tiered scales fp16 losses "
                      f"dynamically only (allowed: 0)")


FP16 = {
    "enabled": _precision("fp16"),
    "auto_cast": default_only(False, "tiered does not cast a model's inputs: cast them in "
                              "the script"),
    "loss_scale": _fp16_key(_loss_scale),
    "initial_scale_power": _fp16_key(honoured("loss_scale.initial_scale", as_whole_number,
                                              convert=lambda power: float(2 ** power))),
    "loss_scale_window": _fp16_key(honoured("loss_scale.growth_interval", as_whole_number)),
    "hysteresis": _fp16_key(ignored("tiered halves the scale at every overflow (as "
                                    "torch.amp.GradScaler, hysteresis 1); the step is skipped "
                                    "either way")),
    "consecutive_hysteresis": _fp16_key(ignored("tiered halves the scale at every overflow")),
    "min_loss_scale": _fp16_key(ignored("tiered's dynamic scale has no floor")),
    "fp16_master_weights_and_grads": default_only(False, "tiered keeps fp32 master weights "
                                                  "under fp16 (optimizer.master: bf16 needs "
                                                  "bf16)"),
}

ADAM_TYPES = ("adam", "adamw")
"""DeepSpeed's optimizer types tiered runs, as DeepSpeed compares them (lowercased): its Adam
decouples weight decay too unless ``adam_w_mode`` is false."""


def _optimizer_type(reader: Reader, key: str, value: Any) -> None:
    if isinstance(value, str) and value.lower() in ADAM_TYPES:
        reader.note(key, value, Fate.HONOURED, "tiered's AdamW (torch.optim.AdamW's update)")
    else:
        reader.refuse(key, f"is {value!r}: tiered runs AdamW only (its CPU, GPU and NVMe "
                      f"updates); allowed: Adam, AdamW")


def _adam_w_mode(reader: Reader, key: str, value: Any) -> None:
    kind = reader.at("optimizer.type")
    decay = reader.at("optimizer.params.weight_decay") or 0
    if value is True or (isinstance(kind, str) and kind.lower() == "adamw") or decay == 0:
        reader.note(key, value, Fate.HONOURED, "decoupled weight decay, as AdamW")
    else:
        reader.refuse(key, f"is {shown(value)}: Adam with L2 regularization (weight decay "
                      f"added to the gradient); tiered's AdamW decouples it, the same only "
                      f"with weight_decay 0 (allowed: true)")


def _nonnegative(parse: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def checked(value: Any) -> Any:
        number = parse(value)
        if number < 0:
            raise ValueError(f"expected a number >= 0, got {value!r}")
        return number
    return checked


OPTIMIZER_PARAMS = {
    "lr": honoured("optimizer.lr", _nonnegative(as_number)),
    "betas": honoured("optimizer.betas", as_betas, convert=list),
    "eps": honoured("optimizer.eps", positive(as_number)),
    "weight_decay": honoured("optimizer.weight_decay", _nonnegative(as_number)),
    "adam_w_mode": _adam_w_mode,
    "torch_adam": ignored("tiered's own AdamW kernels, torch.optim.AdamW's update"),
    "amsgrad": default_only(False, "AMSGrad's maximum of the second moment; tiered runs "
                            "AdamW"),
    "bias_correction": default_only(True, "tiered's AdamW always corrects the moments' bias"),
}


def _optimizer(reader: Reader, key: str, value: Any) -> None:
    if isinstance(value, Mapping) and "type" not in value:
        reader.refuse(f"{key}.type", "is not given; allowed: Adam, AdamW")
    reader.section(value, key, OPTIMIZER)


OPTIMIZER = {
    "type": _optimizer_type,
    "params": lambda reader, key, value: reader.section(value, key, OPTIMIZER_PARAMS),
}


def _clipping(reader: Reader, key: str, value: Any) -> None:
    norm = given_value(reader, key, value, _nonnegative(as_number))
    if norm is INVALID:
        return
    reader.script_values[key] = value
    reader.set(key, value, "optimizer.max_grad_norm", norm if norm > 0 else None,
               "" if norm > 0 else "0: no clipping, as in DeepSpeed")


def _scheduler(reader: Reader, key: str, value: Any) -> None:
    kind = value.get("type") if isinstance(value, Mapping) else value
    reader.note(key, kind, Fate.SCRIPT, "a policy makes no scheduler: the script's own drives "
                "optimizer.param_groups' lr (TieredTrainer: TrainingArguments' "
                "lr_scheduler_type and warmup)")


def _batch(reader: Reader, key: str, value: Any) -> None:
    """A batch size: no policy holds one (recorded for TieredTrainer's comparison)."""
    if given_value(reader, key, value, positive(as_whole_number)) is not INVALID:
        reader.script_values[key] = value
        reader.note(key, value, Fate.SCRIPT, f"the batch is the script's data loader's "
                    f"(TieredTrainer's must equal it: {SCRIPT_VALUES[key]})")


def _cpu_checkpointing(reader: Reader, key: str, value: Any) -> None:
    flag = given_value(reader, key, value, as_bool)
    if flag is INVALID:
        return
    if flag:
        reader.set(key, value, "activations.tier", "dram",
                   "what autograd saves for backward (the checkpointed inputs under activation "
                   "checkpointing) waits in pinned DRAM; on any number of GPUs, where "
                   "DeepSpeed's needs partition_activations and model parallelism")
    else:
        reader.note(key, value, Fate.IGNORED, "DeepSpeed's default: activations stay on the GPU")


OWN_CHECKPOINTING = ("the model's own activation checkpointing (torch.utils.checkpoint, or "
                     "Hugging Face's gradient_checkpointing_enable) decides what is saved")

ACTIVATION_CHECKPOINTING = {
    "cpu_checkpointing": _cpu_checkpointing,
    "partition_activations": ignored(
        "splits checkpoints across model-parallel ranks, which tiered does not run: each rank "
        "keeps its own batch's (cpu_checkpointing moves them to DRAM)"),
    "contiguous_memory_optimization": ignored(
        "activations in DRAM take one pinned block already (activations.dram_bytes)"),
    "number_checkpoints": ignored(OWN_CHECKPOINTING),
    "synchronize_checkpoint_boundary": ignored(
        "a profiling aid; tiered's timeline is trace.path"),
    "profile": ignored("tiered's timeline of every phase is trace.path"),
}
"""DeepSpeed's activation checkpointing section: its checkpointing API is the model's to call,
so only where the checkpoints are kept is a policy's. DeepSpeed keeps them in DRAM at most
(``cpu_checkpointing``); no key of its config puts them on NVMe, so none sets
``activations.tier: nvme``."""

MONITOR = "DeepSpeed's monitor: tiered writes none (Trainer: report_to)"

TOP_LEVEL = {
    "zero_optimization": lambda reader, key, value: reader.section(value, key, ZERO),
    "aio": lambda reader, key, value: reader.section(value, key, AIO),
    "bf16": lambda reader, key, value: reader.section(value, key, BF16),
    "bfloat16": lambda reader, key, value: reader.section(value, key, BF16),
    "fp16": lambda reader, key, value: reader.section(value, key, FP16),
    "activation_checkpointing": lambda reader, key, value: reader.section(
        value, key, ACTIVATION_CHECKPOINTING),
    "optimizer": _optimizer,
    "scheduler": _scheduler,
    "gradient_clipping": _clipping,
    "gradient_accumulation_steps": honoured(
        "optimizer.accumulation_steps", positive(as_whole_number),
        "backward calls per optimizer.step(); the script divides the loss by them, as "
        "DeepSpeed's engine.backward did"),
    "train_batch_size": _batch,
    "train_micro_batch_size_per_gpu": _batch,
    "steps_per_print": ignored("tiered prints no step log: the script's own (Trainer: "
                               "logging_steps)"),
    "wall_clock_breakdown": ignored("tiered's timeline of every phase is trace.path (or "
                                    "TIERED_TRACE=trace.json)"),
    "memory_breakdown": ignored("engine.plan_report() and `tiered plan` give the bytes of "
                                "each tier"),
    "zero_allow_untested_optimizer": ignored("the optimizer is tiered's own AdamW"),
    "zero_force_ds_cpu_optimizer": ignored("the CPU update is tiered's own AdamW"),
    "prescale_gradients": default_only(False, "tiered averages gradients in its "
                                       "reduce-scatter"),
    "gradient_predivide_factor": default_only(1.0, "tiered averages gradients in its "
                                              "reduce-scatter"),
    "amp": lambda reader, key, value: (
        default_only(False, "NVIDIA Apex AMP: use bf16 or fp16")(reader, f"{key}.enabled",
                                                                  enabled(value))),
    "tensorboard": ignored(MONITOR),
    "wandb": ignored(MONITOR),
    "csv_monitor": ignored(MONITOR),
    "comet": ignored(MONITOR),
    "flops_profiler": ignored(MONITOR),
    "comms_logger": ignored(MONITOR),
}
"""How each top-level key is read; a key not here is refused by name."""


def read_defaults(reader: Reader) -> None:
    """What the file leaves out and DeepSpeed's default decides (see [Note: a DeepSpeed
    config runs as it is])."""
    zero = reader.data.get("zero_optimization")
    if zero is None or (isinstance(zero, Mapping) and "stage" not in zero):
        reader.refuse("zero_optimization.stage", "is not given (DeepSpeed's default: 0, no "
                      "ZeRO); tiered runs ZeRO stage 3: set \"stage\": 3")
    if isinstance(zero, Mapping):
        for offload in ("offload_param", "offload_optimizer"):
            if offload not in zero:
                _offload_device(reader, f"zero_optimization.{offload}.device", "none",
                                given=False)
    if not half_precision(reader.data):
        reader.set("bf16.enabled", None, "compute_dtype", "fp32",
                   "neither bf16 nor fp16 is enabled: DeepSpeed computes in fp32")
    fp16 = reader.data.get("fp16")
    if (isinstance(fp16, Mapping) and enabled(fp16) in (True, AUTO)
            and "loss_scale_window" not in fp16):
        reader.set("fp16.loss_scale_window", None, "loss_scale.growth_interval", 1000,
                   "DeepSpeed's default")
