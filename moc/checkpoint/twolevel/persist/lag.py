"""How far storage is behind the snapshots in memory, reported at every plan: what a crash
of the node (or of the whole job) would lose now.

    lag = StorageLag(rank)
    report = lag.planned(step, persisted, storage_step, in_flight, alive)   # every plan

Each checkpoint's result carries its report (`CheckpointResult.persists_skipped_in_row`,
`.storage_step`, `.storage_behind_steps`, `.storage_behind_checkpoints`,
`.storage_behind_s`), so every checkpoint event of `moc train --metrics` says it; rank 0
also logs:
- a warning at the run's first skipped persist (later runs of skips start with an info
  line: with the "skip" policy a persist slower than the interval skips every other
  checkpoint by design);
- a warning, once per lag, when storage is more than LAG_CHECKPOINTS checkpoints or
  LAG_S seconds behind the newest snapshot;
- a warning when it is current again after such a lag.

Before this report (issue 40), a persist process stopped at step 40 left storage at step
35 while training reached step 200, every checkpoint reported `persist_skipped` and
nothing else said so. Owner: the thread that holds the planner's lock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

LAG_CHECKPOINTS = 3
"""Storage more than this many checkpoints behind the newest snapshot is reported: one
persist in flight and one skipped is the "skip" policy at work, four is a persist that
is not coming."""
LAG_S = 300.0
"""Storage behind for longer than this is reported, however few checkpoints that is:
five minutes of training that only memory holds."""


@dataclass(frozen=True)
class LagReport:
    """Storage as one plan saw it."""

    skipped_in_row: int
    """Checkpoints in a row not persisted, this one included (0: it is persisted)."""
    storage_step: int | None
    """The newest step committed on storage (None: none yet)."""
    behind_steps: int | None
    """This checkpoint's step minus `storage_step` (None: nothing on storage)."""
    behind_checkpoints: int
    """Checkpoints newer than `storage_step`, this one included."""
    behind_s: float
    """Seconds since the oldest of those was planned (0.0: only this one)."""


class StorageLag:
    """Rank 0's view of how far storage is behind (see the module docstring); every rank
    keeps one, and reports it with its results."""

    def __init__(self, rank: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rank, self.clock = rank, clock
        self._newer: dict[int, float] = {}  # checkpoints not on storage -> when planned
        self._skipped = 0
        self._skips_seen = False  # a skip was logged at warning level once
        self._lagging = False  # the current lag was reported

    def planned(self, step: int, persisted: bool, storage_step: int | None,
                in_flight: int | None, alive: bool) -> LagReport:
        """A plan of `step` (`persisted`: its persist is requested now), with storage at
        `storage_step`, the persist of `in_flight` running and the persist process
        `alive` (every node's): the report, and the lines it calls for."""
        now = self.clock()
        # A restore may have rolled back: checkpoints at or after `step` are gone.
        self._newer = {s: t for s, t in self._newer.items()
                       if s < step and (storage_step is None or s > storage_step)}
        self._newer[step] = now
        self._skipped = 0 if persisted else self._skipped + 1
        report = LagReport(self._skipped, storage_step,
                           step - storage_step if storage_step is not None else None,
                           len(self._newer), now - min(self._newer.values()))
        if self.rank == 0:
            self._log(step, report, in_flight, alive)
        return report

    def _log(self, step: int, r: LagReport, in_flight: int | None, alive: bool) -> None:
        held = f"step {r.storage_step}" if r.storage_step is not None else "no checkpoint"
        if r.skipped_in_row == 1:
            why = (f"the persist of step {in_flight} is still running "
                   f"({self.clock() - self._newer[in_flight]:.1f} s)"
                   if in_flight in self._newer else
                   "no persist process is running" if not alive else
                   f"the persist of step {in_flight} is still running")
            log.log(logging.INFO if self._skips_seen else logging.WARNING,
                    "the checkpoint of step %d is in memory only, its persist skipped: %s; "
                    "storage holds %s", step, why, held)
            self._skips_seen = True
        if not self._lagging and (r.behind_checkpoints > LAG_CHECKPOINTS
                                  or r.behind_s > LAG_S):
            self._lagging = True
            log.warning("storage is %d checkpoints (%s, %.0f s) behind the newest snapshot "
                        "(step %d): it holds %s, and a crash of this node now loses every "
                        "step after it; %d persists skipped in a row", r.behind_checkpoints,
                        f"{r.behind_steps} steps" if r.behind_steps is not None
                        else "all steps", r.behind_s, step, held, r.skipped_in_row)
        elif self._lagging and r.behind_checkpoints <= 1:
            self._lagging = False
            log.warning("storage is current again: it holds %s, the checkpoint before "
                        "step %d", held, step)
