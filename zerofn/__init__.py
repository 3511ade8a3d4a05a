"""zerofn: DeepSpeed's ZeRO as composable transforms over a pure training step.

Public names only; see the modules for the details.
"""

import importlib as _importlib

from zerofn import checkpoint, collectives, losses, memory, mesh, metrics, optim, testing, tree
from zerofn.collectives import CollectiveError, CollectiveTimeoutError
from zerofn.functional import Functional, functional
from zerofn.generation import generate
from zerofn.launch import RankError, RankPool, spawn
from zerofn.losses import Mean
from zerofn.state import DonatedStateError, TrainState, block_until_ready
from zerofn.step import Step, train_step

__all__ = [
    "CollectiveError",
    "CollectiveTimeoutError",
    "DonatedStateError",
    "Functional",
    "Mean",
    "RankError",
    "RankPool",
    "Step",
    "TrainState",
    "block_until_ready",
    "checkpoint",
    "collectives",
    "from_deepspeed",
    "functional",
    "generate",
    "losses",
    "memory",
    "mesh",
    "metrics",
    "moe",
    "optim",
    "spawn",
    "testing",
    "train_step",
    "tree",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """``zf.from_deepspeed`` and ``zf.moe``, imported on first use: importing zerofn imports no transform
    (PEP 562)."""
    if name == "from_deepspeed":
        return _importlib.import_module("zerofn.deepspeed").from_deepspeed
    if name == "moe":
        return _importlib.import_module("zerofn.moe")
    raise AttributeError(f"module 'zerofn' has no attribute {name!r}")
