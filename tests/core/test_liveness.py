"""The owner lock: held while its process lives, free the moment it dies, however it dies."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tiered.core.liveness import (LOCK_NAME, MAKING_PREFIX, HeldElsewhere, OwnerLock,
                                  describe_owner, is_held, make_owned_folder)

HOLD = """
import sys, time
from tiered.core.liveness import OwnerLock
lock = OwnerLock(sys.argv[1], "a test holder")
print("held", flush=True)
time.sleep(120)
"""


def test_a_lock_is_free_once_its_holder_is_killed(tmp_path):
    path = str(tmp_path / "lock")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, path], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert is_held(path)
        with pytest.raises(HeldElsewhere, match=f"pid {holder.pid} on host .*a test holder"):
            OwnerLock(path, "a second owner")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert not is_held(path)
    lock = OwnerLock(path, "the next owner")  # a dead owner's lock is simply taken
    assert is_held(path) and "the next owner" in describe_owner(path)
    lock.release()
    assert not is_held(path)


def test_an_owned_folder_is_never_seen_without_its_lock(tmp_path):
    folder = str(tmp_path / "run")
    lock = make_owned_folder(folder, "a run")
    assert os.listdir(tmp_path) == ["run"], "the hidden name is gone once the folder is in place"
    assert lock.path == os.path.join(folder, LOCK_NAME) and is_held(lock.path)
    with pytest.raises(FileExistsError):
        make_owned_folder(folder, "a second run")
    assert is_held(lock.path), "a refused maker leaves the owner's lock alone"
    lock.release()
    os.mkdir(tmp_path / "empty")
    with pytest.raises(FileExistsError):  # rename(2) would silently replace an empty folder
        make_owned_folder(str(tmp_path / "empty"), "a run")
    assert not any(name.startswith(MAKING_PREFIX) for name in os.listdir(tmp_path))


def test_describe_owner_of_a_file_that_is_not_a_lock_record(tmp_path):
    path = tmp_path / "lock"
    path.write_bytes(b"\xff\xfe not json")
    assert describe_owner(str(path)) == "another process (its lock file does not say which)"
    assert not is_held(str(tmp_path / "missing"))
