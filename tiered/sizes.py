"""Byte sizes as people write them ("64GiB", "1.5 GB", 4096) and as messages print them."""
from __future__ import annotations

import re
from decimal import Decimal

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: object) -> int:
    """Bytes from an int or a string such as ``"70GiB"``; raises ValueError with what is allowed."""
    if isinstance(value, bool):
        raise ValueError(f"expected a byte size, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a byte size cannot be negative, got {value}")
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    if isinstance(value, str):
        match = _SIZE.match(value)
        if match and match.group(2).lower() in _UNITS:
            # Decimal, not float: float("8.2") * 10**6 is 8199999.999..., which int() truncated
            # to 8199999 bytes; decimal arithmetic gives the exact 8200000.
            number, unit = Decimal(match.group(1)), _UNITS[match.group(2).lower()]
            if unit == 1 and number != number.to_integral_value():  # "0.5B" is no size
                raise ValueError(f"a byte size is a whole number of bytes, got {value!r}")
            return int(number * unit)
    raise ValueError(
        f"expected a byte size such as 4096, \"512MiB\" or \"1.5GB\", got {value!r} "
        f"(units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")


def format_size(nbytes: int) -> str:
    """``1536 -> '1.50 KiB'``; exact bytes below 1 KiB."""
    if nbytes < 1024:
        return f"{nbytes} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        nbytes /= 1024
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:.2f} {unit}"
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
