"""A rank's end of persisting: requests to its node's persist process, and their outcomes
as futures.

    persist = PersistExecutor(client, groups, nodes, root, nonce)
    future = persist.execute(PersistRequest(step, prev_step, template))  # a node's leader sends
    persist.ready(rank, step, slot, write, held)   # this rank's snapshot of it is in memory
    future.result()                                # Done: committed, or why not

The process, its protocol and the commit across nodes are behind this object: the
planner asks for persists and the engine reads their futures; neither touches the
process or its connection.

A future resolves when this rank learns the outcome: rank 0 (which hears node 0's
process, the one that commits) as soon as it arrives, the other ranks when the plan's
exchange shares it (`SnapshotPlanner.share`). Either way the outcome acts on the engine's
state only at the exchange, the same on every rank (`EngineState.settle`).
"""

from __future__ import annotations

import dataclasses
import secrets
import subprocess
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from moc.checkpoint.dist import Dist
from moc.checkpoint.errors import CheckpointError
from moc.checkpoint.store.identity import read_run_id
from moc.checkpoint.store.storage import Storage
from moc.checkpoint.store.tidy import WriteTidy
from moc.checkpoint.twolevel.memory.jobdir import claim_job
from moc.checkpoint.twolevel.memory.nodes import NodeLayout
from moc.checkpoint.twolevel.persist.client import PersistClient
from moc.checkpoint.twolevel.persist.commit import watch_part
from moc.checkpoint.twolevel.persist.protocol import (
    PERSIST_TIMEOUT_S,
    Abandon,
    Done,
    Failed,
    Persist,
    Ready,
)
from moc.checkpoint.twolevel.persist.watch import PersistWatch
from moc.topology import ParallelGroups


@dataclass(frozen=True)
class PersistRequest:
    """One persist a plan asks for."""

    step: int
    prev_step: int | None
    """The committed step its manifest chains from (None: a new chain)."""
    template: Callable[[], dict[str, Any]]
    """The manifest's fields but entries and files; built only on node 0's leader."""


