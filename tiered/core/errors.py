"""The exceptions a user of tiered can see.

Every message names the file, key, path or tier at fault and what would be accepted, so the
error is the whole clue; nothing here wraps a deep stack trace as the only explanation.
"""
from __future__ import annotations


class TieredError(Exception):
    """Base of every error tiered raises on purpose."""


class RankWent(TieredError):
    """A rank of the job went (stopped, failed or lost) before this rank's work with it was
    done. The cause is that rank's: a launcher stopping the job stops this rank next."""


class PolicyError(TieredError, ValueError):
    """A policy (YAML file, dict or override) is malformed or names something not allowed."""


class UsageError(TieredError, ValueError):
    """A command-line flag of ``tiered-launch`` or ``tiered`` is malformed or out of range."""


class BudgetError(TieredError):
    """What the policy places in a tier does not fit that tier's budget.

    ``shortfalls`` maps each tier that does not fit to ``(needed_bytes, available_bytes)``.
    """

    def __init__(self, message: str, shortfalls: dict[str, tuple[int, int]]):
        super().__init__(message)
        self.shortfalls = shortfalls


class NvmeError(TieredError, OSError):
    """The NVMe tier could not use its path, or a read or write failed.

    Carries ``path`` and, for I/O failures, the ``offset`` and ``size`` of the request.
    """

    def __init__(self, message: str, *, errno: int | None = None, path: str | None = None,
                 offset: int | None = None, size: int | None = None):
        super().__init__(message)
        self.errno = errno
        self.path = path
        self.offset = offset
        self.size = size

    def __str__(self) -> str:
        return self.args[0]
