"""A DeepSpeed config (``ds_config.json``) read as a tiered policy.

[Note: a DeepSpeed config runs as it is]
A file whose keys are DeepSpeed's (``zero_optimization``, ``bf16``, ``train_batch_size``, an
``optimizer`` with a ``type``, ...) is translated into the policy mapping a YAML file would give,
which config.py then builds into the same frozen Policy. Every key of the file meets one of
three fates, each said in a note (``tiered check-policy`` and ``tiered policy from-deepspeed``
print them as comments):
- honoured: it sets the policy key that means the same (``offload_param.device: cpu`` is
  ``params.tier: dram``; ``stage3_prefetch_bucket_size`` elements are ``prefetch.hbm_bytes``);
- ignored, with the reason: tiered does that itself or has no such knob (buffer counts and sizes
  the engine sizes itself, bucket sizes where each unit is its own bucket);
- left to the training script: values a policy does not hold (batch sizes, the scheduler) and
  ``"auto"``, which Hugging Face's integration fills from the TrainingArguments as
  TieredTrainer does (tiered's defaults elsewhere).
What tiered does not offer (ZeRO stage 1 or 2, another optimizer than Adam/AdamW, static loss
scaling, a key it does not know) is refused by name, every refusal at once, as schema.py reports
a YAML's errors. A key the file leaves out takes DeepSpeed's default where that changes the math
(fp32 without bf16 or fp16, no offload: the GPU, fp16's loss_scale_window 1000) and tiered's own
where it is only speed or memory (aio.queue_depth, sub_group_size).
How each key is read is deepspeed_sections.py's, a table per section; here a file is recognized,
translated, written as YAML and its values compared with a training script's.
"""
from __future__ import annotations

import json
import os
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from ..core.errors import PolicyError
from .deepspeed_keys import SCRIPT_VALUES, Fate, Note, Reader, shown
from .deepspeed_sections import TOP_LEVEL, read_defaults
from .file import read_yaml

DEEPSPEED_ENV = "TIERED_DEEPSPEED_CONFIG"
"""The DeepSpeed config ``tiered-launch --policy`` named, for the ranks: TieredTrainer holds its
explicit values to the TrainingArguments, as Hugging Face's integration does."""

TIERED_SECTIONS = ("compute_dtype", "device", "params", "grads", "optimizer", "nvme", "hbm",
                   "dram", "loss_scale", "units", "cpu", "prefetch", "activations", "trace",
                   "tiling")
"""A tiered policy's top-level keys in the schema's order, the order a translation is written
in (config.py's Policy fields; it imports this module, so they are listed here)."""


@dataclass(frozen=True)
class Translation:
    """A DeepSpeed config as a tiered policy: ``policy`` in the schema's plain form (what
    Policy.from_dict takes), a note for each key, and the file's explicit values of the keys a
    training script sets too (SCRIPT_VALUES)."""

    source: str
    policy: dict[str, Any]
    notes: tuple[Note, ...]
    script_values: dict[str, Any]

    def comments(self) -> str:
        """The notes as YAML comments, grouped by fate."""
        lines = [f"# {self.source} is a DeepSpeed config. What became of each key:"]
        for fate in Fate:
            notes = [note for note in self.notes if note.fate is fate]
            if notes:
                lines.append(f"# {fate.value.capitalize()}:")
            for note in notes:
                lines += textwrap.wrap(note.line(), 96, initial_indent="#   ",
                                       subsequent_indent="#       ")
        return "".join(f"{line}\n" for line in lines)

    def yaml(self) -> str:
        """The policy as a YAML file, the notes as its comments: it resolves to the same
        Policy as the DeepSpeed file."""
        body = yaml.safe_dump(self.policy, sort_keys=False, default_flow_style=None) \
            if self.policy else ""
        return self.comments() + body

    def summary(self) -> list[str]:
        """What a launch says of the file: each value left to the training script, and how
        many keys were honoured and ignored."""
        count = {fate: sum(note.fate is fate for note in self.notes) for fate in Fate}
        total = (f"{self.source}: a DeepSpeed config, {count[Fate.HONOURED]} keys honoured, "
                 f"{count[Fate.IGNORED]} ignored (`tiered policy from-deepspeed {self.source}` "
                 f"says why, each)")
        return [note.line() for note in self.notes if note.fate is Fate.SCRIPT] + [total]


