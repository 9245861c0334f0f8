"""moc: cheap fault tolerance for Mixture-of-Experts training in PyTorch.

    ckpt = moc.Checkpointer(model, optimizer, "ckpt/", policy=moc.PECPolicy(k=1))

Every engine keeps one contract (`moc.CheckpointEngine`, moc/checkpoint/api.py). See
README.md for the training-loop integration and docs/FORMAT.md for the files.
"""

# First: a torch older than moc supports is refused in one line (moc.compat), before any
# of moc's imports can fail on it with torch's own error.
import moc.compat  # noqa: F401

# isort: split
from moc.checkpoint.api import CheckpointEngine, CheckpointResult, RecoveryReport
from moc.checkpoint.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
)
from moc.checkpoint.export import ExportReport, export
from moc.checkpoint.policy.selection import PECPolicy
from moc.checkpoint.preemption import Preemption
from moc.checkpoint.routing import RoutingRecorder
from moc.checkpoint.spec import ExpertSpec
from moc.checkpoint.sync import Checkpointer
from moc.checkpoint.twolevel.checkpointer import TwoLevelCheckpointer
from moc.injob.loop import Generation, run
from moc.topology import ParallelGroups, init_distributed

__version__ = "0.3.0"

__all__ = ["CheckpointEngine", "CheckpointError", "CheckpointResult", "Checkpointer",
           "CorruptCheckpointError", "ExpertSpec", "ExportReport", "Generation",
           "IncompatibleCheckpointError", "PECPolicy", "ParallelGroups", "Preemption",
           "RecoveryReport",
           "RoutingRecorder", "TwoLevelCheckpointer", "export", "init_distributed", "run"]
