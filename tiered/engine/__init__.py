"""The ZeRO-3 engine: units, flat partitioned parameters, hooks, construction."""
from .engine import TieredEngine, initialize
from .init import init

__all__ = ["TieredEngine", "init", "initialize"]
