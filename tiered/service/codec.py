"""Values as JSON and back, derived from their declared types: a dataclass's fields
(``dataclasses.fields``) or a method's parameters, so that a command or an event is written once,
as its dataclass or its Protocol method, and both ends of the wire follow it.

The types a message may hold: ``int``, ``float``, ``bool``, ``str``, a ``Literal`` of these, an
enum (by value), ``torch.dtype`` (by name), a dataclass of these (an object of its fields), a
class that writes itself as a plain mapping (``to_dict``) and reads itself back (``from_dict``,
as the Policy does: its YAML form), ``list``, ``tuple`` (``tuple[X, ...]``, or one type a
position) and ``dict`` of these (a dict as a list of pairs: JSON keys are strings only), a union
of these (``None`` included; encoded as the first alternative the value is, decoded as the first
that reads it), and ``Any``, a JSON value passed as it is. Decoding checks every value against
its type and raises ValueError naming the field that is wrong: a peer's message is data, never
trusted.
"""
from __future__ import annotations

import dataclasses
import enum
import inspect
import re
import types
import typing
from typing import Any, Callable

import torch

DTYPES = {str(dtype).removeprefix("torch."): dtype
          for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.uint8)}
"""The dtypes that cross: what a gradient or a buffer may hold."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def op_name(kind: type) -> str:
    """A message's ``op`` for a dataclass: its name in snake case (``GradientIn``:
    ``gradient_in``)."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", kind.__name__).lower()


_TYPES: dict[Any, dict[str, Any]] = {}
"""field_types' and parameter_types' answers, by dataclass or method (resolving the
annotations of ``from __future__ import annotations`` takes an eval each)."""


def field_types(kind: type) -> dict[str, Any]:
    """A dataclass's fields and their types, in declaration order."""
    if kind not in _TYPES:
        hints = typing.get_type_hints(kind)
        _TYPES[kind] = {field.name: hints[field.name] for field in dataclasses.fields(kind)}
    return _TYPES[kind]


def parameter_types(method: Callable) -> dict[str, Any]:
    """A method's parameters (past ``self``) and their types, in order."""
    if method not in _TYPES:
        hints = typing.get_type_hints(method)
        _TYPES[method] = {name: hints[name]
                          for name in list(inspect.signature(method).parameters)[1:]}
    return _TYPES[method]


def fields_to_wire(value: Any, skip: frozenset[str] = frozenset()) -> dict:
    """A dataclass's fields (but ``skip``) as a JSON object."""
    return {name: encode(getattr(value, name), kind)
            for name, kind in field_types(type(value)).items() if name not in skip}


def fields_from_wire(kind: type, message: dict, skip: frozenset[str] = frozenset()) -> Any:
    """The dataclass ``kind`` made from a message's fields (those in ``skip`` take their
    defaults)."""
    return kind(**{name: decode(message.get(name), hint, name)
                   for name, hint in field_types(kind).items() if name not in skip})


def encode(value: Any, kind: Any) -> Any:
    if value is None or kind is Any:
        return value
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        chosen = next((alt for alt in args if _is(value, alt)), None)
        if chosen is None:
            raise TypeError(f"{value!r} is none of {kind!r}")
        return encode(value, chosen)
    if origin in (list, tuple):
        return [encode(item, item_kind) for item, item_kind in zip(value, _item_kinds(kind, value))]
    if origin is dict:
        return [[encode(key, args[0]), encode(item, args[1])] for key, item in value.items()]
    if origin is typing.Literal or kind in (int, float, bool, str):
        return value
    if kind is torch.dtype:
        return dtype_name(value)
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(kind):
        return fields_to_wire(value)
    if _writes_itself(kind):
        return value.to_dict()
    raise TypeError(f"no wire form for {kind!r}")


def decode(value: Any, kind: Any, name: str) -> Any:
    """``value`` as a ``kind``; ``name`` says where it is, in an error."""
    if kind is Any:  # a JSON value its reader checks (a timeline span's arguments)
        return value
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for alt in args:
            if alt is type(None):  # not None: said above
                continue
            try:
                return decode(value, alt, name)
            except ValueError as error:
                errors.append(str(error))
        raise ValueError("; ".join(errors))
    if origin in (list, tuple):
        items = _list(value, name)
        kinds = _item_kinds(kind, items)
        if len(kinds) != len(items):
            raise ValueError(f"{name} should have {len(kinds)} items, got {value!r}")
        decoded = [decode(item, item_kind, f"{name}[{i}]")
                   for i, (item, item_kind) in enumerate(zip(items, kinds))]
        return decoded if origin is list else tuple(decoded)
    if origin is dict:
        pairs = [_list(pair, f"{name}[{i}]") for i, pair in enumerate(_list(value, name))]
        if any(len(pair) != 2 for pair in pairs):
            raise ValueError(f"{name} is not a list of pairs: {value!r}")
        return {decode(key, args[0], f"{name} key"): decode(item, args[1], f"{name}[{key!r}]")
                for key, item in pairs}
    if origin is typing.Literal:
        if value not in args:
            raise ValueError(f"{name} should be one of {list(args)}, got {value!r}")
        return value
    if kind is torch.dtype:
        if value not in DTYPES:
            raise ValueError(f"{name} is no dtype that crosses: {value!r}")
        return DTYPES[value]
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return kind(value)  # ValueError naming the value
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        if not isinstance(value, dict):
            raise ValueError(f"{name} is not an object: {value!r}")
        return kind(**{field: decode(value.get(field), hint, f"{name}.{field}")
                       for field, hint in field_types(kind).items()})
    if _writes_itself(kind):
        if not isinstance(value, dict):
            raise ValueError(f"{name} is not an object: {value!r}")
        return kind.from_dict(value)  # its own errors name the key (a PolicyError is one)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)  # JSON writes 1.0 as 1 in some encoders
    # bool is an int in Python; a unit of True is no unit.
    if kind in (int, float, bool, str) and type(value) is kind:
        return value
    raise ValueError(f"{name} should be {getattr(kind, '__name__', kind)}, got {value!r}")


def _is(value: Any, kind: Any) -> bool:
    """Whether ``value`` is a ``kind``, as far as choosing a union's alternative needs: the
    outer type, a literal's value, and a fixed tuple's items."""
    if kind is Any:
        return True
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        return any(_is(value, alt) for alt in args)
    if origin is typing.Literal:
        return value in args
    if origin is tuple:
        kinds = _item_kinds(kind, value) if isinstance(value, tuple) else []
        return (isinstance(value, tuple) and len(kinds) == len(value)
                and all(_is(item, item_kind) for item, item_kind in zip(value, kinds)))
    if origin is not None:
        return isinstance(value, origin)
    if kind is type(None):
        return value is None
    return isinstance(value, kind) and not (kind is int and isinstance(value, bool))


def _item_kinds(kind: Any, items: Any) -> list:
    """Each item's type: the one type of a list or a ``tuple[X, ...]``, else a position's."""
    args = typing.get_args(kind)
    if typing.get_origin(kind) is list or (len(args) == 2 and args[1] is Ellipsis):
        return [args[0]] * len(items)
    return list(args)


def _writes_itself(kind: Any) -> bool:
    return isinstance(kind, type) and hasattr(kind, "to_dict") and hasattr(kind, "from_dict")


def _list(value: Any, name: str) -> list:
    if not isinstance(value, list):
        raise ValueError(f"{name} is not a list: {value!r}")
    return value
