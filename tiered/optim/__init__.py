"""The optimizer: AdamW stepped where the optimizer states live."""
from .optimizer import TieredAdamW

__all__ = ["TieredAdamW"]
