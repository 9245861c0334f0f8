"""One rank's peer replicas across nodes: what it sends after each snapshot, to whom, and
what it keeps for its own source (`twolevel.replicas.replica` has the wire and the slots).

    replication = Replication(nodes, rank, job, group, k_replica, jump, rate)
    report = replication.round(handle, snapshots, stems, spec, ep)   # snapshot thread

A round runs on the snapshot thread right after the copy, for the same step on every
rank (a plan is collective), so a slow replica delays the next checkpoint, never a
training step. A channel that broke on any rank is broken on every rank at the next plan
(`SnapshotPlanner.share`): from that round on, no rank sends.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from moc.checkpoint.errors import CheckpointError
from moc.checkpoint.spec import ExpertSpec
from moc.checkpoint.twolevel.memory.nodes import NodeLayout
from moc.checkpoint.twolevel.memory.slots import SnapshotStore
from moc.checkpoint.twolevel.replicas.replica import (
    ReplicaChannel,
    ReplicaReport,
    ReplicaStore,
    replica_keys,
)
from moc.checkpoint.twolevel.replicas.wire import exchange_replicas
from moc.checkpoint.twolevel.snapshot.worker import SnapshotHandle


class Replication:
    """This rank's replicas: the peer it sends to (`dst`), the one it keeps for (`src`),
    the slots it keeps them in (`store`), the channel, and the K_replica rotation.
    Owner: the snapshot thread (`round`); `sizes` and `release` are the caller's, after
    the rounds in flight are over."""

    def __init__(self, nodes: NodeLayout, rank: int, job: str, group: Any,
                 k_replica: int | str, jump: int, rate_Bps: float | None) -> None:
        self.dst = nodes.replica_dst(rank, jump)
        self.src = nodes.replica_src(rank, jump)
        self.store = ReplicaStore(job, self.src)
        self.channel = ReplicaChannel.of(group)
        self.k = None if k_replica == "all" else int(k_replica)
        """Experts per MoE layer a replica carries (None: all of them)."""
        self.rate_Bps = rate_Bps
        self._index = 0  # replicas sent: the K_replica rotation's c

    def round(self, handle: SnapshotHandle, snapshots: SnapshotStore,
              stems: dict[str, int], spec: ExpertSpec, ep: int) -> ReplicaReport | None:
        """Send `handle`'s snapshot (read from `snapshots`) to `dst` and receive `src`'s
        into `store`; None when the plan failed (on every rank: there is nothing to send,
        and no one sends). Blocks this thread until both transfers are done, each wait
        bounded. A snapshot that cannot be read sends a marker: the peer never waits for
        bytes that will not come."""
        if handle.job is None:
            return None
        if self.channel.broken is not None:
            return ReplicaReport(None, 0, None, 0, 0.0, "no replicas any more: the replica "
                                 f"channel broke ({self.channel.broken}); a restart mends it")
        outgoing, error = None, None
        if handle.header is not None and handle.slot is not None:
            header = handle.header
            try:
                keys = replica_keys(header, stems, spec.n_experts, spec.n_moe_layers, ep,
                                    self.k, self._index)
                outgoing = (header, snapshots.read(handle.slot, header, verify=False), keys)
            except (CheckpointError, OSError) as e:
                error = f"the snapshot of step {header.step} could not be read to send: {e}"
        self._index += 1
        report = exchange_replicas(self.channel, self.dst, self.src, outgoing, self.store,
                                   rate_Bps=self.rate_Bps)
        if error is not None:
            report = dataclasses.replace(
                report, error="; ".join(e for e in (error, report.error) if e))
        return report

    def sizes(self) -> dict[str, int]:
        """`replica_host_bytes` (the slots kept) and `replica_slot_bytes` (one replica)."""
        sizes = self.store.sizes()
        return {"replica_host_bytes": sizes["replica_host_bytes"],
                "replica_slot_bytes": sizes["replica_bytes"]}

    def release(self) -> None:
        self.store.release()