class PersistExecutor:
    """This rank's persist requests and their outcomes. Owners: the thread that holds
    the planner's lock (a plan, or the caller's thread between plans); `ready` and
    `failed` may also be sent from the snapshot thread's copy callbacks (the client keeps
    messages whole)."""

    def __init__(self, client: PersistClient, groups: ParallelGroups,
                 nodes: NodeLayout | None, storage: Storage, nonce: str) -> None:
        self.client, self.storage, self.nonce = client, storage, nonce
        self.rank, self.world_size = groups.rank, groups.world_size
        self.per_node = nodes.per_node if nodes is not None else groups.world_size
        self.n_nodes = nodes.n_nodes if nodes is not None else 1
        self.node = self.rank // self.per_node
        self.tidy: dict[int, str] | None = None
        """Rank 0: the clean-up the read path left (`store.tidy`), sent with the next
        persist request, whose process does it before it writes."""
        self._requests = 0  # persist requests so far (the same count on every rank)
        self._futures: dict[int, Future[Done]] = {}
        self._unshared: list[Done] = []  # rank 0: outcomes not yet shared
        self._generations: list[int] | None = None  # every node's process, as last shared

    @classmethod
    def start(cls, job: str, storage: Storage, run_id: str | None, groups: ParallelGroups,
              dist: Dist, nodes: NodeLayout) -> PersistExecutor:
        """Collective: each node's leader claims the job's shared memory on its node and
        starts the node's persist process; the other ranks connect only once every
        leader says its process is up, and raise a leader's error when one is not: every
        rank fails within seconds with the same line, none waits out a connect timeout.
        Across nodes, also a check that every node sees the same checkpoint directory.
        The job's nonce is rank 0's."""
        client, error = None, None
        if nodes.is_leader(groups.rank):
            try:
                if nodes.n_nodes > 1 and run_id is not None and read_run_id(storage.root) != (
                        run_id):
                    raise CheckpointError(
                        f"node {nodes.node(groups.rank)} does not see rank 0's checkpoint "
                        f"directory {storage} (no {run_id!r} run id there): across nodes the "
                        "checkpoint directory must be storage every node sees (a shared file "
                        "system or an object store URL)")
                claim_job(job)
                # Node 0's process answers once every node's part is written: across
                # nodes it gets twice as long, so that another node's hung process is
                # found and replaced by its own leader first.
                patience = 2.0 if groups.rank == 0 and nodes.n_nodes > 1 else 1.0
                client = PersistClient(job, storage, groups.rank, leader=True,
                                       watch=PersistWatch(patience))
            except CheckpointError as e:
                error = f"node {nodes.node(groups.rank)}: {e}" if nodes.n_nodes > 1 else str(e)
        errors = [e for e in dist.all_gather(error) if e is not None]
        nonce = dist.broadcast(secrets.token_hex(8) if groups.rank == 0 else None)
        if errors:
            if client is not None:
                client.stop()
            raise CheckpointError(errors[0])
        client = client or PersistClient(job, storage, groups.rank, 0, leader=False)
        return cls(client, groups, nodes, storage, nonce)

    # -- the process, for the engine's drills and reports ------------------------------------

    @property
    def leader(self) -> bool:
        """Whether this rank runs its node's persist process."""
        return self.client.leader

    @property
    def process(self) -> subprocess.Popen | None:
        """The node's persist process (its leader's view; None elsewhere)."""
        return self.client.process

    @property
    def generation(self) -> int:
        return self.client.generation

    def stop(self) -> None:
        self.client.stop()

    def abandon(self) -> None:
        """In-job recovery: the process ends now, its outcomes are never awaited."""
        self.client.abandon()

    # -- requests -------------------------------------------------------------------------

    def execute(self, request: PersistRequest) -> Future[Done]:
        """Ask for `request`'s step to be persisted (a node's leader sends it to its
        process; node 0's carries the manifest's template); the future of its outcome."""
        # Every rank counts the requests (they are collective decisions): the job's nonce
        # and the count mark this request's commit records, so that the records of an
        # earlier attempt at the same step (failed, then persisted again by `close`, or
        # after a restore) are never taken for this one's.
        self._requests += 1
        future: Future[Done] = Future()
        self._futures[request.step] = future
        if not self.client.leader:
            return future
        nonce, n = f"{self.nonce}-{self._requests}", self._requests
        tidy, self.tidy = (self.tidy, None) if self.node == 0 else (None, self.tidy)
        self.client.send(Persist(request.step, request.prev_step,
                                 request.template() if self.node == 0 else None,
                                 self.per_node, self.node, self.n_nodes, nonce,
                                 self.world_size, tidy))
        if self.node != 0:
            # Settled once the outcome is known, or a newer request was made (a new
            # attempt at the same step has its own watcher).
            process = self.client.process
            watch_part(self.storage, request.step, self.node, nonce, PERSIST_TIMEOUT_S,
                       gone=lambda: process is None or process.poll() is not None,
                       settled=lambda: future.done() or self._requests != n)
        return future

    def ready(self, rank: int, step: int, slot: int, write: list, held: list[str]) -> None:
        """This rank's snapshot of `step` is in `slot`: its process may read `write`."""
        self.client.send(Ready(rank, step, slot, write, held))

    def failed(self, rank: int, step: int, error: BaseException) -> None:
        """This rank's snapshot of `step` failed: its process gives up on the step
        instead of waiting for a snapshot that will never be ready."""
        self.client.send(Failed(rank, step, f"{type(error).__name__}: {error}"))

    def add_tidy(self, tidy: WriteTidy | None) -> None:
        """Rank 0, at start and after a restore (no plan runs): the clean-up the read
        path left for the write path goes to the persist process with the next persist
        request, so that it touches storage there, never on a training step."""
        work = tidy.take() if tidy is not None else None
        if work is not None:
            self.tidy = {**(self.tidy or {}), **work}

    # -- outcomes ----------------------------------------------------------------------------

    def receive(self, in_flight: int | None, block: bool) -> list[Done]:
        """A node's leader: the outcomes that arrived while `in_flight` is persisted;
        with `block`, waiting for that one. Only rank 0's count (node 0's process
        commits); another leader reads its connection so that it never fills up."""
        if not self.client.leader or in_flight is None:
            return []
        if self.rank != 0:
            self.client.receive(in_flight, block=False)
            return []
        received = self.client.receive(in_flight, block)
        for done in received:
            self._unshared.append(done)
            self._resolve(done)
        return received

    def revive(self, in_flight: int | None, block: bool = False) -> int | None:
        """A node's leader, before an exchange: notice a dead persist process even when
        nothing is in flight (an idle one can die too), kill one its watch finds stopped
        or hung (`block`: training waits for it anyway, so a stopped one gets STOPPED_S
        to go on), and start a new one (bounded: `PersistClient.restart`). The step it
        took with it (rank 0), reported failed; another node's leader reports its lost
        part on storage (`watch_part`)."""
        if not self.client.leader or self.client.check(block):
            return None
        lost = None
        if in_flight is not None and self.rank == 0:
            lost = in_flight
            done = Done(in_flight, False, self.client.lost)
            self._unshared.append(done)
            self._resolve(done)
        self.client.restart()
        return lost

    @property
    def alive(self) -> bool:
        """A leader's view of its process (True elsewhere: the exchange tells)."""
        return self.client.alive

    def node_info(self) -> torch.Tensor:
        """This rank's share of the exchange's per-node sums: a leader contributes its
        process's generation (+1) and whether it is gone for good."""
        info = torch.zeros(2 * self.n_nodes, dtype=torch.int64)
        if self.client.leader:
            info[self.node] = self.client.generation + 1
            info[self.n_nodes + self.node] = int(not self.client.alive)
        return info

    def take_unshared(self) -> list[Done]:
        """Rank 0: the outcomes to share at this exchange."""
        out, self._unshared = self._unshared, []
        return out

    def shared(self, node_info: torch.Tensor, outcomes: list[Done]) -> bool:
        """After the exchange: follow a new persist process of this node (a rank that is
        not its leader connects to it; seconds at most), resolve the shared outcomes, and
        tell this node's process to stop waiting for a step that failed elsewhere.
        Whether every node's persist process is alive."""
        generation = int(node_info[self.node]) - 1
        if not self.client.leader and generation != self.client.generation:
            self.client.reconnect(generation)
        generations = [int(g) for g in node_info[:self.n_nodes]]
        if self.rank == 0 and self._generations not in (None, generations):
            # A persist process was replaced: what it was writing is an orphan `.tmp`
            # directory, removed as at start (`store.tidy`), by the next persist.
            self.tidy = self.tidy or {}
        self._generations = generations
        for done in outcomes:
            if self.rank != 0:
                self._resolve(done)
                if self.client.leader and not done.ok:
                    self.client.send(Abandon(done.step))  # its process may be waiting
        return not bool(node_info[self.n_nodes:].any())

    def _resolve(self, done: Done) -> None:
        future = self._futures.pop(done.step, None)
        if future is not None and not future.done():
            future.set_result(dataclasses.replace(done, manifest=None))
