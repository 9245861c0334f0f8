"""The plans of one rank's two-level checkpoints, on the snapshot thread: the exchange
every rank takes part in, then what the snapshot copies into which slot and what is
persisted (`snapshot_plan`, a pure function), applied to the engine's state.

    plan(step, counts, rng, extra)   share persist outcomes and sum the token counts (one
                                     all-reduce), plan, pick a free slot, request the persist
    share(block)                     the same exchange without a checkpoint (flush)
    poll()                           rank 0's caller thread: outcomes that have arrived

Every rank runs the same plans in the same order, so the collective inside pairs up and
every rank takes the same decisions (the persist outcomes it acts on are rank 0's).

The exchange is where every failure of a checkpoint becomes an agreed outcome: a persist
that failed or was lost, a dead persist process, a save rejected on some rank, a replica
channel that broke, an error of rank 0's retention. Each is then applied on every rank
alike (`EngineState.settle`, `.fail`), and raised on the caller's thread by the engine.

A dead persist process (or one its leader's watch found stopped or hung, and killed:
`twolevel.persist.watch`): rank 0 notices it before the exchange, reports the persist it lost as
failed and starts a new one (`PersistExecutor.revive`); this plan persists its checkpoint
on the new one, so storage is current again at its commit; the exchange carries the
new process's generation, and every other rank reconnects to it right after, before this
plan's snapshot reports Ready. Nothing of the lost step was committed, so the chain goes
on from the last committed manifest: the chain's rotation only advances on a commit, and
the next persist writes the experts the lost one would have.
"""

from __future__ import annotations

import copy
import threading
from concurrent.futures import Future
from typing import Any

import torch

from moc.checkpoint.dist import Dist
from moc.checkpoint.errors import CheckpointError
from moc.checkpoint.plan.units import rank_share
from moc.checkpoint.state import RankState, TakenAtSave
from moc.checkpoint.store.manifest import Manifest
from moc.checkpoint.store.steps import MANIFEST, step_dir
from moc.checkpoint.twolevel.engine_state import EngineState
from moc.checkpoint.twolevel.memory.slots import SnapshotHeader, SnapshotStore
from moc.checkpoint.twolevel.persist.executor import PersistExecutor, PersistRequest
from moc.checkpoint.twolevel.persist.lag import StorageLag
from moc.checkpoint.twolevel.persist.protocol import PERSIST_GONE, Done
from moc.checkpoint.twolevel.replicas.replica import ReplicaChannel
from moc.checkpoint.twolevel.snapshot.state_cache import FlatState
from moc.checkpoint.twolevel.snapshot.worker import SnapshotJob
from moc.checkpoint.twolevel.snapshot_plan import (
    PlanConfig,
    PlanInputs,
    PlanOutcome,
    plan_snapshot,
)
from moc.topology import ParallelGroups

__all__ = ["PlanConfig", "PlanOutcome", "SnapshotPlanner"]


