"""``save_checkpoint(keep_last=N)``: a save removes the checkpoints older than the newest N.

[Note: what keep_last removes]
A run that saves each step would otherwise fill its disk. Rank 0 removes, once every rank has
written its part and the new checkpoint is complete (renamed into place, ``latest`` naming it),
so however a save ends, the folder holds at least what it held before the save. Only intact
checkpoints are counted and removed, in the order a load's fallback gives them
(latest.by_age: the most optimizer steps, then the manifest written last), keeping the newest
N with the one just written always among them (it is the one ``latest`` names, even where an
older run left checkpoints of more steps). Left alone: a folder that is not intact (a copy
still arriving, damage the user should see), staging folders (hidden names), and a tag that is
a link (its checkpoint is counted where it lies). Each removed one is first renamed to
``.<tag>.del``, so that a crash while deleting it leaves no half checkpoint for a load to
meet; the next job's claim of the folder deletes the rest (folder.py).
"""
from __future__ import annotations

import logging
import os
import shutil
import warnings

from .format import CheckpointError
from .latest import by_age
from .manifest import intact_steps

_log = logging.getLogger("tiered")


def check_keep_last(keep_last) -> None:
    """Checked on every rank before a save writes anything (bool is refused: ``True`` is no
    count)."""
    if keep_last is None or (isinstance(keep_last, int) and not isinstance(keep_last, bool)
                             and keep_last >= 1):
        return
    raise CheckpointError(f"keep_last={keep_last!r}: expected None (keep every checkpoint) or "
                          f"an integer >= 1 (how many of the newest to keep)")


def remove_older(directory: str, tag: str, keep_last: int) -> None:
    """On rank 0, after ``tag`` is complete: remove the intact checkpoints of ``directory``
    beyond the newest ``keep_last`` (see the module note). A removal that fails is a warning:
    the checkpoint just saved is complete either way."""
    intact, _ = by_age(directory, intact_steps)
    others = [name for name, _ in intact
              if name != tag and not os.path.islink(os.path.join(directory, name))]
    doomed = others[:max(0, len(others) - (keep_last - 1))]
    for name in doomed:
        remove_checkpoint(directory, name)
    if doomed:
        _log.info("tiered: keep_last=%d removed %s from %s", keep_last, ", ".join(doomed),
                  directory)


def remove_checkpoint(directory: str, tag: str) -> None:
    aside = os.path.join(directory, f".{tag}.del")
    try:
        shutil.rmtree(aside, ignore_errors=True)  # a removal of the same tag that failed
        os.rename(os.path.join(directory, tag), aside)
        shutil.rmtree(aside)
    except OSError as error:
        warnings.warn(f"tiered: keep_last could not remove the checkpoint {tag!r} in "
                      f"{directory}: {error.strerror or error}", stacklevel=2)
