"""Peer replicas: a rank's newest snapshot, copied into the host memory of another node.

A snapshot in node-local shared memory survives a crash of the training process but not
the loss of its node. Each rank therefore sends its newest snapshot (all of it, or only
K experts per MoE layer plus every non-expert key: `replica_keys`) to rank dst(r) on
another node and keeps the one it receives from rank src(r), in

    /dev/shm/moc-<job>/replica-<src>/slot-<i>.bin     the replica's bytes, compact
    /dev/shm/moc-<job>/replica-<src>/slot-<i>.json    its header, once complete and verified

This module keeps them (`ReplicaStore`) and the channel they travel on
(`ReplicaChannel`: every wait bounded, broken for good on a failure); how they travel,
the frame, the stream and the checks, is `twolevel.replicas.wire`.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from moc.checkpoint.errors import CheckpointError
from moc.checkpoint.spec import parse_expert_key
from moc.checkpoint.twolevel.memory.jobdir import write_private
from moc.checkpoint.twolevel.memory.slots import SnapshotHeader, SnapshotStore
from moc.checkpoint.twolevel.snapshot.sizing import snapshot_experts

REPLICA_SLOTS = 2
"""One slot being received, one holding the newest complete replica: the fewest that
never overwrite the only complete copy, and the host memory a replica costs is bounded
by twice its size (a third slot would buy nothing: replicas are not persisted from)."""
CHUNK_BYTES = 64 << 20
"""Bytes per message: large enough that per-message latency is noise, small enough that
a rate limit is smooth and a sender's staging buffer stays small."""
TIMEOUT_S = 120.0
"""The longest one wait of a replica round may last beyond what a rate limit implies
(gloo's sends and receives otherwise wait forever: a peer stopped or wedged would hang
this rank's snapshot thread, and with it every later checkpoint). It must cover the
peer reaching the same round (ranks start theirs after copies of different lengths:
tens of GB at a few GB/s), reserving the receiving slot (an fallocate of that size),
and one chunk on a slow or shared link (64 MiB at 1 Gbit/s: half a second), on a loaded
host; two minutes is far above all of them and still a bounded stall. A rate limit adds
twice the larger of the two sides' seconds per chunk (`ReplicaChannel.post`)."""
_TAG = 14

@dataclass(frozen=True)
class ReplicaReport:
    """One rank's side of one replication round (or of `send_replica`)."""

    step_sent: int | None
    """The step this rank sent; None when it sent a marker (no snapshot)."""
    bytes_sent: int
    """Stream bytes sent (the tensors, 8-byte aligned; the frame not counted)."""
    step_received: int | None
    """The step now published in the store; None when the source sent a marker, or the
    replica failed its checks (then `error` says why)."""
    bytes_received: int
    seconds: float
    error: str | None
    """What went wrong on this rank's side: a snapshot it could not send, a received
    replica refused (checksum mismatch, bad frame, no room). None when all went well or
    the source merely had nothing to send."""


class ReplicaChannelBroken(CheckpointError):
    """This rank's replica channel is broken: a transfer failed in transport (a peer
    gone, a read or write error of gloo's), a peer did not answer within the bound, or
    a round was cut short on this rank. The two sides of its process group no longer
    agree on what comes next, so this rank never uses it again: every later round,
    send or receive on it raises this at once. `reason` says what broke it first."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"the replica channel is broken ({reason}); no replica is sent or "
                         "received over it again in this process (a restart of the job "
                         "makes a new one)")
        self.reason = reason


class ReplicaChannel:
    """One rank's replica process group, and whether it can still be used: the owner of
    its `broken` state. Every send and receive of replicas goes through `post`, whose
    waits are bounded (`timeout_s`); a transport error, a timeout or a round cut short
    on this rank breaks the channel for good (`ReplicaChannelBroken`).

    Design note: gloo keeps a receive that timed out posted, and may still complete it
    (or a send) later, into the tensor it was given; those tensors (a replica slot's
    mapping, a staging buffer) are kept alive here (`_abandoned`) so that a late write
    never lands in freed memory. A broken channel is never mended in-process: which
    message a peer sends next is no longer known."""

    def __init__(self, group: Any, *, timeout_s: float = TIMEOUT_S) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
        self._group: Callable[[], Any] = lambda: group
        self.timeout_s = timeout_s
        self.broken: str | None = None
        """Why the channel broke (the first reason), or None while it is usable."""
        self._abandoned: list[Any] = []

    @classmethod
    def of(cls, group: Any) -> ReplicaChannel:
        """The channel of `group` (made once, then the same object; None: the default
        group): callers that hold the process group alone still never reuse one that
        broke."""
        if isinstance(group, ReplicaChannel):
            return group
        group = dist.group.WORLD if group is None else group
        with _CHANNELS_LOCK:  # the snapshot thread's rounds, the caller's restores
            channel = _CHANNELS.get(group)
            if channel is None:
                channel = _CHANNELS[group] = cls(group)
                # Held weakly, or the registry's value would keep its own key alive.
                channel._group = weakref.ref(group)
        return channel

    @property
    def group(self) -> Any:
        group = self._group()
        if group is None:
            raise self.mark_broken("its process group was destroyed")
        return group

    def check(self) -> None:
        """Raise ReplicaChannelBroken when the channel is broken."""
        if self.broken is not None:
            raise ReplicaChannelBroken(self.broken)

    def mark_broken(self, reason: str) -> ReplicaChannelBroken:
        """Break the channel (the first reason is kept) and return the error to raise.
        For callers that learn another rank's channel broke: stop using this one too."""
        if self.broken is None:
            self.broken = reason
        return ReplicaChannelBroken(self.broken)

    @contextlib.contextmanager
    def round(self, what: str) -> Iterator[None]:
        """One exchange over the channel: refused at once when it is broken, and broken
        when anything escapes it (the peer's side of the round is left waiting, so the
        next message is no longer known): raised as ReplicaChannelBroken."""
        self.check()
        try:
            yield
        except ReplicaChannelBroken:
            raise
        except Exception as e:
            raise self.mark_broken(f"{what}: {type(e).__name__}: {e}") from e
        except BaseException:
            self.mark_broken(f"{what}: interrupted")
            raise

    def post(self, dst: int | None, src: int | None, send: torch.Tensor | None,
             recv: torch.Tensor | None, pace_s: float = 0.0) -> None:
        """Post a send to `dst` and a receive from `src`, then wait for both (blocks until
        both are done, at most `timeout_s` plus twice `pace_s`, the seconds per chunk a
        rate limit may add, for each). Posting both before waiting is what keeps a ring
        from deadlocking. Raises ReplicaChannelBroken, the channel broken, on a
        transport error or a timeout."""
        self.check()
        works, held = [], []
        bound = timedelta(seconds=self.timeout_s + 2 * pace_s)
        try:
            if send is not None and send.numel():
                works.append(dist.isend(send, dst, group=self.group, tag=_TAG))
                held.append(send)
            if recv is not None and recv.numel():
                works.append(dist.irecv(recv, src, group=self.group, tag=_TAG))
                held.append(recv)
            if any(w is None for w in works):
                raise CheckpointError("this rank is not in the replica group")
            for w in works:
                w.wait(timeout=bound)
        except Exception as e:
            self._abandoned.append((works, held))  # gloo may still use them: keep them
            raise self.mark_broken(
                f"transfer to rank {dst} / from rank {src} failed or had no answer within "
                f"{bound.total_seconds():.0f} s: {e}") from e


