"""Where a node's service listens: a folder only its user can enter, holding the socket.

The folder is ``$TIERED_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/tiered``, else
``/tmp/tiered-<uid>``. It must be this user's and mode 0700: in /tmp anyone could have made
``/tmp/tiered-<uid>`` first, to receive the segments of every job that connects, so a folder
that is someone else's or open to others is refused by name instead of used. The socket inside
is then reachable by this user (and root) only; the service also checks each peer's credentials
(server.py), which holds even where the folder's permissions are changed later.
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from ..core.errors import TieredError

RUNTIME_ENV = "TIERED_RUNTIME_DIR"
SOCKET_NAME = "service.sock"
LOCK_NAME = "service.lock"
"""Held by the running service (liveness.OwnerLock): one service per folder."""
LOG_NAME = "service.log"


class ServiceError(TieredError):
    """The service could not be reached, started or used; the message says what to do."""


@dataclass(frozen=True)
class ServicePaths:
    folder: str

    @property
    def socket(self) -> str:
        return os.path.join(self.folder, SOCKET_NAME)

    @property
    def lock(self) -> str:
        return os.path.join(self.folder, LOCK_NAME)

    @property
    def log(self) -> str:
        return os.path.join(self.folder, LOG_NAME)


def default_folder() -> str:
    if os.environ.get(RUNTIME_ENV):
        return os.path.abspath(os.path.expanduser(os.environ[RUNTIME_ENV]))
    if os.environ.get("XDG_RUNTIME_DIR"):
        return os.path.join(os.environ["XDG_RUNTIME_DIR"], "tiered")
    return f"/tmp/tiered-{os.getuid()}"


def service_paths(folder: str | None = None, create: bool = False) -> ServicePaths:
    """The service's paths in ``folder`` (default: :func:`default_folder`), the folder checked
    (and, with ``create``, made) as this user's own with mode 0700."""
    folder = os.path.abspath(folder or default_folder())
    if create and not os.path.lexists(folder):
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
        except OSError as e:
            raise ServiceError(f"cannot create the service folder {folder}: {e.strerror}") from None
    try:
        info = os.lstat(folder)
    except FileNotFoundError:
        return ServicePaths(folder)  # nothing runs there yet; whoever starts one creates it
    except OSError as e:
        raise ServiceError(f"cannot read the service folder {folder}: {e.strerror}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise ServiceError(f"the service folder {folder} is not a folder (set {RUNTIME_ENV} to "
                           f"another path)")
    if info.st_uid != os.getuid():
        raise ServiceError(f"the service folder {folder} belongs to uid {info.st_uid}, not to "
                           f"this user (uid {os.getuid()}); refusing to use it: set "
                           f"{RUNTIME_ENV} to a folder of your own")
    if stat.S_IMODE(info.st_mode) & 0o077:
        raise ServiceError(f"the service folder {folder} has mode "
                           f"{stat.S_IMODE(info.st_mode):04o}; it must be 0700 (only its owner "
                           f"may enter): chmod 700 {folder}")
    return ServicePaths(folder)
