"""Which checkpoint a load takes: tags, the ``latest`` file, and the newest complete one.

A tag is one folder's plain name, checked alike where a save is given it and where a load
reads it (as an argument or from ``latest``): ``latest`` holding ``../../elsewhere`` or an
absolute path would otherwise load a checkpoint from outside the folder.

[Note: a load without 'latest']
A save writes ``latest`` last, aside and renamed; a save that fails there (a full disk) leaves
complete checkpoints and no ``latest``, or an empty one (a crash of a file system that lost the
unflushed write). A load then takes the newest intact checkpoint and says which. Newest is
the most optimizer steps (``optimizer.steps_called`` of its manifest), as the one a resume
should go on from; among equals (tags saved at one step) the manifest written last. Tag names
do not order checkpoints (a user's tags are any names). Intact: its manifest reads, and every
rank file it lists is there, a regular file of the listed size; a newer one that is not (a
copy or a sync that stopped part way, a rank's file lost) is passed over, saying which and
why, since a resume from an older checkpoint beats none. Sizes are compared, the files are not
hashed here (that would read every checkpoint of the folder whole): the load hashes the one it
takes, and refuses it if it is corrupted. A ``latest`` that holds text that is not a tag (not
UTF-8, a path) is refused rather than guessed around: nothing tiered does writes it, so
something else did, and the user should look; and a checkpoint ``latest`` or the load names
is loaded or refused, never replaced by another.

[Note: a tag that is a link]
A tag may be a symbolic link to another checkpoint of the folder (``best`` -> ``step00000400``),
but not out of it: the folder's owner lock, its ``latest`` and ``keep_last`` speak for what
the folder holds, and a link elsewhere would resume from a checkpoint another job may be
writing or removing. No documented use relies on such a link; one is refused, naming where
it points (copy or move that checkpoint into the folder instead).
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


def chosen_tag(directory: str, age_of, say: bool) -> str:
    """The tag ``latest`` names, or where it is missing or empty the newest intact one (see
    the note); ``age_of(folder)``: an intact checkpoint's step count (raising a
    CheckpointError saying why where it is not intact). ``say``: warn which were passed over
    and which was taken."""
    path = os.path.join(directory, LATEST)
    try:
        tag = read_text(path, TEXT_LIMIT).strip()
        problem = "empty"
    except FileNotFoundError:
        tag, problem = "", "missing"
    if tag:
        check_tag(tag, f"{path} names")
        return tag
    intact, broken = by_age(directory, age_of)
    if say:
        for name, why in broken:
            warnings.warn(f"tiered: skipping the checkpoint {name!r} in {directory}: {why}",
                          stacklevel=3)
    if not intact:
        names = ", ".join(repr(name) for name, _ in broken)
        skipped = f"; {len(broken)} skipped: {names}" if broken else \
            f", and no folder with a {MANIFEST}"
        raise CheckpointError(f"no {'intact ' if broken else ''}checkpoint in {directory} "
                              f"(no '{LATEST}' file{skipped})")
    tag, steps = intact[-1]
    if say:
        warnings.warn(f"tiered: {path} is {problem}; loading the newest complete checkpoint "
                      f"there, {tag!r} ({steps} optimizer steps)", stacklevel=3)
    return tag


def by_age(directory: str, age_of) -> tuple[list[tuple[str, int]], list[tuple[str, str]]]:
    """The checkpoints of ``directory``: the intact ones with their step counts, oldest first
    (the note's order), and the others with why they are not (``age_of``'s error)."""
    intact, broken = [], []
    for tag in complete_tags(directory):
        folder = os.path.join(directory, tag)
        try:
            check_inside(directory, tag)
            steps = age_of(folder)
            key = (steps, os.stat(os.path.join(folder, MANIFEST)).st_mtime_ns)
        except CheckpointError as error:
            broken.append((tag, str(error)))
            continue
        intact.append((key, tag))
    return [(tag, key[0]) for key, tag in sorted(intact)], broken


def check_inside(directory: str, tag: str) -> None:
    """Refuse a tag that is a link out of ``directory`` (see [Note: a tag that is a link])."""
    folder = os.path.join(directory, tag)
    if not os.path.islink(folder):
        return
    target = os.path.realpath(folder)
    if os.path.dirname(target) != os.path.realpath(directory):
        raise CheckpointError(f"checkpoint {tag!r} in {directory} is a symbolic link to "
                              f"{target}, outside the folder: tiered loads only the "
                              f"checkpoints a folder holds; copy or move it there")


def complete_tags(directory: str) -> list[str]:
    """The complete checkpoints of ``directory`` (folders with a manifest), by name."""
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    return [name for name in names if not name.startswith(".")
            and os.path.isfile(os.path.join(directory, name, MANIFEST))]
