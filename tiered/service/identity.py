"""Which code a process of tiered runs: its version, the installation it was imported from, and
a hash of that installation's sources (its Python modules and native kernels' C).

The node's service runs the CPU update of the jobs it hosts in its own process, with its own
code. A service started from one installation (another virtual environment, an older
checkout) must not serve a trainer of another: the update would silently be the other code's.
So a launcher's ``hold`` and a trainer's ``attach`` carry the client's identity, and the
service refuses one that differs from its own, naming both and the remedy.
"""
from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import asdict, dataclass

from ..core.version import __version__

SOURCE_SUFFIXES = (".py", ".c", ".h")
"""What a change of the code is: the files that are run or compiled, not caches."""


@dataclass(frozen=True)
class CodeIdentity:
    version: str
    installation: str
    """The folder the ``tiered`` package was imported from."""
    code: str
    """A SHA-256 of the package's sources, their paths and contents (first 16 hex digits)."""

    def to_wire(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        return f"tiered {self.version}, code {self.code}, from {self.installation}"


@functools.lru_cache(maxsize=1)
def this_code() -> CodeIdentity:
    """This process's tiered (hashed once: about 150 files, a few milliseconds)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digest = hashlib.sha256()
    for folder, subfolders, files in os.walk(package):
        subfolders[:] = sorted(d for d in subfolders if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(SOURCE_SUFFIXES):
                path = os.path.join(folder, name)
                digest.update(os.path.relpath(path, package).encode() + b"\0")
                with open(path, "rb") as f:
                    digest.update(f.read())
                digest.update(b"\0")
    return CodeIdentity(__version__, package, digest.hexdigest()[:16])


def mismatch(client: dict | None) -> str | None:
    """Why the service (this process) must not serve a client of identity ``client`` (a
    ``CodeIdentity.to_wire()``, or None from a client too old to send one), or None."""
    ours = this_code()
    if isinstance(client, dict) and client.get("code") == ours.code \
            and client.get("version") == ours.version:
        return None
    theirs = (f"tiered {client.get('version')}, code {client.get('code')}, from "
              f"{client.get('installation')}" if isinstance(client, dict)
              else "a tiered that does not say its code (an older version)")
    return (f"this node's tiered service runs other code than this process: the service runs "
            f"{ours.describe()}; this process runs {theirs}. Stop the service once its jobs "
            f"are done (tiered daemon stop), or give this installation a service of its own "
            f"(set TIERED_RUNTIME_DIR to another folder)")
