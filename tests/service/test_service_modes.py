"""The service folder's file modes (issue 30, item 13): the folder 0700, and the socket, log and
lock inside owner-only, on a real service started as ``tiered daemon start`` starts one.

The folder's 0700 is what keeps other users out (paths.py), but the socket's own mode is the
second wall: it still holds where the folder is opened later (a user's ``chmod 755`` to read
the log) or where a service folder is given by ``TIERED_RUNTIME_DIR`` on a shared file system.
The service is started under umask 0, the most permissive a user may have, so that every mode
seen is one the code sets, not one the test's environment happened to impose (under the usual
022 a socket would be 0755 without the service's chmod; under 077, 0700 by luck).
"""
from __future__ import annotations

import os
import stat

import pytest

from tiered.service import service_paths, start_service, stop_service
from tiered.service.control import running_service

from helpers import own_service


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """A service of this module's own, its folder made by start_service (not by the test)."""
    previous = os.umask(0)
    try:
        with own_service(tmp_path_factory, dram=2 << 20) as folder:
            os.umask(previous)  # only the service's start runs under umask 0
            yield service_paths(folder)
    finally:
        os.umask(previous)


def mode(path: str) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_the_folder_is_its_owners_alone(service):
    info = os.lstat(service.folder)
    assert stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()
    assert mode(service.folder) == 0o700, f"{mode(service.folder):04o}"


def test_the_socket_is_owner_only(service):
    info = os.lstat(service.socket)
    assert stat.S_ISSOCK(info.st_mode) and info.st_uid == os.getuid()
    # 0600 or stricter: no bit outside the owner's read and write (a socket needs no execute).
    assert mode(service.socket) & ~0o600 == 0, f"{mode(service.socket):04o}"
    hello = running_service(service.folder)  # and its owner still reaches it through it
    assert hello is not None and hello["folder"] == service.folder, hello


def test_the_log_is_owner_only(service):
    info = os.lstat(service.log)
    assert stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid()
    assert mode(service.log) & ~0o600 == 0, f"{mode(service.log):04o}"
    with open(service.log) as log:  # the service's own log, written: it says it serves
        assert "serving in" in log.read()


def test_nothing_in_the_folder_is_open_to_others(service):
    """Whatever the service keeps there (the lock too, and any file added later), beside the
    three checked above by name."""
    names = set(os.listdir(service.folder))
    wanted = {os.path.basename(p) for p in (service.socket, service.log, service.lock)}
    assert wanted <= names, names
    loose = {name: f"{mode(os.path.join(service.folder, name)):04o}" for name in names
             if mode(os.path.join(service.folder, name)) & 0o077}
    assert not loose, loose


def test_a_log_left_looser_from_before_is_made_owner_only(tmp_path):
    """A log the service appends to that another hand left 0644 (a ``chmod`` to share it, an
    old version's) is tightened when the service opens it."""
    folder = tmp_path / "service"
    folder.mkdir(mode=0o700)
    log = service_paths(str(folder)).log
    with open(log, "w") as file:
        file.write("an earlier service's lines\n")
    os.chmod(log, 0o644)
    start_service(str(folder), dram=2 << 20)
    try:
        assert mode(log) == 0o600, f"{mode(log):04o}"
    finally:
        stop_service(str(folder))
