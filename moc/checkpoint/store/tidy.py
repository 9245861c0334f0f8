"""What the read path leaves for the write path: abandoned `.tmp` directories and the
corrupt steps a restore skipped.

Reading a checkpoint directory never changes it (docs/DECISIONS.md, "Issue 13: read-only
restore and export"): `restore()`, `moc export`, `verify` and `inspect` rename and delete
nothing. A training job still has to clean up before it writes, for two reasons:

- a corrupt step left in place would count among the newest steps for retention (which
  would then delete the intact step the run continued from), so it is set aside
  (`step-N.corrupt`, with CORRUPT.txt; copied then deleted in an object store) before
  the job's first commit;
- `.tmp` directories of interrupted saves take space, so they are removed then too.

`WriteTidy` remembers what a restore found and does both at the first save after it:
rank 0's caller thread, once per restore (a flag test on every later save). The
two-level engine hands the work (`take`) to its persist process instead, which does it
(`tidy`) before the first step it writes: storage must never stall a training step.
"""

from __future__ import annotations

import logging
from pathlib import Path

from moc.checkpoint.store.backend import ObjectPath, open_root
from moc.checkpoint.store.steps import (
    MANIFEST,
    remove_abandoned,
    set_aside,
    step_dir,
)

log = logging.getLogger(__name__)


class WriteTidy:
    """Rank 0's deferred clean-up of a checkpoint directory. Owner: the engine's caller
    thread (restore notes, save does)."""

    def __init__(self, root: Path | ObjectPath) -> None:
        self.root = open_root(root)
        self.corrupt: dict[int, str] = {}
        """Steps a restore found corrupt and skipped -> why."""
        self.pending = True
        """Whether the next save must tidy first: at the engine's first save, and after
        every restore."""

    def note_restore(self, skipped: dict[int, str]) -> None:
        """A restore skipped these corrupt steps (left in place, as the read path must)."""
        self.corrupt.update(skipped)
        self.pending = True

    def take(self) -> dict[int, str] | None:
        """The pending work, for whoever writes next (the corrupt steps to set aside, by
        step; the abandoned directories go too), and nothing pending any more; None when
        nothing is pending."""
        if not self.pending:
            return None
        work, self.corrupt, self.pending = dict(self.corrupt), {}, False
        return work

    def before_write(self) -> None:
        """Do the pending work now (`tidy`); nothing when there is nothing pending."""
        work = self.take()
        if work is not None:
            tidy(self.root, work)


def tidy(root: Path | ObjectPath, corrupt: dict[int, str]) -> None:
    """Set the `corrupt` steps aside (step -> why) and remove abandoned `.tmp`
    directories. A directory that cannot be changed is logged, not raised: the save
    itself then reports why it cannot write."""
    root = open_root(root)
    for step, reason in sorted(corrupt.items()):
        d = step_dir(root, step)
        linked = not isinstance(d, ObjectPath) and d.is_symlink()
        try:
            if not (d / MANIFEST).is_file() and not linked:
                continue  # gone or re-committed meanwhile: nothing to set aside
            set_aside(root, step, reason)
        except OSError as e:
            log.warning("could not set the corrupt step %d aside (%s); it stays in "
                        "place, and retention may count it among the newest steps: %s",
                        step, e.strerror or e, reason)
    try:
        remove_abandoned(root)
    except OSError as e:
        log.warning("could not remove abandoned .tmp directories in %s (%s)",
                    root, e.strerror or e)
