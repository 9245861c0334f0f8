"""The two-level engine's restore: from memory where every rank can (its own node's
snapshot, a peer's replica), else from storage; the engine's parts then go on from
what was restored. The caller has flushed the checkpoints in flight."""

from __future__ import annotations

from moc.checkpoint.api import RecoveryReport
from moc.checkpoint.lineage import Lineage
from moc.checkpoint.parts import EngineParts
from moc.checkpoint.recovery import resume_from_storage, roll_back, warn_interrupted_commits
from moc.checkpoint.store.manifest import Manifest
from moc.checkpoint.twolevel.engine_state import EngineState
from moc.checkpoint.twolevel.recovery.memory import MemoryQuery, restore_from_memory
from moc.checkpoint.twolevel.snapshotter import Snapshotter


def restore_engine(p: EngineParts, snapshots: Snapshotter, books: EngineState,
                   step: int | None, prefer: str = "exact") -> RecoveryReport | None:
    """Restore the newest step every rank can ("memory", "peer", "mixed", or "storage"),
    or roll back to `step` from storage; None when there is nothing. Collective."""
    if p.groups.rank == 0:
        warn_interrupted_commits(p.root, repair=p.tidy is not None)
    storage = p.dist.broadcast(p.storage.steps())
    if not p.storage.exists():
        # The checkpoint directory is gone (a fresh start was asked for): snapshots
        # left in memory by an earlier run of it must not be resumed.
        snapshots.invalidate_newer_than(-1)
    mem = None
    if step is None:
        mem = restore_from_memory(MemoryQuery(
            snapshots.store, p.root, p.state, p.dist, storage, p.layout, p.model_meta,
            p.chain.tracked_kind, p.run_id, snapshots.peers, prefer))
    if mem is None:
        books.restored_from_storage()
        report = resume_from_storage(p.root, p.state, p.dist, p.model_meta, p.chain,
                                     p.ledger, p.tidy, restored=p.restored, run_id=p.run_id,
                                     step=step, commits_checked=True)
        snapshots.invalidate_newer_than(report.step if report is not None else -1)
        return report
    snapshots.invalidate_newer_than(mem.step)
    if storage and mem.step < storage[-1]:
        # An exact older step was preferred to a partial newer one (`prefer`): the
        # line continues from it, and the newer steps are set aside as a rollback's.
        roll_back(p.root, mem.step, p.dist, p.tidy)
        storage = [s for s in storage if s <= mem.step]
    p.restored(mem.step, Lineage.from_json(mem.meta["line"], "snapshot lineage"))
    # The chain continues from storage (the snapshot's line continues it).
    books.restored_from_memory(mem.slot, int(mem.meta.get("snap_index", -1)),
                               mem.meta["ledger"],
                               Manifest.load(p.root, storage[-1]) if storage else None)
    return mem.report(p.ledger.recover(mem.at_copy, mem.meta, mem.stale,
                                       warn=p.dist.rank == 0))
