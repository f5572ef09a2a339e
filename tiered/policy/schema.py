"""The schema machinery under the policy: a tree of frozen dataclasses built from a mapping (YAML
or a dict) and checked for plain values given where a section or an enum belongs. Generic over
the section classes, which live in policy.py; a field's metadata says how its value parses
(``parse``) or which section class a list holds (``items``).
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import enum
import typing
from typing import Any, Mapping

from ..core.errors import PolicyError


def _structured_kind(hint: Any) -> type | None:
    """The enum or section class a field's type names (``Tier | None`` names Tier), if any."""
    for kind in typing.get_args(hint) or (hint,):
        if isinstance(kind, type) and (issubclass(kind, enum.Enum)
                                       or dataclasses.is_dataclass(kind)):
            return kind
    return None


def plain_value_in(section: Any, prefix: str = "") -> tuple[str, Any, type] | None:
    """(key path, value, expected class) of the first field of ``section`` or of the sections it
    holds whose type is an enum or a section but whose value is not one (``"bf16"``,
    ``{"tier": "nvme"}``), or None."""
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        value, key = getattr(section, f.name), prefix + f.name
        if "items" in f.metadata:
            entries = [(f"{key}[{i}]", item, f.metadata["items"]) for i, item in enumerate(value)]
        elif value is None and type(None) in typing.get_args(hints[f.name]):
            entries = []
        else:
            entries = [(key, value, _structured_kind(hints[f.name]))]
        for path, item, kind in entries:
            if kind is not None and not isinstance(item, kind):
                return path, item, kind
            if dataclasses.is_dataclass(item):
                inner = plain_value_in(item, path + ".")
                if inner is not None:
                    return inner
    return None


def plain_value_message(key: str, value: Any, kind: type) -> str:
    """The refusal of ``value`` at ``key``, with the ``from_dict`` call that takes it."""
    example = value
    for name in reversed(key.split(".")):  # "params.tier" -> {"params": {"tier": value}}
        name, index, _ = name.partition("[")
        example = {name: [example] if index else example}
    return (f"tiered.Policy: {key} must be a {kind.__name__}, got {value!r}; plain values (as "
            f"in YAML) go through Policy.from_dict({example!r})")


def merge(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Deep merge: nested mappings merge key by key, anything else replaces."""
    out = copy.deepcopy(dict(base))
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def build(cls, data: Any, key_path: str, source: str):
    """An instance of the section class ``cls`` from the mapping ``data`` found at ``key_path`` of
    ``source``: unknown keys (with the nearest allowed one), values that do not parse and the
    class's own checks are each a PolicyError naming the source and the key, every one found
    raised at once, a line each (a user fixes them all in one pass, not one a run)."""
    if not isinstance(data, Mapping):
        raise PolicyError(f"{source}: {key_path or 'the top level'} must be a mapping, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    errors, values = [], {}
    for name, value in data.items():
        child_path = f"{key_path}.{name}" if key_path else str(name)
        if name not in fields:
            near = difflib.get_close_matches(str(name), fields, n=1)
            hint = f" did you mean {near[0]!r}?" if near else ""
            errors.append(f"{source}: unknown key {child_path!r};{hint} allowed here: "
                          f"{', '.join(fields)}")
            continue
        try:
            values[name] = _convert(fields[name], value, child_path, source)
        except _Errors as e:
            errors.extend(e.lines)
        except PolicyError as e:
            errors.append(str(e))
    if len(errors) > 1 and not key_path:
        raise PolicyError(f"{len(errors)} errors:\n" + "\n".join(errors))
    if errors:
        raise _Errors(errors)
    try:
        return cls(**values)
    except (ValueError, TypeError) as e:
        raise PolicyError(f"{source}: {key_path + ': ' if key_path else ''}{e}") from None


class _Errors(PolicyError):
    """What a section found, a line each: its enclosing sections add theirs."""

    def __init__(self, lines: list[str]):
        super().__init__("\n".join(lines))
        self.lines = lines


def _convert(f: dataclasses.Field, value: Any, key_path: str, source: str):
    """The field ``f``'s value from its plain form: a section, a list of sections, an enum's
    member, or what the field's ``parse`` makes of it."""
    default = f.default if f.default is not dataclasses.MISSING else None
    if dataclasses.is_dataclass(default):
        return build(type(default), value, key_path, source)
    if "items" in f.metadata:  # a list of sections; null is an empty one
        if value is None:
            return ()
        if not isinstance(value, (list, tuple)):
            raise PolicyError(f"{source}: {key_path} must be a list of mappings, got {value!r}")
        return tuple(build(f.metadata["items"], item, f"{key_path}[{i}]", source)
                     for i, item in enumerate(value))
    try:
        if isinstance(default, enum.Enum):
            return type(default)(value)
        return f.metadata["parse"](value)
    except (ValueError, TypeError) as e:  # a parser's TypeError (e.g. null) is a policy error too
        if isinstance(default, enum.Enum):
            allowed = " | ".join(m.value for m in type(default))
            raise PolicyError(f"{source}: {key_path} is {value!r}; allowed: {allowed}") from None
        raise PolicyError(f"{source}: {key_path}: {e}") from None
