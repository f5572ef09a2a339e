"""How a DeepSpeed config's keys are read (see [Note: a DeepSpeed config runs as it is] in
deepspeed.py): the reader of a file's sections and the kinds of handler a key has, each setting
the policy key that means the same, noting why a key is ignored or left to the training script,
or refusing it by name. The tables of handlers, a section each, are deepspeed_sections.py's.
"""
from __future__ import annotations

import difflib
import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from .schema import merge

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


def half_precision(data: Mapping[str, Any]) -> bool:
    """Whether bf16 or fp16 is enabled, or ``"auto"`` (the trainer's to decide); else DeepSpeed
    computes in fp32."""
    return any(enabled(data.get(name)) in (True, AUTO) for name in ("bf16", "bfloat16", "fp16"))


def enabled(section: Any) -> Any:
    return section.get("enabled", False) if isinstance(section, Mapping) else False


INVALID = object()
"""A value that did not parse (its error is recorded)."""


class Reader:
    """The translation under way: the policy mapping, the notes and the refusals."""

    def __init__(self, source: str, data: Mapping[str, Any]):
        self.source, self.data = source, data
        self.element_bytes = 2 if half_precision(data) else 4
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
        """``parse(value)``, or INVALID with the error recorded under ``key``."""
        try:
            return parse(value)
        except (ValueError, TypeError) as e:
            self.refuse(key, f"is {value!r}: {e}")
            return INVALID


# -- handlers: each takes the reader, the key's dotted path and its value ------------------------

def ignored(why: str) -> Callable:
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


def given_value(reader: Reader, key: str, value: Any, parse: Callable[[Any], Any]) -> Any:
    """``value`` parsed; INVALID where it is ``"auto"`` (noted as _auto says) or does not
    parse (its error recorded)."""
    if value == AUTO:
        _auto(reader, key, value)
        return INVALID
    return reader.parse(key, value, parse)


def default_only(default: Any, refusal: str) -> Callable:
    """A key tiered takes at DeepSpeed's default only (doing the same), refusing another."""
    def handle(reader: Reader, key: str, value: Any) -> None:
        if value is default if isinstance(default, bool) else (
                value == default and not isinstance(value, bool)):
            reader.note(key, value, Fate.IGNORED, "DeepSpeed's default, which tiered does too")
        else:
            reader.refuse(key, f"is {shown(value)}: {refusal} (allowed: {shown(default)})")
    return handle


def honoured(tiered_key: str, parse: Callable[[Any], Any], why: str = "",
             convert: Callable[[Any], Any] = lambda v: v) -> Callable:
    """A key that sets ``tiered_key`` to ``convert(parse(value))``; ``"auto"`` leaves it."""
    def handle(reader: Reader, key: str, value: Any) -> None:
        parsed = given_value(reader, key, value, parse)
        if parsed is not INVALID:
            if key in SCRIPT_VALUES:
                reader.script_values[key] = value
            reader.set(key, value, tiered_key, convert(parsed), why)
    return handle


def positive(parse: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def checked(value: Any) -> Any:
        number = parse(value)
        if number <= 0:
            raise ValueError(f"expected a number > 0, got {value!r}")
        return number
    return checked
