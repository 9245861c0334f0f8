"""`moc.TwoLevelCheckpointer`: PEC + sharding + a snapshot in memory + a background persist,
on one node or many, with peer replicas in another node's memory.

    ckpt = moc.TwoLevelCheckpointer(model, optimizer, "ckpt/", policy=moc.PECPolicy(k=1),
                                    interval=10, keep_last=3)
    ckpt.watch_routing(model)               # routed tokens, for PLT (moc.RoutingRecorder)

The training loop around it is the contract's, the same for every engine (the module
docstring of moc/checkpoint/api.py, the README and examples/ show it whole).

Instead of `watch_routing`, a loop may hand the counts itself every step:
`ckpt.record_routing(tokens_per_expert)`, (MoE layers, global experts) of this rank.

How a checkpoint goes:

    save(s)              hand step s to the snapshot thread and return at once; that
                         thread runs the plan (`twolevel.planner`: one small all-reduce,
                         the experts, the sharded writes, a free slot) and copies this
                         rank's state into node-local shared memory (`twolevel.memory.slots`)
    wait_for_snapshot()  right before optimizer.step(): blocks only if the copy is not
                         done yet; the stall is max(0, copy time - forward/backward time)
    persist process      writes the K_persist experts + non-expert share of each rank
                         from shared memory to storage and commits the manifest
                         (`twolevel.persist.server`, speaking `twolevel.persist.protocol`)

The snapshot is complete (every expert: K_snapshot = N) unless asked otherwise
(`twolevel.snapshot.sizing`). Host memcpy is cheap, and a complete snapshot makes recovery from a
process crash exact: no tokens are lost. Only what reaches storage is partial
(K_persist), which bounds what a node loss costs.

Across nodes (`twolevel.memory.nodes`): each node has its own shared memory and its own persist
process, run by its leader (local rank 0); every node writes its ranks' files and node
0's process commits the manifest once every node's part is on storage
(`twolevel.persist.commit`). After each snapshot, every rank also sends it (all experts, or
K_replica per layer) to the memory of the node `replica_jump` nodes on
(`twolevel.replicas.replica`), on the snapshot thread, over its own gloo group: losing a node
then loses nothing.

Recovery (`twolevel.recovery.memory`): the ranks agree on the newest step every rank can
restore, each from its own node's memory when its snapshot there is complete and its
checksums hold, else from a copy in another node's memory (its peer replica), else from
storage ("memory", "peer", "mixed"); with no such step, from storage alone ("storage").

When a new checkpoint comes while the previous persist is still running, `persist_policy`
decides: "skip" (the default) takes the snapshot but does not persist it, and the skip
is reported; "wait" makes the snapshot wait until the running persist is done, so
training waits for it in `wait_for_snapshot()`.

This class only composes the parts and keeps the caller's bookkeeping (the checkpoints
in flight, owned by the caller's thread, and the one snapshot being taken):

    Snapshotter      the slots, the snapshot thread and the peer replicas (`stage` -> handle)
    PersistExecutor  the persist process, its protocol and the commit (`execute` -> future)
    EngineState      the one owner of the chain, the ledger, the slot roles, the persist
                     in flight and the checkpoints' failures
    SnapshotPlanner  the exchange and the plan (`snapshot_plan`, a pure function)

With `optimizer=None` the constructor returns the model-only engine instead, a reader of
storage (`twolevel.recovery.reader.StorageReader`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from moc.checkpoint.api import (
    CheckpointEngine,
    CheckpointResult,
    RecoveryReport,
    checked_save,
)
from moc.checkpoint.dist import raise_failures
from moc.checkpoint.errors import CheckpointError
from moc.checkpoint.failures import DEFAULT_MAX_FAILURES
from moc.checkpoint.parts import EngineParts
from moc.checkpoint.policy.selection import PECPolicy
from moc.checkpoint.routing import EngineRouting
from moc.checkpoint.spec import ExpertSpec
from moc.checkpoint.twolevel.engine_state import EngineState
from moc.checkpoint.twolevel.memory.jobdir import default_job_id, job_dir, remove_job
from moc.checkpoint.twolevel.memory.nodes import NodeLayout
from moc.checkpoint.twolevel.persist.executor import PersistExecutor
from moc.checkpoint.twolevel.planner import PlanConfig, SnapshotPlanner
from moc.checkpoint.twolevel.recovery.copies import PREFER
from moc.checkpoint.twolevel.recovery.reader import StorageReader
from moc.checkpoint.twolevel.restore import restore_engine
from moc.checkpoint.twolevel.results import Checkpoints
from moc.checkpoint.twolevel.snapshot.capture import capture_mode
from moc.checkpoint.twolevel.snapshot.hooks import OptimizerHooks
from moc.checkpoint.twolevel.snapshot.sizing import AutoSnapshotK, parse_k_replica, parse_k_snapshot
from moc.checkpoint.twolevel.snapshot.worker import background_priority
from moc.checkpoint.twolevel.snapshotter import Snapshotter, remove_unless_needed
from moc.topology import ParallelGroups

PERSIST_POLICIES = ("skip", "wait")
log = logging.getLogger(__name__)


def _check_options(persist_policy: str, prefer: str = "exact") -> None:
    """What both forms of the engine refuse before they touch anything."""
    if prefer not in PREFER:
        raise ValueError(f"prefer must be one of {', '.join(PREFER)}, got {prefer!r}")
    if persist_policy not in PERSIST_POLICIES:
        raise ValueError(f"persist_policy must be one of {', '.join(PERSIST_POLICIES)}, "
                         f"got {persist_policy!r}")
    background_priority()  # a bad MOC_CKPT_PRIORITY fails here, not in the background
    capture_mode()  # and a bad MOC_CPU_CAPTURE


class TwoLevelCheckpointer(EngineRouting, CheckpointEngine):
    """Two-level checkpointing, `moc.checkpoint.api.CheckpointEngine`: `save` returns at
    once, a snapshot thread copies the state into node-local shared memory behind the next
    forward and backward, a persist process per node writes the partial (K_persist) share
    to storage, and across nodes each snapshot is replicated to a peer node's memory. How
    a checkpoint and a recovery go: the module docstring.

    Choose it when checkpoint stalls matter: training waits only in `wait_for_snapshot()`,
    and a crashed process (or, across nodes, a lost node) recovers exactly from memory;
    only when a node and its peer are both lost does it fall back to storage, losing the
    tokens PLT reports.

    Takes `moc.Checkpointer`'s arguments, plus `job` (the shared-memory job id; default:
    derived from the directory, so torchrun restarts of a run find its snapshots),
    `persist_policy` ("skip" or "wait") and `k_snapshot` (int, "all" or "auto"); across
    nodes also `k_replica` ("all", an int K, or 0 for no replicas), `replica_jump` (node
    i keeps node i - jump's replicas; default 1) and `replica_rate` (bytes/s a rank may
    send, None: unlimited); the directory must then be storage every node sees.
    `prefer`: "exact" (an older step exact on every rank before a newer partial one,
    `twolevel.recovery.copies`) or "newest".

    With `optimizer=None` (model-only: restore for inference, never save) the
    constructor returns a `twolevel.recovery.reader.StorageReader`, which leaves the training
    job's memory and persist process alone.
    """

    def __new__(cls, model: nn.Module, optimizer: object, directory: str | Path,
                **options: Any) -> Any:
        if optimizer is None:
            _check_options(options.pop("persist_policy", "skip"), options.pop("prefer", "exact"))
            for name in ("k_snapshot", "k_replica", "replica_jump", "replica_rate"):
                options.pop(name, None)
            return StorageReader(model, directory, **options)
        return super().__new__(cls)

    def __init__(self, model: nn.Module, optimizer: object, directory: str | Path, *,
                 experts: ExpertSpec | None = None, groups: ParallelGroups | None = None,
                 policy: PECPolicy | None = None, interval: int = 10,
                 keep_last: int | None = None, model_meta: dict[str, Any] | None = None,
                 mode: str = "moc", job: str | None = None, persist_policy: str = "skip",
                 k_snapshot: int | str | None = None,
                 max_failures: int | None = DEFAULT_MAX_FAILURES,
                 k_replica: int | str | None = "all", replica_jump: int = 1,
                 replica_rate: float | None = None, prefer: str = "exact") -> None:
        _check_options(persist_policy, prefer)
        self.prefer = prefer
        self.parts = p = EngineParts.build(
            model, optimizer, directory, experts=experts, groups=groups, policy=policy,
            interval=interval, keep_last=keep_last, model_meta=model_meta, mode=mode,
            max_failures=max_failures)
        self.root, self.spec, self.interval = p.root, p.spec, interval
        try:
            if not p.storage.shared_across_processes:
                raise ValueError(
                    f"two-level checkpointing cannot persist to {p.root}: a memory:// store "
                    "lives in one process, and the persist process is another; use s3:// "
                    "(or another shared store), a local directory, or the synchronous "
                    "engine (--ckpt-mode pec)")
            self.nodes = NodeLayout.from_env(p.groups.world_size)
            self.nodes.check_jump(replica_jump)
            k_replica = parse_k_replica(k_replica, p.spec.n_experts)
            k, auto = parse_k_snapshot(k_snapshot, p.spec.n_experts)
        except ValueError:
            p.release()  # the directory's lock: a corrected retry must find it free
            raise
        self.auto_k = AutoSnapshotK(p.groups.rank, p.spec.n_experts, p.spec.n_moe_layers,
                                    p.groups.layout.ep) if auto else None
        """`k_snapshot="auto"` while it measures (None: K_snapshot is fixed)."""
        self.job = job or default_job_id(directory)
        try:
            self.persist = PersistExecutor.start(self.job, p.storage, p.run_id, p.groups,
                                                 p.dist, self.nodes)
        except BaseException:
            p.release()
            raise
        self.snapshots = Snapshotter(self.job, p.groups.rank, self.nodes, k_replica,
                                     replica_jump, replica_rate, device=p.state.device)
        self.books = EngineState(
            p.chain, p.ledger, p.failures, k,
            on_commit=p.retention.request if p.retention is not None else None)
        self.planner = SnapshotPlanner(
            p.state, p.groups, p.dist, self.books, self.persist,
            PlanConfig(p.root, p.mode, p.model_meta, persist_policy, p.run_id, self.nodes,
                       self.persist.nonce), replicas=self.snapshots.replicas)
        self.persist.add_tidy(self.parts.tidy)
        self._in_flight = Checkpoints()
        self._hooks = OptimizerHooks(self, (t for _, t in p.state.named),
                                     self.snapshots.prepare_for(p.state))

    # -- the training loop's calls -------------------------------------------------------

    def save(self, step: int, extra_state: dict[str, Any] | None = None, *,
             final: bool = False) -> None:
        """Start a checkpoint of `step` and return at once.

        This thread only takes what cannot wait (the routed-token counts and the RNG
        state of this step, a copy of `extra_state`, the persistent buffers and param
        groups: `RankState.capture`) and hands the checkpoint to the
        snapshot thread, which does the rest behind the next forward and backward pass.
        Training waits only in `wait_for_snapshot()`, and only if all that outlasts the
        window. The result comes out of `drain_completed()`.

        Invalid arguments raise ValueError here in a single process; under
        torch.distributed the checkpoint's plan fails on every rank instead (raised by
        `wait_for_snapshot`), so that no rank waits for a plan another never starts.
        `final`: see `CheckpointEngine.save`; `flush`/`close` raise if it fails."""
        t0 = time.perf_counter()
        if step in self._in_flight:
            raise ValueError(f"step {step} is already being checkpointed (its persist is "
                             "not reported yet); save each step once")
        p = self.parts
        rejected, extra, captured = None, {}, None
        try:
            extra = checked_save(step, extra_state)
            p.check_save(step)
            captured = p.state.capture()
        except ValueError as e:
            if not p.groups.distributed:
                raise
            rejected = str(e)
        else:
            p.order.saved(step)
        run = p.run  # this line's, as of this save
        self.wait_for_snapshot()  # the previous checkpoint's capture (normally done)
        self.snapshots.wait_prepared()  # the slots' preparation, if not over yet (once)
        counts = p.ledger.take_pending(wait=self.snapshots.device is None)  # device: queued
        rng = p.state.rng()
        # The snapshot thread's plan and copies wait for the work queued so far (the
        # counts and param groups above reach the host with it); this thread does not.
        ready = self.snapshots.mark_ready()
        planner = self.planner
        handle = self.snapshots.stage(
            step, lambda: planner.plan(step, counts, rng, extra, final, rejected, captured,
                                       run),
            ready, p.chain, self.spec, p.groups.layout.ep)
        self._in_flight.started(handle, time.perf_counter() - t0)

    def wait_for_snapshot(self) -> None:
        """Blocks until the snapshot being taken is captured (every byte in its slot: the
        state may change again): the only place training waits on a checkpoint. Its seal
        (checksums, header) goes on in the background. Raises, once, what the plan, the
        capture or an earlier seal met, and what the background work's agreed failures
        are (`EngineState.raise_failure`)."""
        self._in_flight.wait_captured()
        self._settle(block=False)  # the seal before it is over: the thread runs in order
        self._raise_failure()

    def _settle(self, block: bool) -> None:
        """Take the seals that are over (`block`: wait for every one): their results are
        final, `k_snapshot="auto"` measures them, and a seal that failed is raised here,
        once."""
        sealed = self._in_flight.sealed(block)
        if self.auto_k is not None and sealed:
            choice = self.auto_k.observe(sealed, self.parts.chain.stems, self.parts.ledger.k)
            if choice is not None:
                with self.planner.lock:  # no plan runs now; the seal's own may touch books
                    self.books.choose(choice)  # shared at the next plan
            self.auto_k = self.auto_k if self.auto_k.measuring else None

    def _raise_failure(self) -> None:
        """The engine's one exit for the failures of its background work (agreed by
        every rank at a plan's exchange): raised here, on the caller's thread."""
        self.books.raise_failure(self._persist_lost)

    @property
    def capturing(self) -> bool:
        """Whether a snapshot is being captured: the state must not change until
        `wait_for_snapshot()` returns (the optimizer hooks wait for it)."""
        return self._in_flight.capturing

    @property
    def pending(self) -> bool:
        """Whether a checkpoint is still being taken or persisted, or not drained yet."""
        return bool(self._in_flight)

    def drain_completed(self) -> list[CheckpointResult]:
        """Checkpoints whose snapshot is taken and whose persist has finished or was
        skipped. Rank 0 hears of persists; the other ranks report snapshots only."""
        rank = self.parts.groups.rank
        self._settle(block=False)
        if rank == 0:
            self.planner.poll()
        return self._in_flight.drain(rank, self.parts.mode)

    def flush(self) -> None:
        """Wait for the snapshot (its seal too) and the persist in flight (collective);
        their results are then in `drain_completed()`."""
        self.wait_for_snapshot()
        self._settle(block=True)
        self.wait_for_replicas()  # a restore's transfers use the same process group
        self.planner.share(block=True)
        self._raise_failure()

    def wait_for_replicas(self) -> None:
        """Block until this rank's replica rounds in flight are over. Local (no
        collective): the snapshot thread finishes them with its peers on its own."""
        self.snapshots.wait_for_replicas(self._in_flight.replica_rounds())

    def background_pids(self) -> list[int]:
        """This rank's persist process, when it runs its node's (for fault drills)."""
        process = self.persist.process
        return [process.pid] if process is not None and process.poll() is None else []

    def drop_node_memory(self) -> None:
        """Delete this job's snapshots and replicas in this node's memory: what losing
        the machine loses (fault drills)."""
        remove_job(self.job)

    def host_memory(self) -> dict[str, int]:
        """Host memory this rank holds for checkpoints: its own snapshot slots and the
        peer replicas it keeps (`ckpt_host_bytes`, their sum), one snapshot's size, and
        the replicas' share (`replica_host_bytes`)."""
        return self.snapshots.sizes()

    # -- recovery --------------------------------------------------------------------------

    def restore(self, step: int | None = None) -> RecoveryReport | None:
        """Restore the newest step every rank can restore, from memory where it can
        ("memory", "peer", "mixed") or from storage ("storage"). `step`: roll back to
        that step, from storage (`CheckpointEngine.restore`). Collective.

        A checkpoint still being taken or persisted finishes first: a rollback in the
        middle of a run must not race the snapshot thread's collective, nor leave a
        persist that commits after the restore.
        """
        self.flush()
        self.snapshots.wait_prepared()  # the slots are the restore's to read now
        try:
            return restore_engine(self.parts, self.snapshots, self.books, step, self.prefer)
        finally:
            self.persist.add_tidy(self.parts.tidy)  # what the read path left to tidy
            # The restore replaced the optimizer's state: the cached layout would keep
            # the old tensors alive until the next plan found it stale.
            self.planner.forget_layout()

    # -- the end ---------------------------------------------------------------------------

    def close(self, keep_snapshots: bool = False) -> None:
        """Finish the checkpoints in flight, make the newest snapshot a complete
        checkpoint on storage (unless a `final` save already did), stop the persist
        process and remove this job's shared memory (unless `keep_snapshots`, or unless
        it holds a snapshot newer than the newest checkpoint on storage: then it is the
        only copy and stays for a restart to recover). Collective. Raises what went
        wrong on every rank: CheckpointError when the persist process was lost for good
        (the job must not look successful with its checkpoints in memory),
        CheckpointFailedError when the final checkpoint failed."""
        p = self.parts
        failures = []
        try:
            self.flush()
            why, step, persisted = self.planner.persist_newest(self.snapshots.store)
            if why is not None and p.groups.rank == 0:
                log.warning("the newest checkpoint on storage is not complete: %s", why)
            if step is not None and persisted is not None:
                self._in_flight.persisted_again(step, persisted)
            # A retention error learned in that flush has no later plan to share it.
            failures = p.dist.agree(self.books.take_unshared())
        finally:
            self._release(self.persist.stop, remove_memory=not keep_snapshots)
        self._raise_failure()
        raise_failures(failures, p.groups.world_size)
        lost = self._persist_lost()
        if lost:
            raise CheckpointError(lost)

    def abandon(self) -> None:
        """`CheckpointEngine.abandon`: the snapshot being taken fails on the destroyed
        groups (waited for, not raised), the snapshot thread and the replica rounds end,
        the persist process is killed (its step is abandoned, never half-committed: a
        commit is atomic) and the slots are unmapped. The snapshots stay in the node's
        memory: the new engine restores from them."""
        self._in_flight.abandon()
        try:
            self._release(self.persist.abandon, remove_memory=False)
        except CheckpointError as e:  # retention's: there is no caller to raise it to
            log.warning("retention did not stop cleanly while abandoning the engine: %s", e)

    def _release(self, end_persist: Callable[[], None], remove_memory: bool) -> None:
        """The end of `close` and `abandon`: the optimizer hook, the persist process
        (`end_persist`), the snapshot thread (after its work) and the slots, this job's
        shared memory on a node's leader when `remove_memory` (`remove_unless_needed`),
        retention (its error raised) and the directory's lock, whatever fails."""
        p = self.parts
        try:
            self._hooks.remove()
            end_persist()
        finally:
            self.snapshots.release()
            try:
                if remove_memory and self.nodes.is_leader(p.groups.rank):
                    remove_unless_needed(self.job, self.snapshots.newest_step(), p.storage,
                                         self.books.persist_alive)
                if p.retention is not None:
                    p.retention.close()
            finally:
                p.release()

    def _persist_lost(self) -> str | None:
        """What to say when the persist process is gone for good (None: it is not)."""
        return self.books.persist_lost(job_dir(self.job))
