"""How each key of a DeepSpeed config is read (see [Note: a DeepSpeed config runs as it is] in
deepspeed.py): a table of handlers per section, each handler setting the policy key that means
the same, noting why a key is ignored or left to the training script, or refusing it by name.
"""
from __future__ import annotations

import difflib
import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import yaml

from ..tiers.moments import piece_granule
from .schema import merge
from .values import as_betas, as_bool, as_number, as_path, as_whole_number

AUTO = "auto"
"""The value Hugging Face's DeepSpeed integration fills from the TrainingArguments."""

SCRIPT_VALUES = {
    "optimizer.params.lr": "learning_rate",
    "optimizer.params.betas": "adam_beta1, adam_beta2",
    "optimizer.params.eps": "adam_epsilon",
    "optimizer.params.weight_decay": "weight_decay",
    "gradient_clipping": "max_grad_norm",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "train_micro_batch_size_per_gpu": "per_device_train_batch_size",
    "train_batch_size": "world size x per_device_train_batch_size x gradient_accumulation_steps",
    "bf16.enabled": "bf16",
    "fp16.enabled": "fp16",
}
"""DeepSpeed keys a training script sets too, with the TrainingArguments that Hugging Face's
integration fills an ``"auto"`` from (and requires an explicit value to equal)."""


class Fate(str, enum.Enum):
    HONOURED = "honoured"
    IGNORED = "ignored"
    SCRIPT = "left to the training script"


@dataclass(frozen=True)
class Note:
    """What became of one DeepSpeed key (``value`` None: the file leaves it out)."""

    key: str
    value: Any
    fate: Fate
    says: str

    def line(self) -> str:
        given = "not given" if self.value is None else shown(self.value)
        return f"{self.key}: {given}: {self.says}"


