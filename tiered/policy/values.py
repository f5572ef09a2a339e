"""Single values of a policy: how a YAML (or code-given) value becomes a field's type.

Each parser raises ValueError saying what was expected and what was given; the policy's builder
adds the file and key path. They refuse what plain ``float()``, ``int()`` and ``str()`` would let
through silently (YAML's ``yes`` as 1.0, NaN past every range check, 2.5 truncated to 2, ``5`` as
the path "5").
"""
from __future__ import annotations

import math
import os

from ..core.sizes import parse_size


def as_number(value: object, expected: str = "a number") -> float:
    """A finite number. Plain ``float()`` let YAML's ``yes``/``on`` (True) through as 1.0 and
    ``.nan`` through every range check (NaN compares false), raised TypeError (not
    PolicyError) for null or a list, and said only "could not convert string to float" for
    ``fast``."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"expected {expected}, got {value!r}")
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"expected {expected}, got {value!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"expected a finite number, got {value!r}")
    return number


def as_norm_bound(value: object) -> float:
    """A gradient norm bound: a finite number, or infinity (YAML ``.inf``), which measures the
    norm and never clips, as ``clip_grad_norm_(max_norm=inf)`` does (Hugging Face's Trainer logs
    ``grad_norm`` so when it does not clip)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == math.inf:
        return math.inf
    if isinstance(value, str) and value.strip().lower() in ("inf", ".inf", "infinity"):
        return math.inf
    return as_number(value, "a number or .inf")


def as_whole_number(value: object) -> int:
    """A whole number; ``int()`` silently truncated 2.5 to 2 and raised TypeError for null."""
    number = as_number(value, expected="a whole number")
    if not number.is_integer():
        raise ValueError(f"expected a whole number, got {value!r}")
    return int(number)


def keep_path_as_string(section) -> None:
    """A section's ``path`` as a string also when the section is built in code with a
    ``pathlib.Path`` (to_dict must give plain values: checkpoints write it as JSON)."""
    if section.path is not None:
        object.__setattr__(section, "path", as_path(section.path))


def as_path(value: object) -> str:
    """A path: a string, or a ``pathlib.Path`` given in code. ``str()`` made ``5`` and ``[a]``
    the paths "5" and "['a']"."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise ValueError(f"expected a path (a string), got {value!r}")
    return value


def as_bool(value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    return value


def as_size_or_none(value: object) -> int | None:
    return None if value is None else parse_size(value)


def as_betas(value: object) -> tuple[float, float]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ValueError(f"expected two numbers [beta1, beta2], got {value!r}")
    return as_number(value[0]), as_number(value[1])


def as_class_names(value: object) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"expected a list of module class names, got {value!r}")
    return tuple(value)


def parsed_by(fn):
    """Field metadata: how to turn the YAML value into the field's type."""
    return {"parse": fn}


def optional(parse):
    """Field metadata: null, or what ``parse`` makes of the value."""
    return parsed_by(lambda v: None if v is None else parse(v))
