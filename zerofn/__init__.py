"""zerofn: DeepSpeed's ZeRO as composable transforms over a pure training step.

Public names only; see the modules for the details.
"""

from zerofn import checkpoint, collectives, memory, optim, testing, tree
from zerofn.collectives import CollectiveError, CollectiveTimeoutError
from zerofn.functional import Functional, functional
from zerofn.launch import RankError, RankPool, spawn
from zerofn.state import DonatedStateError, TrainState
from zerofn.step import Step, train_step

__all__ = [
    "CollectiveError",
    "CollectiveTimeoutError",
    "DonatedStateError",
    "Functional",
    "RankError",
    "RankPool",
    "Step",
    "TrainState",
    "checkpoint",
    "collectives",
    "functional",
    "memory",
    "optim",
    "spawn",
    "testing",
    "train_step",
    "tree",
]

__version__ = "0.1.0"