def shown(value: Any) -> str:
    """A value as a config writes it (true, not True)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


def _half_precision(data: Mapping[str, Any]) -> bool:
    """Whether bf16 or fp16 is enabled, or ``"auto"`` (the trainer's to decide); else DeepSpeed
    computes in fp32."""
    return any(_enabled(data.get(name)) in (True, AUTO) for name in ("bf16", "bfloat16", "fp16"))


def _enabled(section: Any) -> Any:
    return section.get("enabled", False) if isinstance(section, Mapping) else False


_INVALID = object()
"""A value that did not parse (its error is recorded)."""


class Reader:
    """The translation under way: the policy mapping, the notes and the refusals."""

    def __init__(self, source: str, data: Mapping[str, Any]):
        self.source, self.data = source, data
        self.element_bytes = 2 if _half_precision(data) else 4
        """Bytes of a compute-dtype element, for the knobs DeepSpeed counts in elements."""
        self.policy: dict[str, Any] = {}
        self.notes: list[Note] = []
        self.errors: list[str] = []
        self.script_values: dict[str, Any] = {}

    def at(self, path: str) -> Any:
        """The file's value at the dotted ``path``, None where there is none: a key's meaning
        may hang on another's, wherever that one stands in the file."""
        value: Any = self.data
        for name in path.split("."):
            value = value.get(name) if isinstance(value, Mapping) else None
        return value

    def section(self, data: Any, path: str, table: Mapping[str, Callable]) -> None:
        """Every key of the mapping ``data`` at ``path`` by its handler in ``table``."""
        if not isinstance(data, Mapping):
            self.refuse(path or "the top level", f"must be a mapping, got {data!r}")
            return
        for name, value in data.items():
            key = f"{path}.{name}" if path else str(name)
            handler = table.get(name)
            if handler is None:
                near = difflib.get_close_matches(str(name), table, n=1)
                hint = f" did you mean {near[0]!r}?" if near else ""
                self.errors.append(f"{self.source}: DeepSpeed key {key!r} is not one tiered "
                                   f"reads;{hint} allowed here: {', '.join(table)}")
            else:
                handler(self, key, value)

    def set(self, key: str, value: Any, tiered_key: str, tiered_value: Any,
            why: str = "") -> None:
        """``tiered_key`` (dotted) of the policy takes ``tiered_value``, from ``key``."""
        nested = tiered_value
        for name in reversed(tiered_key.split(".")):
            nested = {name: nested}
        self.policy = merge(self.policy, nested)
        written = yaml.safe_dump(tiered_value, default_flow_style=True).strip().removesuffix(
            "\n...")  # how YAML ends a document of one scalar
        self.notes.append(Note(key, value, Fate.HONOURED,
                               f"{tiered_key}: {written}" + (f" ({why})" if why else "")))

    def note(self, key: str, value: Any, fate: Fate, says: str) -> None:
        self.notes.append(Note(key, value, fate, says))

    def refuse(self, key: str, message: str) -> None:
        self.errors.append(f"{self.source}: {key} {message}")

    def parse(self, key: str, value: Any, parse: Callable[[Any], Any]) -> Any:
        """``parse(value)``, or _INVALID with the error recorded under ``key``."""
        try:
            return parse(value)
        except (ValueError, TypeError) as e:
            self.refuse(key, f"is {value!r}: {e}")
            return _INVALID

    def defaults(self) -> None:
        """What the file leaves out and DeepSpeed's default decides (see [Note: a DeepSpeed
        config runs as it is])."""
        zero = self.data.get("zero_optimization")
        if zero is None or (isinstance(zero, Mapping) and "stage" not in zero):
            self.refuse("zero_optimization.stage", "is not given (DeepSpeed's default: 0, no "
                        "ZeRO); tiered runs ZeRO stage 3: set \"stage\": 3")
        if isinstance(zero, Mapping):
            for offload in ("offload_param", "offload_optimizer"):
                if offload not in zero:
                    _offload_device(self, f"zero_optimization.{offload}.device", "none",
                                    given=False)
        if not _half_precision(self.data):
            self.set("bf16.enabled", None, "compute_dtype", "fp32",
                     "neither bf16 nor fp16 is enabled: DeepSpeed computes in fp32")
        fp16 = self.data.get("fp16")
        if (isinstance(fp16, Mapping) and _enabled(fp16) in (True, AUTO)
                and "loss_scale_window" not in fp16):
            self.set("fp16.loss_scale_window", None, "loss_scale.growth_interval", 1000,
                     "DeepSpeed's default")


# -- handlers: each takes the reader, the key's dotted path and its value ------------------------

def _ignored(why: str) -> Callable:
    return lambda reader, key, value: reader.note(key, value, Fate.IGNORED, why)


def _auto_note(key: str) -> str:
    return (f"TieredTrainer takes TrainingArguments' {SCRIPT_VALUES[key]}, as Hugging Face's "
            f"integration fills \"auto\"; elsewhere tiered's default, or what the script "
            f"gives initialize")


def _auto(reader: Reader, key: str, value: Any) -> None:
    """``"auto"``: the trainer's value for a key a script sets too, else tiered's own."""
    if key in SCRIPT_VALUES:
        reader.note(key, value, Fate.SCRIPT, _auto_note(key))
    else:
        reader.note(key, value, Fate.IGNORED, "tiered's own value")


def _given(reader: Reader, key: str, value: Any, parse: Callable[[Any], Any]) -> Any:
    """``value`` parsed; _INVALID where it is ``"auto"`` (noted as _auto says) or does not
    parse (its error recorded)."""
    if value == AUTO:
        _auto(reader, key, value)
        return _INVALID
    return reader.parse(key, value, parse)


def _default_only(default: Any, refusal: str) -> Callable:
    """A key tiered takes at DeepSpeed's default only (doing the same), refusing another."""
    def handle(reader: Reader, key: str, value: Any) -> None:
        if value is default if isinstance(default, bool) else (
                value == default and not isinstance(value, bool)):
            reader.note(key, value, Fate.IGNORED, "DeepSpeed's default, which tiered does too")
        else:
            reader.refuse(key, f"is {shown(value)}: {refusal} (allowed: {shown(default)})")
    return handle


def _honoured(tiered_key: str, parse: Callable[[Any], Any], why: str = "",
              convert: Callable[[Any], Any] = lambda v: v) -> Callable:
    """A key that sets ``tiered_key`` to ``convert(parse(value))``; ``"auto"`` leaves it."""
    def handle(reader: Reader, key: str, value: Any) -> None:
        parsed = _given(reader, key, value, parse)
        if parsed is not _INVALID:
            if key in SCRIPT_VALUES:
                reader.script_values[key] = value
            reader.set(key, value, tiered_key, convert(parsed), why)
    return handle


def _positive(parse: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def checked(value: Any) -> Any:
        number = parse(value)
        if number <= 0:
            raise ValueError(f"expected a number > 0, got {value!r}")
        return number
    return checked


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
    if path is _INVALID:
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
    "pin_memory": _ignored(PINNED),
    "buffer_count": _ignored("the engine sizes its read-ahead buffers itself (prefetch)"),
    "buffer_size": _ignored("the engine sizes its read-ahead buffers itself (prefetch)"),
    "max_in_cpu": _ignored("NVMe weights are read into pinned buffers ahead of their gather "
                           "(prefetch.dram_bytes), not cached in DRAM"),
}


def _sub_group_size(reader: Reader, key: str, value: Any) -> None:
    if reader.at("zero_optimization.offload_optimizer.device") != "nvme":
        reader.note(key, value, Fate.IGNORED, "tiered's sub-groups are the pieces optimizer "
                    "states stream from NVMe in; the CPU or GPU update steps each unit whole")
        return
    elements = _given(reader, key, value, _positive(as_number))
    if elements is _INVALID:
        return
    moments = torch.bfloat16 if reader.at("bf16.bf16_optimizer_states") is True else torch.float32
    granule = piece_granule([torch.float32, moments])
    rounded = max(granule, int(elements) // granule * granule)
    why = "" if rounded == elements else f"rounded to whole {granule}-element blocks"
    reader.set(key, value, "optimizer.sub_group_size", rounded, why)


OFFLOAD_OPTIMIZER = {
    "device": _offload_device,
    "nvme_path": _nvme_path,
    "pin_memory": _ignored(PINNED),
    "buffer_count": _ignored("optimizer states stream through three pinned buffer sets "
                             "(read ahead, stepped, written back), sized by sub_group_size"),
    "fast_init": _ignored("the engine sets up its NVMe optimizer states itself"),
    "pipeline_read": _ignored("NVMe reads of optimizer states overlap the update, always"),
    "pipeline_write": _ignored("NVMe writes of optimizer states overlap the update, always"),
    "ratio": _default_only(1, "tiered steps every offloaded state on the CPU; a policy's "
                           "tier: auto keeps whole units on the GPU as its budget allows"),
}


def _prefetch_bucket(reader: Reader, key: str, value: Any) -> None:
    if value == AUTO:
        reader.note(key, value, Fate.IGNORED, "tiered's own: twice the largest module's bytes "
                    "(prefetch.hbm_bytes: null)")
        return
    elements = reader.parse(key, value, as_whole_number)
    if elements is _INVALID:
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
    "overlap_comm": _ignored("tiered overlaps always: each unit's reduce-scatter and copy off "
                             "the device run on a side stream as soon as its gradient is whole"),
    "contiguous_gradients": _ignored("each unit's gradient is one flat buffer already"),
    "reduce_bucket_size": _ignored(OWN_UNITS),
    "allgather_bucket_size": _ignored(OWN_UNITS),
    "allgather_partitions": _ignored(OWN_UNITS),
    "reduce_scatter": _ignored(OWN_UNITS),
    "stage3_prefetch_bucket_size": _prefetch_bucket,
    "stage3_max_live_parameters": _ignored(
        "tiered holds the units in use and prefetch.hbm_bytes of those ahead; hbm.budget "
        "bounds the rest"),
    "stage3_max_reuse_distance": _ignored(
        "a unit stays gathered while its module is among the next prefetch.depth modules of "
        "the recorded order (counted in modules, not parameters)"),
    "stage3_param_persistence_threshold": _ignored(
        "tiered partitions every parameter with its unit; a small one rides in its block's"),
    "stage3_module_granularity_threshold": _ignored(
        "tiered's units are the model's repeated blocks (units.classes)"),
    "sub_group_size": _sub_group_size,
    "stage3_gather_16bit_weights_on_model_save": _ignored(
        "engine.save_pretrained and TieredTrainer.save_model always gather the whole weights"),
    "stage3_gather_fp16_weights_on_model_save": _ignored(
        "engine.save_pretrained and TieredTrainer.save_model always gather the whole weights"),
    "round_robin_gradients": _ignored("a stage 1 and 2 setting in DeepSpeed"),
    "elastic_checkpoint": _ignored("a stage 1 and 2 setting in DeepSpeed"),
    "ignore_unused_parameters": _ignored("a stage 2 setting in DeepSpeed; tiered steps the "
                                         "parameters that got a gradient"),
    "load_from_fp32_weights": _ignored("tiered's checkpoints hold the fp32 master weights and "
                                       "load them"),
    "memory_efficient_linear": _ignored("a gathered unit's weights are freed after its "
                                        "forward whatever autograd saved, and gathered again "
                                        "for backward"),
    "log_trace_cache_warnings": _ignored("tiered says in its log when the recorded order "
                                         "changes"),
    "cpu_offload": _default_only(False, "the deprecated stage 1 and 2 form; use "
                                 "offload_optimizer"),
    "zero_quantized_weights": _default_only(False, "ZeRO++ quantized communication: tiered "
                                            "gathers weights unquantized"),
    "zero_quantized_gradients": _default_only(False, "ZeRO++ quantized communication: tiered "
                                              "reduces gradients unquantized"),
    "zero_hpz_partition_size": _default_only(1, "ZeRO++ hierarchical partitioning: tiered "
                                             "partitions over every rank"),
}

AIO = {
    "block_size": _honoured("nvme.block_size", as_whole_number),
    "queue_depth": _honoured("nvme.queue_depth", as_whole_number),
    "thread_count": _ignored("reads and writes each have their own threads, queue_depth "
                             "requests in flight"),
    "intra_op_parallelism": _ignored("reads and writes each have their own threads, "
                                     "queue_depth requests in flight"),
    "single_submit": _ignored("tiered keeps queue_depth requests in flight per direction"),
    "overlap_events": _ignored("tiered keeps queue_depth requests in flight per direction"),
    "use_gds": _default_only(False, "GPUDirect Storage: tiered reads NVMe into pinned DRAM"),
}


def _precision(dtype: str) -> Callable:
    def enabled(reader: Reader, key: str, value: Any) -> None:
        flag = _given(reader, key, value, as_bool)
        if flag is _INVALID:
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
    "immediate_grad_update": _ignored("tiered adds each gradient into its grads tier as it "
                                      "arrives"),
    "check_grad_overflow": _ignored("bf16 needs no loss scale; the update sees any inf"),
}