_CHANNELS: weakref.WeakKeyDictionary[Any, ReplicaChannel] = weakref.WeakKeyDictionary()
"""`ReplicaChannel.of`'s channels by process group (gone with their group)."""
_CHANNELS_LOCK = threading.Lock()


class ReplicaStore(SnapshotStore):
    """The replicas this node holds of rank `src`'s snapshots: REPLICA_SLOTS slots under
    `<job dir>/replica-<src>/`, with the snapshot slots' header format and trust rules
    (secure directories, 0600 files, no symbolic links followed). Written only by
    `exchange_replicas`; read by recovery (`headers`, `read`, `send_replica`)."""

    def __init__(self, job: str, src: int) -> None:
        super().__init__(job, src, n_slots=REPLICA_SLOTS, name=f"replica-{src:05d}")
        self.src = src

    def sizes(self) -> dict[str, int]:
        """Host memory held by these replicas (`replica_host_bytes`, at most
        REPLICA_SLOTS times `replica_bytes`) and the largest replica's size."""
        own = super().sizes()
        return {"replica_host_bytes": own["ckpt_host_bytes"],
                "replica_bytes": own["snapshot_bytes"]}

    def newest(self) -> tuple[int, SnapshotHeader] | None:
        """(slot, header) of the newest complete replica, or None."""
        headers = self.headers()
        if not headers:
            return None
        slot = max(headers, key=lambda s: headers[s].step)
        return slot, headers[slot]

    def _begin(self, size: int) -> tuple[int, torch.Tensor]:
        """A slot to receive `size` bytes into, and its mapping: never the one holding
        the newest complete replica; an empty one before an older replica. Its header
        is removed first: from here on it is incomplete."""
        headers = self.headers()
        newest = self.newest()
        free = [s for s in range(self.n_slots) if newest is None or s != newest[0]]
        slot = min(free, key=lambda s: (s in headers, headers[s].step if s in headers else 0))
        self.header_path(slot).unlink(missing_ok=True)
        return slot, self._map(slot, size, allocate=True)

    def _publish(self, slot: int, header: SnapshotHeader, size: int) -> None:
        """Write the header (atomically: complete from here on), then reserve the other
        slot at this size so a node short of memory fails now, not mid-transfer."""
        write_private(self.header_path(slot), header.to_json())
        self.prepare(size)


def replica_keys(header: SnapshotHeader, stems: dict[str, int], n_experts: int,
                 n_moe_layers: int, ep: int, k: int | None, index: int) -> list[str]:
    """The keys of `header` a replica carries, in the snapshot's order: every non-expert
    key, and the expert keys of the experts `snapshot_experts` selects for replica
    `index` (K per MoE layer in sequential rotation, so successive replicas cover every
    expert; all of them when `k` is None or >= n_experts). Only keys the snapshot holds:
    a partial snapshot gives a partial replica.

    `stems`: MoE layer of each expert key stem (the chain's `stems`)."""
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise ValueError(f"k (experts per layer in a replica) must be an integer >= 1 or "
                         f"None for all of them, got {k!r}")
    if k is None or k >= n_experts:
        return list(header.entries)
    experts = snapshot_experts(n_experts, n_moe_layers, k, index, ep, None, False)
    out = []
    for key in header.entries:
        parsed = parse_expert_key(key)
        if parsed is not None:
            layer = stems.get(parsed[1])
            if layer is None:
                raise ValueError(f"expert key {key!r}: its stem {parsed[1]!r} is not among "
                                 f"the model's expert stems {sorted(stems)}; pass the "
                                 "stems of the model that wrote the snapshot")
            if parsed[2] not in experts[layer]:
                continue
        out.append(key)
    return out
