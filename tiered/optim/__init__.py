"""The CPU side of the optimizer: AdamW stepped where the optimizer states live, in the trainer's
process or in the node's service. The training side (``TieredAdamW``) is the engine's."""
from .commands import UpdateMode

__all__ = ["UpdateMode"]
