"""The plan of one two-level checkpoint, on the snapshot thread: what the snapshot copies
into which slot, and what is persisted.

    plan(step, counts, rng, extra)   share persist results and sum the token counts (one
                                     all-reduce), choose the experts, plan the sharded
                                     writes, pick a free slot, request the persist
    share(block)                     the same exchange without a checkpoint (flush)
    poll()                           rank 0's caller thread: results that have arrived

Every rank runs the same plans in the same order, so the collective inside pairs up and
every rank takes the same decisions (the persist results it acts on are rank 0's).

A dead persist process: rank 0 notices it before the exchange, reports the persist it
lost as failed and starts a new one (`_revive`); the exchange carries the new process's
generation, and every other rank reconnects to it right after (`_follow`), before this
plan's snapshot reports Ready. Nothing of the lost step was committed, so the chain goes
on from the last committed manifest: the chain's rotation only advances on a commit, and
the next persist writes the experts the lost one would have.
"""

from __future__ import annotations

import copy
import dataclasses
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moc.checkpoint.dist import Dist
from moc.checkpoint.errors import CheckpointError
from moc.checkpoint.failures import FailurePolicy
from moc.checkpoint.plan.chain import ChainState
from moc.checkpoint.plan.units import rank_share
from moc.checkpoint.policy.tokens import TokenLedger
from moc.checkpoint.state import RankState
from moc.checkpoint.store.manifest import Manifest
from moc.checkpoint.store.steps import MANIFEST, step_dir
from moc.checkpoint.twolevel.commit import watch_part
from moc.checkpoint.twolevel.nodes import NodeLayout
from moc.checkpoint.twolevel.persist import PersistClient
from moc.checkpoint.twolevel.protocol import (
    PERSIST_GONE,
    PERSIST_TIMEOUT_S,
    Abandon,
    Done,
    Failed,
    Persist,
    Ready,
)
from moc.checkpoint.twolevel.replica import ReplicaChannel
from moc.checkpoint.twolevel.sizing import snapshot_experts, snapshot_keys
from moc.checkpoint.twolevel.slots import N_SLOTS, SnapshotHeader, SnapshotStore
from moc.checkpoint.twolevel.worker import SnapshotJob
from moc.topology import ParallelGroups


@dataclass(frozen=True)
class PlanOutcome:
    """What a plan decided that the checkpoint's result reports."""

    k: int
    experts_saved: list[list[int]]
    persist_skipped: bool
    error: str | None
    k_snapshot: int
    k_snapshot_chosen: dict[str, Any] | None


@dataclass(frozen=True)
class PlanConfig:
    """What the plans of one engine have in common."""

    root: Path
    """The checkpoint directory (manifests committed by the persist process)."""
    mode: str
    model_meta: dict[str, Any]
    persist_policy: str
    """"skip" (persist only when no persist runs) or "wait" (the plan waits for it)."""
    run_id: str | None = None
    """The run the checkpoint directory belongs to; every snapshot carries it, and only
    snapshots of this run are ever restored (`store.identity`)."""
    nodes: NodeLayout | None = None
    """Which ranks share a node (None: one node); each node's leader speaks for its
    persist process."""
    nonce: str = ""
    """This job's mark on the records of a commit across nodes (`twolevel.commit`)."""


