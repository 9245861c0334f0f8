"""The checkpoint engine. Depends on torch and moc.parallel only."""

from moc.checkpoint.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
)

__all__ = ["CheckpointError", "CorruptCheckpointError", "IncompatibleCheckpointError"]
