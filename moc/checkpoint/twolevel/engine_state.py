"""The two-level engine's state, in one owner: the chain and the ledger it continues, the
roles of the snapshot slots, the partial-snapshot rotation and K_snapshot, the persist in
flight, and the outcome of every checkpoint.

    books = EngineState(chain, ledger, failures, k_snapshot, on_commit)
    slot = books.free_slot()                 # never the newest snapshot or the persisted one
    books.persist_started(step, slot)        # a plan asked for `step` to be persisted
    books.settle(step, error)                # one checkpoint's agreed outcome (every rank)
    books.raise_failure()                    # on the caller's thread: what must stop the run

Every change goes through a method, on the thread that owns the engine at that moment:
the snapshot thread while a plan runs (it holds the planner's lock), the caller's thread
otherwise (after `wait_for_snapshot`: flush, restore, close). Nothing else writes these
fields; before this object they were written from three classes.

The one failure path: whatever goes wrong with a checkpoint (its persist failed, the
persist process is gone, a final checkpoint could not be persisted, retention after a
commit failed on rank 0) reaches `settle` or `fail` only after the ranks agreed on it in
the plan's exchange (`SnapshotPlanner.share`), so every rank holds the same failures at
the same call, and `raise_failure` raises them on every rank the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from moc.checkpoint.errors import CheckpointError
from moc.checkpoint.failures import CheckpointFailedError, FailurePolicy
from moc.checkpoint.plan.chain import ChainState
from moc.checkpoint.policy.tokens import TokenLedger
from moc.checkpoint.store.manifest import Manifest
from moc.checkpoint.twolevel.memory.slots import N_SLOTS
from moc.checkpoint.twolevel.persist.protocol import MAX_RESTARTS


class EngineState:
    """What the two-level engine knows between checkpoints (see the module docstring)."""

    def __init__(self, chain: ChainState, ledger: TokenLedger, failures: FailurePolicy,
                 k_snapshot: int, on_commit: Callable[[], None] | None = None) -> None:
        self.chain, self.ledger, self.failures = chain, ledger, failures
        self.k_snapshot = k_snapshot
        """Experts per layer a snapshot holds (the same on every rank)."""
        self.snap_index = 0
        """Partial snapshots so far: their sequential rotation's c."""
        self.newest_slot: int | None = None
        """The newest complete snapshot: a recovery source, never overwritten."""
        self.persist_slot: int | None = None
        """Being read by the persist process; `persist_slot_step` is its step."""
        self.persist_slot_step: int | None = None
        self.in_flight: int | None = None
        """The step being persisted (None: none)."""
        self.persist_alive = True
        """Whether every node's persist process is up (or can still be restarted)."""
        self.choice: dict[str, Any] | None = None
        """Rank 0: a K_snapshot chosen by `auto`, shared at the next plan."""
        self.chosen: dict[str, Any] | None = None
        """The choice as shared, reported with the next checkpoint's result."""
        self.final_steps: set[int] = set()
        """Steps checkpointed with `final`: their failure is fatal."""
        self._on_commit = on_commit
        self._unshared_error: str | None = None  # rank 0: on_commit's, not yet shared
        self._shared_error: str | None = None  # agreed: raised once by raise_failure
        self._fatal: str | None = None  # agreed: the run must stop

    # -- the slots ---------------------------------------------------------------------------

    def free_slot(self) -> int:
        """A slot the next snapshot may overwrite: neither the newest snapshot (a recovery
        source) nor the one the persist process reads."""
        return next(s for s in range(N_SLOTS) if s not in (self.newest_slot, self.persist_slot))

    def snapshot_taken(self, slot: int) -> None:
        """The snapshot in `slot` is complete: the newest recovery source."""
        self.newest_slot = slot

    def next_snapshot(self) -> int:
        """The index of the snapshot being planned (the rotation's c), counted."""
        self.snap_index += 1
        return self.snap_index - 1

    def persist_started(self, step: int, slot: int | None) -> None:
        """A persist of `step` was requested, reading `slot` (None: the newest)."""
        if slot is not None:
            self.persist_slot, self.persist_slot_step = slot, step
        self.in_flight = step

    def persist_answered(self, step: int | None) -> None:
        """Rank 0 heard the outcome of the persist of `step` (or lost it): no persist is
        in flight, as the next exchange tells every rank."""
        if step is not None and step == self.in_flight:
            self.in_flight = None

    def persist_in_flight(self, step: int | None) -> None:
        """The step being persisted, as rank 0 shared it."""
        self.in_flight = step

    def persist_liveness(self, alive: bool) -> None:
        """Whether persisting can go on (rank 0's view; every node's after an exchange)."""
        self.persist_alive = alive

    def mark_final(self, step: int) -> None:
        """`step` is checkpointed with `final`: its failure stops the run."""
        self.final_steps.add(step)

    def persist_ended(self, step: int) -> None:
        """The persist of `step` is over (committed or not): its slot is free again."""
        if step == self.persist_slot_step:
            self.persist_slot = None
        if step == self.in_flight:
            self.in_flight = None

    def choose(self, choice: dict[str, Any]) -> None:
        """Rank 0: K_snapshot chosen by `auto`, to share at the next plan."""
        self.choice = choice

    def chose(self, choice: dict[str, Any] | None) -> None:
        """The choice as shared: every rank snapshots K of it from now on."""
        if choice is not None:
            self.k_snapshot, self.chosen = choice["k_snapshot"], choice
        self.choice = None

    def take_chosen(self) -> dict[str, Any] | None:
        """The shared choice, once: reported with the checkpoint planned next."""
        chosen, self.chosen = self.chosen, None
        return chosen

    # -- the chain and the ledger ----------------------------------------------------------

    def counted(self, summed: torch.Tensor) -> None:
        """Every rank's routed tokens since the last checkpoint, summed by the exchange."""
        self.ledger.add_synced(summed)

    def warn_if_untracked(self, step: int, rank: int) -> None:
        """A partial checkpoint with no routing recorded: PLT would be unknown."""
        self.ledger.warn_if_untracked(step, rank)

    def committed(self, manifest: Manifest) -> None:
        """The chain continues from `manifest`, just committed (or restored). Rank 0's
        retention runs here; its error is shared with every rank at the next exchange."""
        self.chain.advance(manifest)
        self.ledger.committed(manifest.tokens)
        if self._on_commit is not None:
            try:
                self._on_commit()
            except CheckpointError as e:
                self._unshared_error = str(e)

    def restored_from_memory(self, slot: int, snap_index: int, ledger: str,
                             storage: Manifest | None) -> None:
        """A restore from the snapshot in `slot`: it is the newest, nothing is being
        persisted, the rotation and the ledger go on from it, and the chain from the
        newest manifest on storage (None: it starts again)."""
        self.newest_slot, self.persist_slot, self.in_flight = slot, None, None
        self.snap_index = snap_index + 1
        self.ledger.load_json(ledger)
        if storage is not None:
            self.committed(storage)
        else:
            self.chain.reset()

    def restored_from_storage(self) -> None:
        """A restore from storage (the chain and ledger were loaded with the manifest):
        no snapshot in memory is newer or a recovery source."""
        self.newest_slot = self.persist_slot = self.in_flight = None

    # -- outcomes ---------------------------------------------------------------------------

    def settle(self, step: int, error: str | None) -> None:
        """One checkpoint's agreed outcome, the same on every rank: too many failures in a
        row, or a failed final checkpoint, make the run stop."""
        fatal = self.failures.check(step, error, step in self.final_steps)
        self.final_steps.discard(step)
        self._fatal = self._fatal or fatal

    def take_unshared(self) -> str | None:
        """Rank 0: an error of its background work (retention) for the next exchange."""
        error, self._unshared_error = self._unshared_error, None
        return error

    def fail(self, error: str | None) -> None:
        """An error of rank 0's background work, as the exchange shared it with every
        rank: raised once by `raise_failure`."""
        self._shared_error = self._shared_error or error

    def raise_failure(self, persist_lost: Callable[[], str | None]) -> None:
        """The one place a failure of the background work is raised on the caller's
        thread, the same on every rank: a shared error of rank 0's work (CheckpointError,
        once), or why the run must stop (CheckpointFailedError, with what the loss of the
        persist process means when it is lost)."""
        error, self._shared_error = self._shared_error, None
        if error:
            raise CheckpointError(error)
        fatal, self._fatal = self._fatal, None
        if fatal:
            lost = persist_lost()
            raise CheckpointFailedError(f"{fatal}; {lost}" if lost else fatal)

    def persist_lost(self, where: object) -> str | None:
        """What to say when the persist process is gone for good (None: it is not):
        where the checkpoints that never reached storage are (`where`, the job's memory),
        and what to do. Every rank (persist_alive is agreed at each plan)."""
        if self.persist_alive:
            return None
        manifest = self.chain.manifest
        return (
            f"the persist process died and could not be restarted ({MAX_RESTARTS} "
            "restarts at most); checkpoints after "
            f"{f'step {manifest.step}' if manifest is not None else 'the start'} reached "
            f"shared memory only, kept in {where}: restart the job on this node to resume "
            "from them, after fixing the persist process's error (above)")
