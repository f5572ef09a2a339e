"""Which checkpoint a load takes: tags, the ``latest`` file, and the newest complete one.

A tag is one folder's plain name, checked alike where a save is given it and where a load
reads it (as an argument or from ``latest``): ``latest`` holding ``../../elsewhere`` or an
absolute path would otherwise load a checkpoint from outside the folder.

[Note: a load without 'latest']
A save writes ``latest`` last, aside and renamed; a save that fails there (a full disk) leaves
complete checkpoints and no ``latest``, or an empty one (a crash of a file system that lost the
unflushed write). A load then takes the newest complete checkpoint and says which. Newest is
the most optimizer steps (``optimizer.steps_called`` of its manifest), as the one a resume
should go on from; among equals (tags saved at one step) the manifest written last. Tag names
do not order checkpoints (a user's tags are any names). A ``latest`` that holds text that is
not a tag (not UTF-8, a path) is refused rather than guessed around: nothing tiered does
writes it, so something else did, and the user should look.
"""
from __future__ import annotations

import os
import stat
import warnings

from .format import CheckpointError

MANIFEST = "manifest.json"
LATEST = "latest"
TEXT_LIMIT = 4096
"""Bytes read of ``latest``: a tag is one folder name (at most 255 bytes on Linux)."""


def check_tag(tag: str, where: str = "checkpoint tag") -> None:
    """A tag is one folder's plain name, which ``latest`` gives back as written. Checked on
    every rank alike, before anything is created: a name the OS refuses (a NUL byte raises
    ValueError, not OSError) would fail on rank 0 alone, the others waiting in a collective."""
    if (not tag or tag.startswith(".") or tag == LATEST or tag != tag.strip()  # latest strips
            or any(sep and sep in tag for sep in ("/", os.sep, os.altsep))
            or any(ord(c) < 32 or c == "\x7f" for c in tag)):
        raise CheckpointError(f"{where} {tag!r}: use a plain folder name (letters, digits, '-' "
                              f"or '_'; not starting with '.', not {LATEST!r})")


def read_text(path: str, limit: int) -> str:
    """The UTF-8 text of the regular file ``path`` (a link to one is one), of at most
    ``limit`` bytes. Raises FileNotFoundError where there is none; a CheckpointError naming
    the file where it is another kind of file (a folder, ``/dev/zero``, a FIFO: reading one
    would fail, never end or wait for a writer), larger, or not UTF-8."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise
    except OSError as error:  # a path through a file, a folder this user may not enter
        raise CheckpointError(f"{path}: cannot be read: {error.strerror}") from None
    if not stat.S_ISREG(mode):
        kind = "a folder" if stat.S_ISDIR(mode) else "a device, FIFO or socket"
        raise CheckpointError(f"{path}: is {kind}, not a regular file")
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as error:
        raise CheckpointError(f"{path}: cannot be read: {error.strerror}") from None
    if len(data) > limit:
        raise CheckpointError(f"{path}: larger than the {limit} bytes it may be")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise CheckpointError(f"{path}: not UTF-8 text (byte {data[error.start]:#04x} at "
                              f"offset {error.start})") from None


def chosen_tag(directory: str, steps_of, say: bool) -> str:
    """The tag ``latest`` names, or where it is missing or empty the newest complete one (see
    the note); ``steps_of(folder)``: a complete checkpoint's step count (reads its manifest,
    raising a CheckpointError where it is not usable). ``say``: warn which was taken."""
    path = os.path.join(directory, LATEST)
    try:
        tag = read_text(path, TEXT_LIMIT).strip()
        problem = "empty"
    except FileNotFoundError:
        tag, problem = "", "missing"
    if tag:
        check_tag(tag, f"{path} names")
        return tag
    newest = _newest_complete(directory, steps_of)
    if newest is None:
        raise CheckpointError(f"no checkpoint in {directory} (no '{LATEST}' file, and no "
                              f"folder with a {MANIFEST})")
    tag, steps = newest
    if say:
        warnings.warn(f"tiered: {path} is {problem}; loading the newest complete checkpoint "
                      f"there, {tag!r} ({steps} optimizer steps)", stacklevel=3)
    return tag


def _newest_complete(directory: str, steps_of) -> tuple[str, int] | None:
    best = None
    for tag in complete_tags(directory):
        folder = os.path.join(directory, tag)
        try:
            steps = steps_of(folder)
        except CheckpointError:  # a damaged manifest: not a checkpoint to resume from
            continue
        key = (steps, os.stat(os.path.join(folder, MANIFEST)).st_mtime_ns)
        if best is None or key > best[0]:
            best = (key, tag)
    return None if best is None else (best[1], best[0][0])


def complete_tags(directory: str) -> list[str]:
    """The complete checkpoints of ``directory`` (folders with a manifest), by name."""
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    return [name for name in names if not name.startswith(".")
            and os.path.isfile(os.path.join(directory, name, MANIFEST))]
