"""A rank's snapshots: its slots in node-local shared memory, the thread that fills them,
and (across nodes) the replica of each snapshot sent to a peer node's memory.

    snapshots = Snapshotter(job, rank, nodes, k_replica, jump, rate, device)  # collective
    snapshots.prepare(size)                 # the slots made ready, in the background
    handle = snapshots.stage(step, plan, ready, chain, spec, ep)        # returns at once
    handle.wait()                           # captured (right before optimizer.step)
    header = handle.wait_sealed()           # sealed: a recovery source
    handle.replica                          # this rank's replica round, a future (or None)

The engine hands it a plan (what to copy where) and reads handles; the slots, the copier
(a CUDA stream of its own on a GPU), the worker thread, the replica group and its stores
are behind this object.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_all
from typing import Any

import torch
import torch.distributed as tdist

from moc.checkpoint.plan.chain import ChainState
from moc.checkpoint.spec import ExpertSpec
from moc.checkpoint.state import RankState
from moc.checkpoint.store.storage import Storage
from moc.checkpoint.twolevel.memory.jobdir import job_dir, remove_job
from moc.checkpoint.twolevel.memory.native import default_threads
from moc.checkpoint.twolevel.memory.nodes import NodeLayout
from moc.checkpoint.twolevel.memory.places import slot_layout
from moc.checkpoint.twolevel.memory.slots import SnapshotHeader, SnapshotStore
from moc.checkpoint.twolevel.recovery.copies import Peers, invalidate_node
from moc.checkpoint.twolevel.replicas.replica import ReplicaChannel
from moc.checkpoint.twolevel.replicas.replication import Replication
from moc.checkpoint.twolevel.snapshot.capture import copier_for
from moc.checkpoint.twolevel.snapshot.worker import SnapshotHandle, SnapshotJob, SnapshotWorker

log = logging.getLogger(__name__)


class Snapshotter:
    """This rank's snapshot slots, snapshot thread and peer replicas. Owner: the
    caller's thread (stage, wait, release); the thread runs what it is handed."""

    def __init__(self, job: str, rank: int, nodes: NodeLayout, k_replica: int,
                 replica_jump: int, replica_rate: float | None,
                 device: torch.device | None = None) -> None:
        """`device`: where the model's state lives (a CUDA device: its copies run on a
        stream of their own into pinned slots; None or a CPU: host copies)."""
        self.job, self.rank, self.nodes = job, rank, nodes
        self.threads = default_threads()
        """Native threads a seal hashes on."""
        self.copier = copier_for(device)
        self.store = SnapshotStore(job, rank, pin=self.copier.pin)
        self.worker = SnapshotWorker()
        self._prepared: Future | None = None
        self._stopping = threading.Event()  # set by release: a preparation ends early
        self.peers: Peers | None = None
        """Across nodes: the replica group, for replication and for restores that reach
        another node's memory."""
        self.replication: Replication | None = None
        """This rank's peer replicas (None: one node, or none are sent)."""
        if nodes.n_nodes > 1:
            self.peers = Peers(nodes, tdist.new_group(backend="gloo"), job)
            if k_replica != 0:
                self.replication = Replication(nodes, rank, job, self.peers.group, k_replica,
                                               replica_jump, replica_rate)

    @property
    def replicas(self) -> ReplicaChannel | None:
        """The channel replicas go through (None: none are sent)."""
        return self.replication.channel if self.replication is not None else None

    def stage(self, step: int, plan: Callable[[], SnapshotJob], ready: Any,
              chain: ChainState, spec: ExpertSpec, ep: int) -> SnapshotHandle:
        """Hand `step`'s snapshot to the thread: `plan` decides what to copy and where,
        then the copy; across nodes, then its replica round (`handle.replica`)."""
        handle = SnapshotHandle(self.worker, self.store, self.copier, step, plan, ready,
                                self.threads)
        replication = self.replication
        if replication is not None:
            handle.replica = self.worker.submit(lambda: replication.round(
                handle, self.store, chain.stems, spec, ep))
        return handle

    @property
    def device(self) -> torch.device | None:
        """The CUDA device the snapshots copy from (None: the host)."""
        return self.copier.pin

    def mark_ready(self) -> Any:
        """On the training thread, at a save: a CUDA event recorded on the current
        stream, which the snapshot's plan and copies wait for (the state and what
        `save()` queued for the host are final once the work before it is done); None
        on the host. Blocking: whoever waits for it sleeps, and never spins a core."""
        if self.copier.pin is None:
            return None
        ready = torch.cuda.Event(blocking=True)
        ready.record(torch.cuda.current_stream(self.copier.pin))
        return ready

    def prepare(self, size: int) -> None:
        """Make the slots ready for snapshots of `size` bytes (`SnapshotStore.prepare`:
        reserved, faulted in, pinned), on the snapshot thread, ahead of the snapshot that
        needs them; once (a later, larger state is prepared by its snapshot). A failure
        here is met again, and reported, by that snapshot."""
        if self._prepared is not None:
            return
        store, stop = self.store, self._stopping

        def run() -> None:
            try:
                store.prepare(size, stop.is_set)
            except Exception as e:  # reported by the snapshot that meets it again
                log.info("the snapshot slots could not be prepared ahead: %s", e)

        self._prepared = self.worker.submit(run)

    def prepare_for(self, state: RankState) -> Callable[[], None]:
        """`prepare` at the size of `state` as it is when called: the optimizer hooks
        call it after the first step, once the optimizer's state exists."""
        return lambda: self.prepare(slot_layout(state.sizing())[1])

    def wait_prepared(self) -> None:
        """Block until the slots' preparation (if any) is over: before the caller's
        thread reads them (a restore), and at a save. A save that came before the
        preparation was over (training kept every core busy, and the snapshot thread
        runs in SCHED_IDLE) waits for it here, so that the first checkpointed step pays
        for it, with the cores training leaves while it waits, rather than the next one,
        queued behind it."""
        if self._prepared is not None:
            self._prepared.result()

    @staticmethod
    def wait_for_replicas(rounds: list[Future]) -> None:
        """Block until these replica rounds are over (local: no collective)."""
        wait_all(rounds)

    def headers(self) -> dict[int, SnapshotHeader]:
        return self.store.headers()

    def newest_step(self) -> int | None:
        """The step of this rank's newest snapshot in memory (None: none)."""
        return max((h.step for h in self.store.headers().values()), default=None)

    def sizes(self) -> dict[str, int]:
        """Host memory held for checkpoints: the slots and the replicas kept for a peer
        (`ckpt_host_bytes` their sum)."""
        sizes = self.store.sizes()
        if self.replication is not None:
            sizes.update(self.replication.sizes())
            sizes["ckpt_host_bytes"] += sizes["replica_host_bytes"]
        return sizes

    def invalidate_newer_than(self, step: int) -> None:
        """After restoring `step`: forget newer snapshots (this rank's) and, on a node's
        leader across nodes, every newer snapshot and replica its node holds."""
        self.store.invalidate_newer_than(step)
        if self.peers is not None and self.nodes.is_leader(self.rank):
            invalidate_node(self.job, step)

    def release(self) -> None:
        """Stop the thread (after its work, but a preparation of the slots, which ends
        at the next slot: seconds of pinning must not hold up an engine let go in a
        recovery) and unmap the slots and replicas."""
        self._stopping.set()
        try:
            self.worker.stop()
        finally:
            self.store.release()
            if self.replication is not None:
                self.replication.release()


def remove_unless_needed(job: str, newest: int | None, storage: Storage,
                         persist_alive: bool) -> None:
    """A node's leader, at close: remove the job's shared memory unless its newest
    snapshot (`newest`) is newer than the newest complete step on storage, or the
    persist process was lost (then a restart of the job resumes from it; the next job
    start removes it once its owner is gone)."""
    try:
        durable = storage.steps()
    except OSError as e:  # a store that cannot be listed proves nothing: keep them
        log.warning("kept the snapshots in %s: the checkpoint directory %s cannot be "
                    "listed (%s)", job_dir(job), storage, e)
        return
    if newest is not None and (not durable or newest > durable[-1] or not persist_alive):
        log.warning("kept the snapshot of step %d in %s: it is newer than the newest "
                    "checkpoint on storage (%s)", newest, job_dir(job),
                    f"step {durable[-1]}" if durable else "none")
        return
    remove_job(job)
