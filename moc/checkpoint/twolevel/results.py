"""The caller's records of the checkpoints in flight, until their results are final.

    records = Checkpoints()
    records.started(handle, save_s)          # save(): handed to the snapshot thread
    records.wait_captured()                  # wait_for_snapshot(): its copy has landed
    records.sealed(block)                    # its seal is over: the snapshot is complete
    records.drain(rank, mode)                # the final ones, as CheckpointResults

Owned by the caller's thread: the snapshot thread and the persist process reach a record
only through the futures it holds (the replica round, the persist's outcome).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass

from moc.checkpoint.api import CheckpointResult
from moc.checkpoint.phases import Phases
from moc.checkpoint.twolevel.persist.protocol import Done
from moc.checkpoint.twolevel.planner import PlanOutcome
from moc.checkpoint.twolevel.replicas.replica import ReplicaReport
from moc.checkpoint.twolevel.snapshot.sizing import SnapshotTiming
from moc.checkpoint.twolevel.snapshot.worker import SnapshotHandle

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
    handle: SnapshotHandle | None = None
    """The snapshot, once captured and until its seal is taken (`Checkpoints.sealed`)."""
    saved_at: float = 0.0
    """When `save()` returned (`time.perf_counter`)."""
    timing: SnapshotTiming | None = None
    """The time training ran beside it, once captured."""

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
        lag = o.lag
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
            persist_skipped=o.persist_skipped,
            persists_skipped_in_row=lag.skipped_in_row if lag is not None else 0,
            storage_step=lag.storage_step if lag is not None else None,
            storage_behind_steps=lag.behind_steps if lag is not None else None,
            storage_behind_checkpoints=lag.behind_checkpoints if lag is not None else None,
            storage_behind_s=lag.behind_s if lag is not None else None,
            k_snapshot=o.k_snapshot,
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
        self._sealing: list[int] = []  # captured, their seal not taken yet: oldest first
        self._capturing: SnapshotHandle | None = None  # saved, not waited for yet
        self._last_save: float | None = None  # when the save before returned
        self._period: float | None = None  # between the last two saves

    def __contains__(self, step: int) -> bool:
        return step in self._records

    def __bool__(self) -> bool:
        return bool(self._records)

    def started(self, handle: SnapshotHandle, save_s: float) -> None:
        """`save()` handed `handle`'s step to the snapshot thread (in `save_s`); it
        returns now, and the snapshot is being captured until `wait_captured`."""
        now = time.perf_counter()
        if self._last_save is not None:
            self._period = now - self._last_save
        self._last_save = now
        self._capturing = handle
        self._records[handle.step] = InFlight(handle.step, save_s, replica=handle.replica,
                                              saved_at=now)

    @property
    def capturing(self) -> bool:
        return self._capturing is not None

    def wait_captured(self) -> None:
        """Block until the snapshot being captured is (`SnapshotHandle.wait`), if one
        is. What its plan or capture met is raised here, once: the engine stays usable
        (restore, close), and the failed checkpoint is not reported again."""
        handle, self._capturing = self._capturing, None
        if handle is None:
            return
        t0 = time.perf_counter()
        try:
            handle.wait()
        except BaseException:
            self.discard(handle.step)
            raise
        self.captured(handle, t0)

    def abandon(self) -> None:
        """The snapshot being captured is let go (its engine is abandoned)."""
        self._capturing = None

    def discard(self, step: int) -> None:
        """Its snapshot failed (raised once, by `wait_for_snapshot`): never reported."""
        self._records.pop(step, None)

    def captured(self, handle: SnapshotHandle, waited_from: float) -> None:
        """Its snapshot is captured (training waited for it from `waited_from`, a
        `time.perf_counter` reading); its seal goes on."""
        rec = self._records[handle.step]
        rec.wait_s, rec.handle = time.perf_counter() - waited_from, handle
        rec.timing = SnapshotTiming(waited_from - rec.saved_at, self._period)
        self._sealing.append(handle.step)

    def sealed(self, block: bool) -> list[tuple[SnapshotHandle, SnapshotTiming]]:
        """The captured snapshots whose seal is over (`block`: waited for), oldest first:
        what the snapshot took and what the plan decided are filled in, and each is
        returned once with its window. A seal that failed is raised here, once, and its
        checkpoint is never reported (as a failed capture is not). Nothing to do (no
        seal outstanding, as on every ordinary step) costs one test."""
        out = []
        while self._sealing:
            rec = self._records.get(self._sealing[0])
            handle = rec.handle if rec is not None else None
            if handle is not None and not (block or handle.sealed.done()):
                break  # the snapshot thread runs in order: the later ones are not over
            self._sealing.pop(0)
            if rec is None or handle is None:
                continue  # discarded meanwhile
            rec.handle = None
            try:
                handle.wait_sealed()
            except BaseException:
                del self._records[rec.step]
                raise
            rec.snapshot_s, rec.snapshot_phases = handle.seconds, handle.phases
            rec.copy_Bps = handle.copy_Bps
            rec.outcome = handle.job.outcome if handle.job is not None else None
            assert rec.timing is not None
            out.append((handle, rec.timing))
        return out

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
