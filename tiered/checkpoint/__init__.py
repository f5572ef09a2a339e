"""Checkpoints and export of tiered state."""
from .format import CheckpointError

__all__ = ["CheckpointError"]
