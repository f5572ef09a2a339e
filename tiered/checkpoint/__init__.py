"""Checkpoints and export of tiered state."""
from .folder import check_folder
from .format import CheckpointError

__all__ = ["CheckpointError", "check_folder"]
