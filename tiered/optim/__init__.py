"""The optimizer: AdamW stepped where the optimizer states live."""
from .commands import UpdateMode
from .optimizer import TieredAdamW

__all__ = ["TieredAdamW", "UpdateMode"]