class SnapshotPlanner:
    """Runs the plans and the exchange of one rank. `lock` is held by a plan; rank 0's
    caller takes it without blocking to poll for outcomes, and the caller's thread
    holds the engine (flush, restore, close) when no plan runs."""

    def __init__(self, state: RankState, groups: ParallelGroups, dist: Dist,
                 books: EngineState, persist: PersistExecutor, config: PlanConfig,
                 replicas: ReplicaChannel | None = None) -> None:
        self.state, self.groups, self.dist = state, groups, dist
        self.books, self.persist, self.config = books, persist, config
        self.replicas = replicas
        """This rank's replica channel (across nodes, None: no replicas): a channel that
        broke on any rank is broken on every rank at the next plan, so that all stop
        sending replicas at the same round, none waits for a peer that stopped."""
        self.lock = threading.Lock()
        self.flat = FlatState(state)
        """The flattened state, its layout kept between plans (`twolevel.snapshot.state_cache`)."""
        self.lag = StorageLag(groups.rank)
        """How far storage is behind, reported with every checkpoint (`twolevel.persist.lag`)."""

    def forget_layout(self) -> None:
        """Drop the flattened state's kept layout (after a restore replaced the
        optimizer's state: the next plan would see that and make a new one, but until
        then the layout keeps the old tensors alive). The caller's thread, no plan
        running (a restore flushes first)."""
        with self.lock:
            self.flat.forget()

    # -- persist outcomes ----------------------------------------------------------------

    def poll(self) -> None:
        """Rank 0's caller thread: take the outcomes that have arrived, unless a plan is
        sharing them right now (it takes them itself then). Never blocks."""
        if self.lock.acquire(blocking=False):
            try:
                self._receive(block=False)
            finally:
                self.lock.release()

    def _receive(self, block: bool) -> None:
        books = self.books
        for done in self.persist.receive(books.in_flight, block):
            if done.step == books.in_flight:
                books.persist_answered(done.step)
        if self.groups.rank == 0:
            books.persist_liveness(self.persist.alive)

    def share(self, block: bool, counts: torch.Tensor | None = None,
              rejected: bool = False) -> int:
        """Collective: every rank learns the same persist outcomes and applies them; with
        `counts` (this rank's routed tokens since the last save), the same all-reduce
        also sums them into the ledger, and counts the ranks that `rejected` this
        checkpoint (returned). `block`: first wait for the persist in flight."""
        books, persist = self.books, self.persist
        if persist.leader:
            self._receive(block)
            if persist.revive(books.in_flight, block) is not None:
                books.persist_answered(books.in_flight)
            books.persist_liveness(persist.alive)
        share = (persist.take_unshared(), books.in_flight, books.choice, books.take_unshared())
        # Summed in the same all-reduce: the counts, the ranks that rejected the save,
        # whether this rank's replica channel broke, and per node its persist process's
        # generation (+1) and whether it is gone for good (`PersistExecutor.node_info`).
        counted = counts.flatten() if counts is not None else torch.zeros(0, dtype=torch.int64)
        broken = int(self.replicas is not None and self.replicas.broken is not None)
        summed = torch.cat([counted, torch.tensor([int(rejected), broken]),
                            persist.node_info()])
        done, in_flight, choice, error = self.dist.exchange(share, summed)
        n = counted.numel()
        # Any node's persist process gone for good stops every commit (node 0 waits for
        # every part), so every rank treats persisting as lost.
        books.persist_liveness(persist.shared(summed[n + 2:], done))
        books.chose(choice)
        books.fail(error)
        if counts is not None:
            books.counted(summed[:n])
        n_broken = int(summed[n + 1])
        if n_broken and self.replicas is not None:
            self.replicas.mark_broken(f"on {n_broken} rank(s) of {self.groups.world_size}")
        for result in done:
            books.persist_ended(result.step)
            books.settle(result.step, self._committed_from(result) if result.ok
                         else result.error or "failed")
        books.persist_in_flight(in_flight)
        return int(summed[n])

    def _committed_from(self, result: Done) -> str | None:
        """A commit shared by rank 0: the chain continues from the manifest its persist
        process committed, as it sent it (storage is not read back: see `Done.manifest`).
        What is wrong with it, if anything (then the chain stays where it was)."""
        if result.manifest is None:
            return f"the persist of step {result.step} reported no manifest"
        try:
            # The chain's previous manifest: most of this one's entries are its, unchanged.
            manifest = Manifest.decode(result.manifest.encode(),
                                       step_dir(self.config.root, result.step) / MANIFEST,
                                       result.step, known=self.books.chain.manifest)
        except CheckpointError as e:
            return f"the manifest committed for step {result.step} is unusable: {e}"
        self.books.committed(manifest)
        return None

    # -- one checkpoint ----------------------------------------------------------------------

    def plan(self, step: int, counts: torch.Tensor, rng: dict[str, torch.Tensor],
             extra: dict[str, Any],
             final: bool = False, rejected: str | None = None,
             captured: TakenAtSave | None = None,
             run: dict[str, Any] | None = None) -> SnapshotJob:
        """On the snapshot thread: what `step`'s snapshot copies and where, and its
        persist request. Collective (one small all-reduce). `final`: every expert is
        snapshotted and persisted, after the persist in flight. `rejected`: why this
        rank's save arguments were refused; the plan then fails on every rank.
        `captured`: the buffers and param groups taken at `save()` (`RankState.capture`).
        `run`: the run id and lineage the snapshot and its manifest record, as they
        were at `save()` (`EngineParts.run`)."""
        with self.lock:
            return self._plan(step, counts, rng, extra, final, rejected, captured,
                              run or {"id": self.config.run_id, "line": []})

    def _plan(self, step: int, counts: torch.Tensor, rng: dict[str, torch.Tensor],
              extra: dict[str, Any],
              final: bool, rejected: str | None,
              captured: TakenAtSave | None, run: dict[str, Any]) -> SnapshotJob:
        g, books, cfg = self.groups, self.books, self.config
        n_rejected = self.share(block=final or cfg.persist_policy == "wait", counts=counts,
                                rejected=rejected is not None)
        if n_rejected:
            raise ValueError(f"step {step} was not checkpointed: its save arguments were "
                             f"rejected on {n_rejected} of {g.world_size} rank(s)"
                             + (f"; here: {rejected}" if rejected else ""))
        books.warn_if_untracked(step, g.rank)
        # Without a persist process (it died), training goes on with snapshots only:
        # each checkpoint is reported as not persisted, and memory still recovers crashes.
        persist_now = books.in_flight is None and books.persist_alive
        if final:
            books.mark_final(step)
        if not books.persist_alive:
            books.settle(step, PERSIST_GONE)
        elif final and not persist_now:
            books.settle(step, f"the persist of step {books.in_flight} did not finish")
        manifest = books.chain.manifest
        lag = self.lag.planned(step, persist_now, manifest.step if manifest else None,
                               books.in_flight, books.persist_alive)
        flat = self.flat.take(rng, captured)  # the layout kept since the last plan
        plan = plan_snapshot(PlanInputs(
            step, final, persist_now, None if books.persist_alive else PERSIST_GONE, flat,
            self.state, g, books.chain, books.ledger, cfg, books.free_slot(),
            books.k_snapshot, books.next_snapshot(), books.take_chosen(), extra, run))
        future = None
        if persist_now:
            books.persist_started(step, plan.slot)
            future = self.persist.execute(PersistRequest(step, plan.prev_step, plan.template))
        held, persist, rank = flat.keys, self.persist, g.rank

        def on_done(header: SnapshotHeader) -> None:  # on the snapshot thread, sealed
            with self.lock:
                books.snapshot_taken(plan.slot)
            if persist_now:
                persist.ready(rank, step, plan.slot, plan.write, held)

        def on_error(error: BaseException) -> None:  # on the snapshot thread
            if persist_now:  # the chain goes on from the last commit
                persist.failed(rank, step, error)

        outcome = PlanOutcome(**{**plan.outcome.__dict__, "persist": future, "lag": lag})
        return SnapshotJob(plan.slot, plan.tensors, plan.meta, on_done=on_done,
                           on_error=on_error, outcome=outcome)

    # -- the end ---------------------------------------------------------------------------

    def persist_newest(self, store: SnapshotStore) -> tuple[str | None, int | None,
                                                            Future[Done] | None]:
        """`close()`: make the newest snapshot a complete checkpoint on storage, unless
        storage already holds it complete (a `final` save): a finished run's checkpoint
        must not hold experts many steps older than its step. On the caller's thread,
        after `flush` (no plan runs); collective. (why it could not, when it could not:
        a partial snapshot, no persist process; the step it persisted and the future of
        that persist's outcome, when it did). Its failure is fatal."""
        g, books = self.groups, self.books
        chain, slot = books.chain, books.newest_slot
        header = store.headers().get(slot) if slot is not None else None
        state = self.state.flatten()
        mine = None if header is None else [header.step, set(state) <= set(header.entries)]
        views = self.dist.all_gather(mine)
        if all(v is None for v in views):
            return None, None, None  # no snapshot since start or restore
        if any(v is None for v in views) or any(v[0] != views[0][0] for v in views):
            return "no snapshot of the same step on every rank", None, None
        step = views[0][0]
        m = chain.manifest
        if m is not None and (m.step > step or (
                m.step == step and bool((chain.saved_at >= step).all()))):
            return None, None, None  # already complete on storage
        if not all(v[1] for v in views):
            return (f"the newest snapshot (step {step}) is partial (K_snapshot < N); pass "
                    "final=True to the last save for a complete checkpoint", None, None)
        if not books.persist_alive:
            return PERSIST_GONE, None, None
        assert header is not None and slot is not None
        write = rank_share(self.state, g.layout, state, lambda key: True)
        books.mark_final(step)
        books.persist_started(step, None)
        cfg = self.config

        def template() -> dict[str, Any]:
            ledger = copy.deepcopy(books.ledger)
            ledger.load_json(header.meta["ledger"])  # the counts as of that snapshot
            return chain.template(step, mode=cfg.mode, layout=header.meta["layout"],
                                  model_meta=cfg.model_meta, extra=header.meta["extra"],
                                  written=chain.all_experts(), ledger=ledger,
                                  run={"id": cfg.run_id, "line": header.meta.get("line", [])})

        future = self.persist.execute(PersistRequest(step, m.step if m is not None else None,
                                                     template))
        self.persist.ready(g.rank, step, slot, write, list(header.entries))
        self.share(block=True)
        return None, step, future
