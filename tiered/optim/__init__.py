"""The optimizer: AdamW stepped where the optimizer states live."""
from .optimizer import TieredAdamW, UpdateMode

__all__ = ["TieredAdamW", "UpdateMode"]
