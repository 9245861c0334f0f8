"""moc: cheap fault tolerance for Mixture-of-Experts training in PyTorch.

    ckpt = moc.Checkpointer(model, optimizer, "ckpt/", policy=moc.PECPolicy(k=1))

See README.md for the training-loop integration and docs/FORMAT.md for the files.
"""

from moc.checkpoint.checkpointer import Checkpointer, RecoveryReport, SaveStats
from moc.checkpoint.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
)
from moc.checkpoint.selection import PECPolicy
from moc.checkpoint.spec import ExpertSpec
from moc.checkpoint.twolevel import TwoLevelCheckpointer
from moc.parallel.groups import ParallelGroups

__version__ = "0.3.0"

__all__ = ["CheckpointError", "Checkpointer", "CorruptCheckpointError", "ExpertSpec",
           "IncompatibleCheckpointError", "PECPolicy", "ParallelGroups", "RecoveryReport",
           "SaveStats", "TwoLevelCheckpointer"]
