"""The model-only two-level engine (`TwoLevelCheckpointer(model, None, directory)`): a
reader of storage, for inference or export.

Node memory and the persist process belong to the training job of the directory, which
may be running beside the reader under the same default job id, so a reader claims,
reads and removes none of them: it is `moc.Checkpointer`'s model-only engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from moc.checkpoint.sync import Checkpointer
from moc.checkpoint.twolevel.memory.jobdir import default_job_id


class StorageReader(Checkpointer):
    """A two-level engine's model-only form: restores from storage, never saves."""

    def __init__(self, model: nn.Module, directory: str | Path, *, job: str | None = None,
                 **options: Any) -> None:
        super().__init__(model, None, directory, **options)
        self.job = job or default_job_id(directory)
        """The training job whose directory this is (its memory is left alone)."""
