"""Failures agreed across ranks: one rank's error raised on every rank, with its words.

A rank that fails a check while the others pass must still reach the collective where they
wait, or they see only the transport's own error (gloo's "Connection closed by peer") once it
leaves. So every check runs to this agreement, and every rank raises: its own error where it
has one, elsewhere a CheckpointError quoting the first failing rank's message.
"""
from __future__ import annotations

import torch

from .format import CheckpointError


def all_or_raise(group, failure: BaseException | None, elsewhere: str | None = None) -> None:
    """A collective: raise on every rank if any failed. A rank without an error of its own
    raises ``elsewhere: rank R: <R's message>``, or R's message as it is where ``elsewhere``
    is None (a check made on one rank for all, whose words then read the same on every
    rank)."""
    if group.world_size == 1:
        if failure is not None:
            raise failure
        return
    text = b""
    if failure is not None:  # never empty: an empty tensor is no message to send
        text = (str(failure) or type(failure).__name__).encode()[:4096]
    mine = torch.tensor([int(failure is not None), len(text)], dtype=torch.int64,
                        device=group.device)
    everyone = torch.empty(2 * group.world_size, dtype=torch.int64, device=group.device)
    group.all_gather(everyone, mine)
    rows = everyone.view(group.world_size, 2).cpu().tolist()
    failed = [rank for rank, (flag, _) in enumerate(rows) if flag]
    if not failed:
        return
    first = failed[0]
    message = torch.tensor(list(text), dtype=torch.uint8, device=group.device) \
        if group.rank == first else torch.empty(rows[first][1], dtype=torch.uint8,
                                                device=group.device)
    group.broadcast(message, src=first)
    if failure is not None:
        raise failure
    words = bytes(message.cpu().tolist()).decode(errors="replace")
    raise CheckpointError(words if elsewhere is None else f"{elsewhere}: rank {first}: {words}")
