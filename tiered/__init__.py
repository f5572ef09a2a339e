"""tiered: train models larger than GPU memory across HBM, pinned DRAM and NVMe (ZeRO-3).

    engine, optimizer = tiered.initialize(model, "configs/cpu.yaml")
    loss = loss_fn(engine(x), y); loss.backward(); optimizer.step(); optimizer.zero_grad()
"""
import warnings

# torch warns at import when numpy is absent; tiered never uses numpy, so the warning is noise.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

from .checkpoint import CheckpointError
from .core.errors import BudgetError, NvmeError, PolicyError, TieredError
from .core.version import __version__
from .engine import TieredEngine, init, initialize
from .engine.optimizer import TieredAdamW
from .ops import TiledLinear
from .optim import UpdateMode
from .policy.config import Policy

__all__ = ["BudgetError", "CheckpointError", "NvmeError", "Policy", "PolicyError", "TieredAdamW",
           "TieredEngine", "TieredError", "TiledLinear", "UpdateMode", "__version__", "init",
           "initialize"]
