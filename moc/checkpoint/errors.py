"""Exceptions callers can catch, and one rank's failure as data (`RankError`, what the
ranks agree on: `dist.Dist.agree`). Bad arguments are plain ValueError."""

from __future__ import annotations

from dataclasses import dataclass


class CheckpointError(RuntimeError):
    """Base class of every checkpoint problem."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's bytes are not what its manifest promises (checksum, size, missing
    file or key, unreadable manifest). Recovery falls back to an older intact step."""


class IncompatibleCheckpointError(CheckpointError):
    """A checkpoint is intact but was written for a different model or format.
    Recovery does not fall back: an older step of the same run would not fit either."""


@dataclass(frozen=True)
class RankError:
    """One rank's failure, as every rank learns it from `Dist.agree` (plain data, so it
    travels by `moc.checkpoint.codec`)."""

    rank: int
    kind: str
    """The exception's class name."""
    message: str

    @classmethod
    def of(cls, rank: int, error: BaseException) -> RankError:
        """`error` as plain data: keeping the exception would keep its traceback's
        frames (and the process groups they reference) alive."""
        return cls(rank, type(error).__name__, str(error))
