"""What a failed checkpoint does: it is logged and training goes on, until it cannot.

    failures = FailurePolicy(max_consecutive=3, rank=rank)
    failures.observe(step, error, final)   # raises CheckpointFailedError when it must

One failed checkpoint (a full disk for a minute, a hiccup of the file system) should not
end a run that still has a good older checkpoint: it is logged (a warning, and the
result's `error`, which `moc train` emits as a `checkpoint_failed` event) and the next
checkpoint tries again. But a run whose checkpoints keep failing is a run that can no
longer be recovered, and silence would let it run for days; so `max_consecutive` failures
in a row, or a failed final checkpoint, raise on the caller's thread.

The engines call `observe` where every rank learns the same outcome at the same call
(after the ranks agreed on it), so every rank raises together and none is left waiting
in a collective.
"""

from __future__ import annotations

import logging

from moc.checkpoint.errors import CheckpointError

log = logging.getLogger("moc.checkpoint")

DEFAULT_MAX_FAILURES = 3


class CheckpointFailedError(CheckpointError):
    """Checkpoints kept failing (or the final one did): the run is not recoverable past
    its newest good checkpoint."""


class FailurePolicy:
    """Counts consecutive failed checkpoints. Owner: whoever observes results (the
    caller's thread, or the two-level engine's plan)."""

    def __init__(self, max_consecutive: int | None = DEFAULT_MAX_FAILURES, rank: int = 0
                 ) -> None:
        if max_consecutive is not None and max_consecutive < 1:
            raise ValueError(f"max_failures must be >= 1 or None (never raise), "
                             f"got {max_consecutive}")
        self.max_consecutive = max_consecutive
        self.rank = rank
        self.consecutive = 0
        self.last_error: str | None = None

    def check(self, step: int, error: str | None, final: bool = False) -> str | None:
        """Account one checkpoint's outcome; the message to raise, if it must raise."""
        if error is None:
            self.consecutive = 0
            return None
        self.consecutive += 1
        self.last_error = error
        if self.rank == 0:
            log.warning("checkpoint of step %d failed (%d in a row), training goes on "
                        "from the previous one: %s", step, self.consecutive, error)
        if final:
            return (f"the final checkpoint (step {step}) failed: {error}; the newest "
                    "durable checkpoint is an older one")
        if self.max_consecutive is not None and self.consecutive >= self.max_consecutive:
            return (f"{self.consecutive} checkpoints in a row failed (max_failures="
                    f"{self.max_consecutive}); the last, of step {step}: {error}")
        return None

    def observe(self, step: int, error: str | None, final: bool = False) -> None:
        """`check`, raising CheckpointFailedError when it must."""
        message = self.check(step, error, final)
        if message is not None:
            raise CheckpointFailedError(message)
