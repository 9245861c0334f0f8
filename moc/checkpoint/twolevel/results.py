"""The caller's records of the checkpoints in flight, until their results are final.

    records = Checkpoints()
    records.started(step, save_s, replica)   # save(): handed to the snapshot thread
    records.taken(handle, wait_s)            # wait_for_snapshot(): its copy is done
    records.drain(rank, mode)                # the final ones, as CheckpointResults

Owned by the caller's thread: the snapshot thread and the persist process reach a record
only through the futures it holds (the replica round, the persist's outcome).
"""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import Future
from dataclasses import dataclass

from moc.checkpoint.api import CheckpointResult
from moc.checkpoint.phases import Phases
from moc.checkpoint.twolevel.planner import PlanOutcome
from moc.checkpoint.twolevel.protocol import Done
from moc.checkpoint.twolevel.replica import ReplicaReport
from moc.checkpoint.twolevel.worker import SnapshotHandle

log = logging.getLogger(__name__)


@dataclass
class InFlight:
    """A checkpoint whose result is not final yet, filled in by the caller's thread."""

    step: int
    save_s: float
    wait_s: float = 0.0
    snapshot_s: float | None = None
    outcome: PlanOutcome | None = None
    replica: Future | None = None
    """This rank's replication round (across nodes), on the snapshot thread."""
    snapshot_phases: Phases | None = None
    copy_Bps: float | None = None

    @property
    def done(self) -> Done | None:
        """The outcome of its persist, once this rank knows it."""
        persist = self.outcome.persist if self.outcome is not None else None
        return persist.result() if persist is not None and persist.done() else None

    def final(self, rank: int) -> bool:
        """Its snapshot is taken, its replica round (if any) is over, and (rank 0, which
        hears of persists) its persist has finished or was skipped."""
        if self.snapshot_s is None or self.outcome is None:
            return False
        if self.replica is not None and not self.replica.done():
            return False
        return rank != 0 or self.outcome.persist_skipped or self.done is not None

    def result(self, mode: str) -> CheckpointResult:
        o, d = self.outcome, self.done
        assert o is not None
        replica = None
        if self.replica is not None:
            try:
                replica = self.replica.result()
            except Exception as e:  # a peer lost mid-transfer: reported, never fatal
                replica = ReplicaReport(None, 0, None, 0, 0.0, f"{type(e).__name__}: {e}")
            if replica is not None and replica.error:
                log.warning("replica of step %d: %s", self.step, replica.error)
        return CheckpointResult(
            self.step, mode, o.k, o.experts_saved, self.save_s, self.wait_s,
            bytes_per_rank=list(d.bytes_per_rank or []) if d is not None else [],
            error=(d.error if d is not None and not d.ok else None) or o.error,
            snapshot_s=self.snapshot_s, persist_s=d.seconds if d is not None else None,
            persist_skipped=o.persist_skipped, k_snapshot=o.k_snapshot,
            k_snapshot_chosen=o.k_snapshot_chosen,
            replica_bytes=replica.bytes_sent if replica is not None else None,
            replica_s=replica.seconds if replica is not None else None,
            replica_error=replica.error if replica is not None else None,
            copy_Bps=self.copy_Bps,
            phases={"snapshot": (self.snapshot_phases or Phases()).to_dict(),
                    **({"persist": d.phases} if d is not None and d.phases else {})})


class Checkpoints:
    """The checkpoints in flight, by step (see the module docstring)."""

    def __init__(self) -> None:
        self._records: dict[int, InFlight] = {}

    def __contains__(self, step: int) -> bool:
        return step in self._records

    def __bool__(self) -> bool:
        return bool(self._records)

    def started(self, step: int, save_s: float, replica: Future | None) -> None:
        self._records[step] = InFlight(step, save_s, replica=replica)

    def discard(self, step: int) -> None:
        """Its snapshot failed (raised once, by `wait_for_snapshot`): never reported."""
        self._records.pop(step, None)

    def taken(self, handle: SnapshotHandle, wait_s: float) -> None:
        """Its snapshot is complete: what the copy took, and what the plan decided."""
        rec = self._records[handle.step]
        rec.wait_s, rec.snapshot_s = wait_s, handle.seconds
        rec.snapshot_phases, rec.copy_Bps = handle.phases, handle.copy_Bps
        rec.outcome = handle.job.outcome if handle.job is not None else None

    def persisted_again(self, step: int, persist: Future[Done]) -> None:
        """`close()` persisted `step` again (its own persist failed or was skipped): its
        result reports that persist, the one that decides what storage holds of it."""
        rec = self._records.get(step)
        if rec is not None and rec.outcome is not None:
            rec.outcome = dataclasses.replace(rec.outcome, persist=persist)

    def replica_rounds(self) -> list[Future]:
        return [r.replica for r in self._records.values() if r.replica is not None]

    def drain(self, rank: int, mode: str) -> list[CheckpointResult]:
        """The records that are final, oldest first, as results; each once."""
        return [self._records.pop(step).result(mode)
                for step in sorted(self._records) if self._records[step].final(rank)]
