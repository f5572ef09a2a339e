"""Which tiered this is, and where it keeps what it measured or built for this user."""
from __future__ import annotations

import os

__version__ = "0.1.0"


def cache_folder() -> str:
    """The user's cache of node rates and built kernels: ``$TIERED_CACHE``, else the XDG cache."""
    folder = os.environ.get("TIERED_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tiered")
    os.makedirs(folder, exist_ok=True)
    return folder