DEEPSPEED_KEYS = frozenset(TOP_LEVEL) - {"optimizer"}
"""Top-level keys of a DeepSpeed config that no tiered policy has."""


def is_deepspeed_config(data: Mapping[str, Any]) -> bool:
    """Whether ``data`` (a file's top-level mapping) is a DeepSpeed config: a key of DeepSpeed's
    that a tiered policy lacks, or an optimizer given as DeepSpeed gives it (type, params)."""
    optimizer = data.get("optimizer")
    return any(key in DEEPSPEED_KEYS for key in data) or (
        isinstance(optimizer, Mapping) and bool({"type", "params"} & set(optimizer)))


def read_policy_file(path: str | os.PathLike) -> dict[str, Any]:
    """A policy file's mapping in tiered's schema: a YAML policy as it is, a DeepSpeed config
    translated (every refusal a PolicyError naming the file and the key)."""
    translation = read_deepspeed(path)
    return read_yaml(path) if translation is None else translation.policy


def read_deepspeed(path: str | os.PathLike) -> Translation | None:
    """The translation of the DeepSpeed config at ``path``; None for a tiered policy file."""
    data = read_yaml(path)  # its errors (a missing file, a key given twice) said as a policy's
    if not is_deepspeed_config(data):
        return None
    try:  # DeepSpeed reads JSON, whose 3e-5 YAML 1.1 takes for a string
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except ValueError:
        pass  # a DeepSpeed config written as YAML
    return translate(data, str(path))


def translate(data: Mapping[str, Any], source: str) -> Translation:
    """The tiered policy of the DeepSpeed config ``data`` read from ``source``; a PolicyError
    with every refusal of the file, a line each, naming the key and what is allowed."""
    reader = Reader(source, data)
    # A tiered key in a DeepSpeed config is a mix of the two, said as such (not as a DeepSpeed
    # key tiered does not know); "optimizer" is both's.
    mixed = [key for key in data if key in TIERED_SECTIONS and key != "optimizer"]
    for key in mixed:
        reader.refuse(repr(key), "is a tiered policy key, in a DeepSpeed config: a policy file "
                      "is one or the other (tiered policy from-deepspeed writes this one's "
                      "policy as YAML, to add tiered keys to)")
    reader.section({k: v for k, v in data.items() if k not in mixed}, "", TOP_LEVEL)
    read_defaults(reader)
    if reader.errors:
        lines = reader.errors
        raise PolicyError(lines[0] if len(lines) == 1 else f"{len(lines)} errors:\n"
                          + "\n".join(lines))
    ordered = {key: reader.policy[key] for key in TIERED_SECTIONS if key in reader.policy}
    return Translation(source, ordered, tuple(reader.notes), reader.script_values)


def mismatches(translation: Translation, script: Mapping[str, Any]) -> list[str]:
    """The DeepSpeed values that differ from the training script's, ``script`` keyed as
    SCRIPT_VALUES (Hugging Face's integration refuses these the same way)."""
    found = []
    for key, value in translation.script_values.items():
        if key in script and not _same(value, script[key]):
            found.append(f"{key} is {shown(value)} in {translation.source} but "
                         f"{SCRIPT_VALUES[key]} is {shown(script[key])}: set one to the other, "
                         f"or \"auto\" in the config")
    return found


def _same(config: Any, script: Any) -> bool:
    if isinstance(config, (list, tuple)):
        return list(map(float, config)) == list(map(float, script))
    return config == script