class SnapshotPlanner:
    """Owner, while a plan runs (the snapshot thread) and otherwise for the caller's
    thread after `wait_for_snapshot` (flush, restore): the chain state, the ledger's
    summed counts and K, the slot roles, K_snapshot and the persist in flight. `lock` is
    held by a plan; rank 0's caller takes it without blocking to poll for results.
    Results for the caller's records leave only through `reports` (a queue).
    """

    def __init__(self, state: RankState, groups: ParallelGroups, dist: Dist,
                 chain: ChainState, ledger: TokenLedger, client: PersistClient,
                 config: PlanConfig, k_snapshot: int,
                 on_commit: Callable[[], None] | None = None,
                 failures: FailurePolicy | None = None,
                 replicas: ReplicaChannel | None = None) -> None:
        self.state, self.groups, self.dist = state, groups, dist
        self.chain, self.ledger, self.client, self.config = chain, ledger, client, config
        self.k_snapshot = k_snapshot
        self.snap_index = 0
        """Partial snapshots so far: their sequential rotation's c."""
        self.choice: dict[str, Any] | None = None
        """Rank 0: a K_snapshot chosen by `auto`, shared at the next plan."""
        self.chosen: dict[str, Any] | None = None
        """The choice as shared, reported with the next checkpoint's result."""
        self.newest_slot: int | None = None
        """The newest complete snapshot: a recovery source, never overwritten."""
        self.persist_slot: int | None = None
        """Being read by the persist process; `persist_slot_step` is its step."""
        self.persist_slot_step: int | None = None
        self.in_flight: int | None = None
        """The step being persisted (None: none)."""
        self.persist_alive = True
        """Rank 0's view of the persist process, shared at each plan."""
        self.on_commit = on_commit
        """Rank 0: called when a checkpoint is committed (retention); a CheckpointError it
        raises is shared with every rank and raised there by `wait_for_snapshot`."""
        self.shared_error: str | None = None
        """An error of rank 0's background work, as shared with this rank."""
        self.failures = failures if failures is not None else FailurePolicy()
        """Counts the persists that failed, as every rank learns them (`share`)."""
        self.fatal: str | None = None
        """Why the run must stop (too many failed checkpoints, a failed final one);
        raised on the caller's thread, on every rank at the same call."""
        self.final_steps: set[int] = set()
        """Steps checkpointed with `final`: their failure is fatal."""
        self.replicas = replicas
        """This rank's replica channel (across nodes, None: no replicas): a channel that
        broke on any rank is broken on every rank at the next plan, so that all stop
        sending replicas at the same round, none waits for a peer that stopped."""
        self.tidy: dict[int, str] | None = None
        """Rank 0: the clean-up the read path left (`store.tidy`), sent with the next
        persist request, whose process does it before it writes."""
        nodes = config.nodes
        self.per_node = nodes.per_node if nodes is not None else groups.world_size
        self.n_nodes = nodes.n_nodes if nodes is not None else 1
        self.lock = threading.Lock()
        self.reports: queue.SimpleQueue[Done] = queue.SimpleQueue()
        self._unshared: list[Done] = []  # rank 0: results not yet shared
        self._error: str | None = None  # rank 0: on_commit's error, not yet shared
        self._persists = 0  # persist requests so far (the same count on every rank)

    # -- persist results ---------------------------------------------------------------------

    def poll(self) -> None:
        """Rank 0's caller thread: take the results that have arrived, unless a plan is
        sharing them right now (it takes them itself then). Never blocks."""
        if self.lock.acquire(blocking=False):
            try:
                self._receive(block=False)
            finally:
                self.lock.release()

    def _receive(self, block: bool) -> None:
        if not self.client.leader or self.in_flight is None:
            return
        if self.groups.rank != 0:
            # Another node's leader: its process answers for its own part only; node 0's
            # answers for the commit. Read, so that the connection never fills up.
            self.client.receive(self.in_flight, block=False)
            return
        for done in self.client.receive(self.in_flight, block):
            self._unshared.append(done)
            self.reports.put(dataclasses.replace(done, manifest=None))
            if done.step == self.in_flight:
                self.in_flight = None
        self.persist_alive = self.client.alive

    def share(self, block: bool, counts: torch.Tensor | None = None,
              rejected: bool = False) -> int:
        """Collective: every rank learns the same persist results and applies them; with
        `counts` (this rank's routed tokens since the last save), the same all-reduce
        also sums them into the ledger, and counts the ranks that `rejected` this
        checkpoint (returned). `block`: first wait for the persist in flight."""
        if self.client.leader:
            self._receive(block)
            self._revive()
        share = (self._unshared, self.in_flight, self.choice, self._error)
        # Summed in the same all-reduce: the counts, the ranks that rejected the save,
        # and per node its persist process's generation (+1) and whether it is gone for
        # good, each contributed by that node's leader alone.
        n = self.n_nodes
        node_info = torch.zeros(2 * n, dtype=torch.int64)
        if self.client.leader:
            node = self.groups.rank // self.per_node
            node_info[node] = self.client.generation + 1
            node_info[n + node] = int(not self.client.alive)
        counted = counts.flatten() if counts is not None else torch.zeros(0, dtype=torch.int64)
        broken = int(self.replicas is not None and self.replicas.broken is not None)
        summed = torch.cat([counted, torch.tensor([int(rejected), broken]), node_info])
        done, in_flight, choice, error = self.dist.exchange(share, summed)
        node_info = summed[-2 * n:]
        self._follow(int(node_info[self.groups.rank // self.per_node]) - 1)
        self._unshared, self.choice, self._error = [], None, None
        self.shared_error = self.shared_error or error
        if counts is not None:
            self.ledger.add_synced(summed[:counted.numel()])
        n_rejected = int(summed[counted.numel()])
        n_broken = int(summed[counted.numel() + 1])
        if n_broken and self.replicas is not None:
            self.replicas.mark_broken(f"on {n_broken} rank(s) of {self.groups.world_size}")
        # Any node's persist process gone for good stops every commit (node 0 waits for
        # every part), so every rank treats persisting as lost.
        self.persist_alive = not bool(node_info[n:].any())
        if choice is not None:
            self.k_snapshot, self.chosen = choice["k_snapshot"], choice
        for result in done:
            if self.groups.rank != 0:
                self.reports.put(dataclasses.replace(result, manifest=None))
                if self.client.leader and not result.ok:
                    self.client.send(Abandon(result.step))  # its process may be waiting
            if result.step == self.persist_slot_step:
                self.persist_slot = None
            error = None if result.ok else result.error or "failed"
            if result.ok:
                error = self._committed_from(result)
            self._judge(result.step, error)
        self.in_flight = in_flight
        return n_rejected

    def _judge(self, step: int, error: str | None) -> None:
        """One checkpoint's outcome, the same on every rank: too many failures in a row,
        or a failed final checkpoint, make the run stop (`fatal`)."""
        fatal = self.failures.check(step, error, step in self.final_steps)
        self.final_steps.discard(step)
        self.fatal = self.fatal or fatal

    def _revive(self) -> None:
        """A node's leader, before an exchange: notice a dead persist process even when
        nothing is in flight (an idle one can die too), report the persist it took with
        it as failed, and start a new one (bounded: `PersistClient.restart`). Another
        node than 0 reports it on storage, where node 0's process waits for its part
        (`watch_part`)."""
        if self.client.check():
            return
        # Another node's leader has nothing to do here for the step in flight: the
        # watcher started with its request (`_send_persist`) reports the lost part.
        if self.in_flight is not None and self.groups.rank == 0:
            lost = Done(self.in_flight, False, PERSIST_GONE)
            self._unshared.append(lost)
            self.reports.put(lost)
            self.in_flight = None
        self.client.restart()
        self.persist_alive = self.client.alive

    def _follow(self, generation: int) -> None:
        """Every rank but a leader: connect to its node leader's new persist process when
        the exchange says it started one. Blocks (seconds at most: it is listening)."""
        if not self.client.leader and generation != self.client.generation:
            self.client.reconnect(generation)

    def _send_persist(self, step: int, prev_step: int | None,
                      template: Callable[[], dict[str, Any]]) -> None:
        """A node's leader: ask its persist process to persist `step`; node 0's request
        carries the manifest's template (only node 0 commits)."""
        # Every rank counts the requests (they are collective decisions): the job's nonce
        # and the count mark this request's commit records, so that the records of an
        # earlier attempt at the same step (failed, then persisted again by `close`, or
        # after a restore) are never taken for this one's.
        self._persists += 1
        if not self.client.leader:
            return
        node = self.groups.rank // self.per_node
        nonce = f"{self.config.nonce}-{self._persists}"
        tidy, self.tidy = (self.tidy, None) if node == 0 else (None, self.tidy)
        self.client.send(Persist(step, prev_step, template() if node == 0 else None,
                                 self.per_node, node, self.n_nodes, nonce,
                                 self.groups.world_size, tidy))
        if node != 0:
            # Settled once the step is no longer in flight, or a newer request was made
            # (a new attempt at the same step has its own watcher).
            process, n = self.client.process, self._persists
            watch_part(self.config.root, step, node, nonce, PERSIST_TIMEOUT_S,
                       gone=lambda: process is None or process.poll() is not None,
                       settled=lambda: self.in_flight != step or self._persists != n)

    def take_error(self) -> str | None:
        """Rank 0: an error of `on_commit` not shared yet (for `close`, after the last
        plan); None elsewhere."""
        error, self._error = self._error, None
        return error

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
                                       result.step, known=self.chain.manifest)
        except CheckpointError as e:
            return f"the manifest committed for step {result.step} is unusable: {e}"
        self.committed(manifest)
        return None

    def committed(self, manifest: Manifest) -> None:
        """The chain continues from `manifest`, just committed (or restored)."""
        self.chain.advance(manifest)
        self.ledger.committed(manifest.tokens)
        if self.on_commit is not None:
            try:
                self.on_commit()
            except CheckpointError as e:  # shared with every rank at the next exchange
                self._error = str(e)

    # -- the end ---------------------------------------------------------------------------

    def persist_newest(self, store: SnapshotStore) -> str | None:
        """`close()`: make the newest snapshot a complete checkpoint on storage, unless
        storage already holds it complete (a `final` save): a finished run's checkpoint
        must not hold experts many steps older than its step. On the caller's thread,
        after `flush` (no plan runs); collective. Why it could not, when it could not
        (a partial snapshot, no persist process); its failure is `fatal`."""
        g, chain = self.groups, self.chain
        header = store.headers().get(self.newest_slot) if self.newest_slot is not None else None
        state = self.state.flatten()
        mine = None if header is None else [header.step, set(state) <= set(header.entries)]
        views = self.dist.all_gather(mine)
        if all(v is None for v in views):
            return None  # no snapshot since start or restore: nothing newer than storage
        if any(v is None for v in views) or any(v[0] != views[0][0] for v in views):
            return "no snapshot of the same step on every rank"
        step = views[0][0]
        m = chain.manifest
        if m is not None and (m.step > step or (
                m.step == step and bool((chain.saved_at >= step).all()))):
            return None  # already complete on storage
        if not all(v[1] for v in views):
            return (f"the newest snapshot (step {step}) is partial (K_snapshot < N); pass "
                    "final=True to the last save for a complete checkpoint")
        if not self.persist_alive:
            return PERSIST_GONE
        assert header is not None and self.newest_slot is not None
        write = rank_share(self.state, g.layout, state, lambda key: True)
        self.final_steps.add(step)
        self.in_flight = step

        def template() -> dict[str, Any]:
            ledger = copy.deepcopy(self.ledger)
            ledger.load_json(header.meta["ledger"])  # the counts as of that snapshot
            return chain.template(step, mode=self.config.mode, layout=header.meta["layout"],
                                  model_meta=self.config.model_meta, extra=header.meta["extra"],
                                  written=chain.all_experts(), ledger=ledger,
                                  run={"id": self.config.run_id,
                                       "line": header.meta.get("line", [])})

        self._send_persist(step, m.step if m is not None else None, template)
        self.client.send(Ready(g.rank, step, self.newest_slot, write, list(header.entries)))
        self.share(block=True)
        return None

    # -- one checkpoint ----------------------------------------------------------------------

    def plan(self, step: int, counts: torch.Tensor, rng: torch.Tensor, extra: dict[str, Any],
             final: bool = False, rejected: str | None = None,
             captured: dict[str, torch.Tensor] | None = None,
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

    def _plan(self, step: int, counts: torch.Tensor, rng: torch.Tensor, extra: dict[str, Any],
              final: bool, rejected: str | None,
              captured: dict[str, torch.Tensor] | None, run: dict[str, Any]) -> SnapshotJob:
        g, chain, ledger, cfg = self.groups, self.chain, self.ledger, self.config
        n_rejected = self.share(block=final or cfg.persist_policy == "wait", counts=counts,
                                rejected=rejected is not None)
        if n_rejected:
            raise ValueError(f"step {step} was not checkpointed: its save arguments were "
                             f"rejected on {n_rejected} of {g.world_size} rank(s)"
                             + (f"; here: {rejected}" if rejected else ""))
        ledger.warn_if_untracked(step, g.rank)
        # Without a persist process (it died), training goes on with snapshots only:
        # each checkpoint is reported as not persisted, and memory still recovers crashes.
        persist_now = self.in_flight is None and self.persist_alive
        if final:
            self.final_steps.add(step)
        if not self.persist_alive:
            self._judge(step, PERSIST_GONE)
        elif final and not persist_now:
            self._judge(step, f"the persist of step {self.in_flight} did not finish")
        selected = chain.all_experts() if final else chain.select(step, ledger)
        wanted = chain.wanted(selected, step)
        written = chain.written(selected, step)
        state = self.state.flatten(rng, captured)
        write = rank_share(self.state, g.layout, state, wanted) if persist_now else []
        slot = next(s for s in range(N_SLOTS) if s not in (self.newest_slot, self.persist_slot))
        experts = snapshot_experts(self.state.spec.n_experts, self.state.spec.n_moe_layers,
                                   self.k_snapshot, self.snap_index, g.layout.ep,
                                   written if persist_now else None,
                                   chain.manifest is None or final)
        layout = chain.layout(g.world_size, g.layout.ep)
        meta = {"extra": extra, "ledger": ledger.to_json(), **ledger.policy_json(),
                "snap_index": self.snap_index, "k_snapshot": self.k_snapshot,
                "model": cfg.model_meta, "layout": layout, "run_id": cfg.run_id,
                "line": run["line"]}
        outcome = PlanOutcome(ledger.k, written, not persist_now,
                              None if self.persist_alive else PERSIST_GONE, self.k_snapshot,
                              self.chosen)
        self.chosen = None
        self.snap_index += 1
        held = list(state)
        rank, client = g.rank, self.client

        def on_done(header: SnapshotHeader) -> None:  # on the snapshot thread
            if persist_now:
                client.send(Ready(rank, step, slot, write, held))

        def on_error(error: BaseException) -> None:  # on the snapshot thread
            if persist_now:
                # The persist process gives up on this step instead of waiting for a
                # snapshot that will never be ready; the chain goes on from the last one.
                client.send(Failed(rank, step, f"{type(error).__name__}: {error}"))

        if persist_now:
            self.persist_slot, self.persist_slot_step = slot, step
            self.in_flight = step
            self._send_persist(
                step, chain.manifest.step if chain.manifest is not None else None,
                lambda: chain.template(step, mode=cfg.mode, layout=layout,
                                       model_meta=cfg.model_meta, extra=extra,
                                       written=written, ledger=ledger, run=run))
        return SnapshotJob(slot, snapshot_keys(state, experts, chain.stems, set(write)), meta,
                           sizing=state, on_done=on_done, on_error=on_error, outcome=outcome)