def _fp16_key(handle: Callable) -> Callable:
    """A loss-scale key: honoured when fp16 is on (or "auto"), ignored when it is off."""
    def when_on(reader: Reader, key: str, value: Any) -> None:
        if _enabled(reader.at("fp16")) in (True, AUTO):
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
    "auto_cast": _default_only(False, "tiered does not cast a model's inputs: cast them in "
                               "the script"),
    "loss_scale": _fp16_key(_loss_scale),
    "initial_scale_power": _fp16_key(_honoured("loss_scale.initial_scale", as_whole_number,
                                               convert=lambda power: float(2 ** power))),
    "loss_scale_window": _fp16_key(_honoured("loss_scale.growth_interval", as_whole_number)),
    "hysteresis": _fp16_key(_ignored("tiered halves the scale at every overflow (as "
                                     "torch.amp.GradScaler, hysteresis 1); the step is skipped "
                                     "either way")),
    "consecutive_hysteresis": _fp16_key(_ignored("tiered halves the scale at every overflow")),
    "min_loss_scale": _fp16_key(_ignored("tiered's dynamic scale has no floor")),
    "fp16_master_weights_and_grads": _default_only(False, "tiered keeps fp32 master weights "
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
    "lr": _honoured("optimizer.lr", _nonnegative(as_number)),
    "betas": _honoured("optimizer.betas", as_betas, convert=list),
    "eps": _honoured("optimizer.eps", _positive(as_number)),
    "weight_decay": _honoured("optimizer.weight_decay", _nonnegative(as_number)),
    "adam_w_mode": _adam_w_mode,
    "torch_adam": _ignored("tiered's own AdamW kernels, torch.optim.AdamW's update"),
    "amsgrad": _default_only(False, "AMSGrad's maximum of the second moment; tiered runs "
                             "AdamW"),
    "bias_correction": _default_only(True, "tiered's AdamW always corrects the moments' bias"),
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
    norm = _given(reader, key, value, _nonnegative(as_number))
    if norm is _INVALID:
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
    if _given(reader, key, value, _positive(as_whole_number)) is not _INVALID:
        reader.script_values[key] = value
        reader.note(key, value, Fate.SCRIPT, f"the batch is the script's data loader's "
                    f"(TieredTrainer's must equal it: {SCRIPT_VALUES[key]})")


MONITOR = "DeepSpeed's monitor: tiered writes none (Trainer: report_to)"

TOP_LEVEL = {
    "zero_optimization": lambda reader, key, value: reader.section(value, key, ZERO),
    "aio": lambda reader, key, value: reader.section(value, key, AIO),
    "bf16": lambda reader, key, value: reader.section(value, key, BF16),
    "bfloat16": lambda reader, key, value: reader.section(value, key, BF16),
    "fp16": lambda reader, key, value: reader.section(value, key, FP16),
    "optimizer": _optimizer,
    "scheduler": _scheduler,
    "gradient_clipping": _clipping,
    "gradient_accumulation_steps": _honoured(
        "optimizer.accumulation_steps", _positive(as_whole_number),
        "backward calls per optimizer.step(); the script divides the loss by them, as "
        "DeepSpeed's engine.backward did"),
    "train_batch_size": _batch,
    "train_micro_batch_size_per_gpu": _batch,
    "steps_per_print": _ignored("tiered prints no step log: the script's own (Trainer: "
                                "logging_steps)"),
    "wall_clock_breakdown": _ignored("tiered's timeline of every phase is trace.path (or "
                                     "TIERED_TRACE=trace.json)"),
    "memory_breakdown": _ignored("engine.plan_report() and `tiered plan` give the bytes of "
                                 "each tier"),
    "zero_allow_untested_optimizer": _ignored("the optimizer is tiered's own AdamW"),
    "zero_force_ds_cpu_optimizer": _ignored("the CPU update is tiered's own AdamW"),
    "prescale_gradients": _default_only(False, "tiered averages gradients in its "
                                        "reduce-scatter"),
    "gradient_predivide_factor": _default_only(1.0, "tiered averages gradients in its "
                                               "reduce-scatter"),
    "amp": lambda reader, key, value: (
        _default_only(False, "NVIDIA Apex AMP: use bf16 or fp16")(reader, f"{key}.enabled",
                                                                  _enabled(value))),
    "tensorboard": _ignored(MONITOR),
    "wandb": _ignored(MONITOR),
    "csv_monitor": _ignored(MONITOR),
    "comet": _ignored(MONITOR),
    "flops_profiler": _ignored(MONITOR),
    "comms_logger": _ignored(MONITOR),
}
"""How each top-level key is read; a key not here is refused by name."""
