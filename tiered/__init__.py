"""tiered: train models larger than GPU memory across HBM, pinned DRAM and NVMe (ZeRO-3).

    engine, optimizer = tiered.initialize(model, "configs/cpu.yaml")
    loss = loss_fn(engine(x), y); loss.backward(); optimizer.step(); optimizer.zero_grad()
"""
import warnings

__version__ = "0.1.0"  # first: modules imported below read it

# torch warns at import when numpy is absent; tiered never uses numpy, so the warning is noise.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

from .checkpoint import CheckpointError
from .engine import TieredEngine, init, initialize
from .errors import BudgetError, NvmeError, PolicyError, TieredError
from .ops import TiledLinear
from .optim import TieredAdamW, UpdateMode
from .policy import Policy

__all__ = ["BudgetError", "CheckpointError", "NvmeError", "Policy", "PolicyError", "TieredAdamW",
           "TieredEngine", "TieredError", "TiledLinear", "UpdateMode", "init", "initialize"]
