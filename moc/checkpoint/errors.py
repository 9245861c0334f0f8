"""Exceptions callers can catch. Bad arguments are plain ValueError."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """Base class of every checkpoint problem."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's bytes are not what its manifest promises (checksum, size, missing
    file or key, unreadable manifest). Recovery falls back to an older intact step."""


class IncompatibleCheckpointError(CheckpointError):
    """A checkpoint is intact but was written for a different model or format.
    Recovery does not fall back: an older step of the same run would not fit either."""
