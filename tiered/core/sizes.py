"""Byte sizes as people write them ("64GiB", "1.5 GB", 4096) and as messages print them."""
from __future__ import annotations

import re
from decimal import Decimal

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(-?)\s*(\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)\s*([a-zA-Z]*)\s*$")
"""A sign, a number (exponent notation too: PyYAML reads ``1e9`` as the string "1e9", YAML 1.2
and JSON as a number, and a size must mean the same bytes whichever read it), and a unit."""


def _negative(value: object) -> ValueError:
    return ValueError(f"a byte size must not be negative, got {value!r}")


def parse_size(value: object) -> int:
    """Bytes from an int or a string such as ``"70GiB"``; raises ValueError with what is allowed."""
    if isinstance(value, bool):
        raise ValueError(f"expected a byte size, got {value!r}")
    if isinstance(value, (int, float)) and value < 0:
        raise _negative(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        match = _SIZE.match(value)
        if match and match.group(3).lower() in _UNITS:
            if match.group(1):
                raise _negative(value)
            # Decimal, not float: float("8.2") * 10**6 is 8199999.999..., which int() truncated
            # to 8199999 bytes; decimal arithmetic gives the exact 8200000.
            size = Decimal(match.group(2)) * _UNITS[match.group(3).lower()]
            if size != size.to_integral_value():  # "0.5B", "1e-3": no size
                raise ValueError(f"a byte size is a whole number of bytes, got {value!r}")
            return int(size)
    raise ValueError(
        f"expected a byte size such as 4096, \"512MiB\" or \"1.5GB\", got {value!r} "
        f"(units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")


def format_size(nbytes: int) -> str:
    """``1536 -> '1.50 KiB'``; exact bytes below 1 KiB."""
    if nbytes < 1024:
        return f"{nbytes} B"
    scaled = float(nbytes)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        scaled /= 1024
        if scaled < 1024 or unit == "TiB":
            return f"{scaled:.2f} {unit}"
    raise AssertionError("unreachable")


def align_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def even_pieces(total: int, most: int, align: int) -> list[tuple[int, int]]:
    """(start, count) of as few pieces of ``total`` elements as hold at most ``most`` each, of
    nearly equal size (no stray remainder of a few elements), every start a multiple of
    ``align``, which ``most`` must be too (O_DIRECT offsets)."""
    if total == 0:
        return []
    count = -(-total // most)
    size = min(most, align_up(-(-total // count), align))
    return [(start, min(size, total - start)) for start in range(0, total, size)]
