"""Recovery from the snapshots in host memory, each rank from the nearest copy it has.

    restored = restore_from_memory(MemoryQuery(store, root, state, dist, ...))  # None: storage

The ranks agree on the newest step every rank can restore, each from (in this order)
its own snapshot of it in its node's memory ("memory"), a copy of it in another node's
memory ("peer": the peer replica that node keeps, or the rank's own snapshot left on a
node it no longer runs on), or storage when the step is persisted there ("storage").
Copies are complete only when their checksums hold. The report's source is "memory"
when every rank used its own memory, "peer" when none needed storage and some used a
peer, "mixed" when some but not all used storage; when no step qualifies the caller
restores from storage alone ("storage").

A peer copy travels over the replica process group: the leader of the node holding it
reads it (checking its CRCs) and sends it to the rank that needs it (`twolevel.replicas.replica`),
pair by pair in one global order, so the transfers cannot deadlock. Every transfer
happens before any rank loads, so an error in one rank's load never leaves a partner
waiting in a send.

Which version, and which copy of it each rank takes: `twolevel.recovery.copies` (the exact copy
wins). A partial snapshot (K_snapshot < N) holds some experts only; each of the others
comes from its newest copy in an older snapshot slot or in storage, and the tokens routed
to it since that copy count as lost (`at_copy`, accounted by the ledger). When the
replicas of an expert came back from different sources ("mixed"), they are made equal to
the freshest (`twolevel.recovery.alignment`), so replicas never diverge.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moc.checkpoint.api import RecoveryReport
from moc.checkpoint.dist import Dist
from moc.checkpoint.errors import CheckpointError
from moc.checkpoint.lineage import Lineage
from moc.checkpoint.policy.tokens import PLTReport
from moc.checkpoint.recovery import (
    CheckpointReader,
    DictReader,
    LazyKey,
    check_run,
    restore_loop,
)
from moc.checkpoint.spec import parse_expert_key
from moc.checkpoint.state import RankState
from moc.checkpoint.store.manifest import Manifest
from moc.checkpoint.twolevel.memory.native import default_threads
from moc.checkpoint.twolevel.memory.slots import SnapshotHeader, SnapshotStore
from moc.checkpoint.twolevel.recovery.alignment import (
    Origins,
    align_expert_replicas,
    copy_counts,
    oldest_copy,
)
from moc.checkpoint.twolevel.recovery.copies import (
    Holdings,
    KnownCopies,
    Peers,
    Version,
    expert_keys,
    node_holdings,
    stores,
)
from moc.checkpoint.twolevel.replicas.wire import receive_replica, send_replica

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryRestore:
    step: int
    slot: int | None
    """This rank's slot restored (None: this rank restored from storage)."""
    meta: dict[str, Any]
    """The snapshot's meta (loop state, ledger, policy state), as a memory rank has it."""
    source: str
    """"memory" or "mixed"."""
    recovery_s: float
    at_copy: torch.Tensor
    """(layers x experts) cumulative token count at the copy of each expert restored."""
    stale: bool
    """Whether some rank restored an expert from a copy older than `step`."""
    sources: list[str]
    """Per rank: "memory", "peer" or "storage"."""
    passed_over: str | None = None
    """The newer step this restore did not take because some rank had only a lossy copy
    of it, and what taking it would have cost (None: it took the newest)."""

    def report(self, plt: PLTReport) -> RecoveryReport:
        """The engine's report of this restore, with the tokens it lost (`plt`, the
        ledger's `recover`)."""
        sources: dict[str, list[int]] = {}
        for rank, source in enumerate(self.sources):
            sources.setdefault(source, []).append(rank)
        return RecoveryReport(self.step, self.meta["extra"], self.source, self.recovery_s,
                              plt.lost_tokens, plt.lost_per_layer, plt.plt, plt.k,
                              plt.k_before, sources=sources, passed_over=self.passed_over)


def overall_source(sources: list[str]) -> str:
    """The report's source for the ranks' sources (see the module docstring)."""
    if all(s == "memory" for s in sources):
        return "memory"
    if "storage" not in sources:
        return "peer"
    return "storage" if all(s == "storage" for s in sources) else "mixed"


@dataclass(frozen=True)
class MemoryQuery:
    """What a restore from memory needs to know of the engine."""

    store: SnapshotStore
    """This rank's snapshot slots."""
    root: Path
    state: RankState
    dist: Dist
    storage: list[int]
    """The complete steps on storage (the same list on every rank)."""
    layout: dict[str, int]
    model_meta: dict[str, Any]
    tracked_kind: str
    run_id: str | None
    peers: Peers | None = None
    """Across nodes: reach the copies other nodes hold."""
    prefer: str = "exact"
    """"exact": an older step every rank has an exact copy of (its own memory, a peer
    replica) is taken before a newer one that some rank has only a lossy copy of;
    "newest": the newest step every rank can restore, whatever it loses."""


def restore_from_memory(q: MemoryQuery) -> MemoryRestore | None:
    """Restore the newest checkpoint every rank can restore with some rank's memory (its
    own, or a peer's); None when there is none (or every such one failed on some rank).
    Collective.

    A snapshot older than the newest persisted step is used only when it is exact on
    every rank, that step is not (some of its experts are older than it), and `prefer`
    is "exact": the steps after it are set aside (`restore_engine`), as a rollback does.
    Only snapshots of this run (`run_id`, the checkpoint directory's), of the same model
    and layout, and of a line of training that continues the newest persisted step (its
    lineage says so, `moc.checkpoint.lineage`) are candidates: memory left by another
    run, or by another job that resumed this directory along another line, is never
    restored nor mixed with what storage holds.
    """
    newest = q.storage[-1] if q.storage else None
    base, storage_exact, storage_lost = _storage_lineage(q.root, newest, q.dist, q.run_id)
    if newest is not None and base is None:
        return None  # the newest persisted step cannot be read: storage's restore decides
    restore = _Restore.gather(q, base, newest, storage_exact)
    restore.known.storage_lost = storage_lost
    # Any failure here (a corrupt slot, a missing file) is agreed on, never left to one rank.
    restored, _ = restore_loop(restore.known.attempts(q.dist.all_gather), restore.load,
                               q.dist, skip=(Exception,),
                               label=lambda v: f"the snapshot of step {v[0]}")
    return None if restored is None else restore.finish(*restored)


class _Restore:
    """The restore of one candidate version into this rank, and what the ledger needs
    once every rank restored it (`finish`)."""

    def __init__(self, q: MemoryQuery, base: Lineage | None, newest: int | None,
                 headers: dict[int, SnapshotHeader], known: KnownCopies) -> None:
        self.q, self.base, self.newest = q, base, newest
        self.headers = headers
        """This rank's candidate snapshots, by slot."""
        self.mine = {_version(q, base, newest, h): slot for slot, h in headers.items()}
        self.known = known
        self.origins: Origins = {}
        self.metas: dict[str, dict[str, Any]] = {f"slot-{slot}": h.meta
                                                 for slot, h in headers.items()}
        self.t0 = time.perf_counter()

    @classmethod
    def gather(cls, q: MemoryQuery, base: Lineage | None, newest: int | None,
               storage_exact: bool) -> _Restore:
        """Collective: every rank's candidate versions, and every node's holdings."""
        def version(h: SnapshotHeader) -> Version | None:
            return _version(q, base, newest, h)

        headers = {slot: h for slot, h in q.store.headers().items() if version(h) is not None}
        mine = sorted((version(h), expert_keys(h.entries)) for h in headers.values())
        gathered = q.dist.all_gather((mine, expert_keys(q.state.flatten())))
        held: Holdings = {}
        if q.peers is not None and q.peers.nodes.is_leader(q.dist.rank):
            held = node_holdings(q.peers.job, version)
        known = KnownCopies(
            q.dist.world_size, newest, base.writer if base is not None else None,
            storage_exact, q.prefer, [{tuple(v): n for v, n in m} for m, _ in gathered],
            q.dist.all_gather(held) if q.peers is not None else [],
            [n for _, n in gathered])
        return cls(q, base, newest, headers, known)

    def load(self, v: Version) -> tuple[Version, str, dict[str, Any] | None]:
        """Restore `v` into this rank (after every peer transfer of it): (v, where from,
        the snapshot's meta when from memory)."""
        q, rank = self.q, self.q.dist.rank
        self.t0 = time.perf_counter()
        step = v[0]
        plan = [self.known.source(r, v) for r in range(q.dist.world_size)]
        fetched = _transfer(q.peers, rank, plan, v, self.known.remote) if "peer" in plan else None
        # A step older than storage's newest is exact: nothing may come from newer steps.
        filler = self.newest if self.newest is not None and step >= self.newest else None
        if plan[rank] == "memory":
            ancestors = {slot: h for slot, h in self.headers.items()
                         if _is_ancestor(self.headers[self.mine[v]], h)}
            try:
                reader, self.origins = _memory_reader(q.store, q.root, step, ancestors,
                                                     filler)
            except CheckpointError:
                self.known.failed.append(v)  # the next attempts look for this step elsewhere
                raise
            q.state.load(reader)
            return v, "memory", self.headers[self.mine[v]].meta
        if plan[rank] == "peer" and fetched is None:
            if self.known.source(rank, v) is None or not self.known.on_storage(v):
                raise CheckpointError(f"the peer copy of step {step} of rank {rank} did "
                                      "not verify, and storage does not hold that step")
            # The other ranks still restore their copies of this step; this one alone
            # takes storage's (as a rank with no copy in memory would).
            log.warning("rank %d: the peer copy of step %d did not verify (its holder says "
                        "why); restoring this rank from storage instead", rank, step)
        elif plan[rank] == "peer":
            header, tensors = fetched
            self.metas["peer"] = header.meta
            reader, self.origins = _peer_reader(tensors, q.root, step, filler)
            q.state.load(reader)
            return v, "peer", header.meta
        reader = CheckpointReader(q.root, Manifest.load(q.root, step))
        self.origins = {k: (e.step, "storage") for k, e in reader.manifest.entries.items()}
        q.state.load(reader)
        return v, "storage", None

    def finish(self, v: Version, source: str, meta: dict[str, Any] | None
               ) -> MemoryRestore | None:
        """Collective, once every rank restored `v`: expert replicas made equal, and
        what the ledger needs to count the tokens lost (None: every rank used storage)."""
        q, dist, step = self.q, self.q.dist, v[0]
        sources = dist.all_gather(source)
        if all(s == "storage" for s in sources):
            return None  # every peer copy failed: the caller restores from storage alone
        held_keys = set(q.state.flatten())
        # The step of the oldest expert copy (weights or optimizer state) each rank
        # restored: replicas of an expert that came back from different copies (a
        # complete snapshot, a partial replica, storage) are made equal to the freshest.
        experts = [c for key, (c, _) in self.origins.items()
                   if key in held_keys and parse_expert_key(key) is not None]
        # With which optimizer state of the experts each rank is left: replicated state
        # is made equal with the weights; sharded state (each expert's on one rank) is
        # its owner's alone.
        named = q.state.spec.by_name()
        held_state = {n: sorted(s) for n, s in q.state.optimizer.local_state().items()
                      if n in named}
        gathered = dist.all_gather((min(experts, default=step), held_state))
        taken = align_expert_replicas(q.state, dist, [f for f, _ in gathered],
                                      [h for _, h in gathered])
        meta = dist.broadcast(meta, src=next(r for r, s in enumerate(sources)
                                             if s != "storage"))
        manifest = Manifest.load(q.root, self.newest) if self.newest is not None else None
        stems = q.state.spec.stems()
        # Per (layer, expert): the oldest copy any rank is left with, of its weights and
        # of its optimizer state (what a rank took from the freshest replica counts as
        # that replica's: it is left out here). Before issue 47 the freshest copy across
        # ranks counted, of the weights only, and a rank that kept a stale optimizer
        # state from partial storage beside fresh weights was reported as 0 lost.
        local = [copy_counts(self.origins, self.metas, manifest, held_keys, kind, stems,
                          meta, taken).tolist() for kind in ("param", "optim")]
        # As lists: collectives carry data, not tensors (`moc.checkpoint.codec`).
        at_copy = oldest_copy(torch.tensor(dist.all_gather(local), dtype=torch.int64))
        cumulative = torch.tensor(meta["ledger"]["cumulative"], dtype=torch.int64)
        at_copy = torch.where(at_copy < 0, cumulative, at_copy)  # no rank held it: not lost
        older = any(copy_step < step for key, (copy_step, _) in self.origins.items()
                    if key in held_keys and (parsed := parse_expert_key(key)) is not None
                    and parsed[0] == q.tracked_kind)
        return MemoryRestore(step, self.mine[v] if source == "memory" else None, meta,
                             overall_source(sources), time.perf_counter() - self.t0,
                             at_copy, any(dist.all_gather(older)), sources,
                             self.known.passed_over(v))


def _version(q: MemoryQuery, base: Lineage | None, newest: int | None,
             h: SnapshotHeader) -> Version | None:
    """The version of a snapshot that may be restored (None: another run, model,
    layout, or a line that does not continue the newest persisted step)."""
    if not (q.run_id is not None and h.meta.get("run_id") == q.run_id
            and h.meta.get("layout") == q.layout and h.meta.get("model") == q.model_meta):
        return None
    try:
        line = Lineage.from_json(h.meta.get("line"), "the snapshot's lineage")
    except ValueError:
        return None  # an older moc's snapshot: its line cannot be proven
    if base is not None and not (line.descends_from(h.step, base, newest or 0) or (
            newest is not None and h.step < newest and base.descends_from(newest, line,
                                                                            h.step))):
        return None  # neither continues storage's newest step nor is an ancestor of it
    return (h.step, line.writer or "")


def _storage_lineage(root: Path, newest: int | None, dist: Dist, run_id: str | None
                     ) -> tuple[Lineage | None, bool, int | None]:
    """The lineage of the newest persisted step, as rank 0 reads it (the same on every
    rank), whether that step holds every expert at its own step, and the expert tokens
    a restore of it from storage alone loses (its ledger's; None: no step). The lineage
    is None when there is none, or its manifest cannot be read or is another run's
    (storage's restore then decides, and skips it)."""
    line, exact, lost = None, False, None
    if dist.rank == 0 and newest is not None:
        try:
            manifest = Manifest.load(root, newest)
            check_run(manifest, run_id, f"step {newest}")
            line = manifest.lineage.to_json()
            exact = all(e.step == newest for e in manifest.entries.values())
            tokens = manifest.tokens
            lost = int((torch.tensor(tokens["cumulative"], dtype=torch.int64)
                        - torch.tensor(tokens["at_save"], dtype=torch.int64)).sum())
        except (CheckpointError, OSError, ValueError) as e:
            log.warning("the manifest of step %d cannot be read (%s): not restoring from "
                        "memory", newest, e)
    line, exact, lost = dist.broadcast((line, exact, lost))
    lineage = None if line is None else Lineage.from_json(line, "the newest step's lineage")
    return lineage, exact, lost


def _version_of(header: SnapshotHeader) -> Version | None:
    """(step, writer) of a snapshot, None when its lineage is unreadable."""
    try:
        line = Lineage.from_json(header.meta["line"], "lineage")
    except (KeyError, ValueError):
        return None
    return (header.step, line.writer or "")


def _is_ancestor(restored: SnapshotHeader, older: SnapshotHeader) -> bool:
    """Whether the snapshot `older` holds the state of the line `restored` continues
    (its own or an ancestor's): only those may fill in what a partial snapshot lacks."""
    try:
        line = Lineage.from_json(restored.meta["line"], "lineage")
        return line.descends_from(restored.step, Lineage.from_json(
            older.meta["line"], "lineage"), older.step)
    except (KeyError, ValueError):
        return False


def _transfer(peers: Peers | None, me: int, plan: list[str | None], version: Version,
              remote: Callable[[int, Version], tuple[int, str, int] | None]
              ) -> tuple[SnapshotHeader, dict[str, torch.Tensor]] | None:
    """Every peer copy of `version` the plan needs, pair by pair in rank order: a holder
    sends, the rank that needs it receives (verified; None when it did not verify).
    This rank's copy, if it needed one."""
    step = version[0]
    assert peers is not None
    fetched = None
    for rank, src in enumerate(plan):
        if src != "peer":
            continue
        found = remote(rank, version)
        assert found is not None
        holder, kind, slot, _ = found
        if me == holder:
            store = stores(peers.job, kind, rank)
            try:
                header = store.headers().get(slot)
            except CheckpointError:  # not a directory it trusts now: a marker, no hang
                header = None
            same = header is not None and _version_of(header) == version
            sent = send_replica(peers.group, rank, store, slot, header if same else None)
            store.release()
            if sent.error is not None:
                log.warning("rank %d's copy of step %d for rank %d: %s", me, step, rank,
                            sent.error)
        elif me == rank:
            fetched = receive_replica(peers.group, holder)
    return fetched


def _from_storage(root: Path, newest_storage: int | None
                  ) -> tuple[dict[str, Any], Origins]:
    """Every key of the newest persisted manifest, read only if no newer copy replaces
    it: what a memory or peer copy lacks comes from there."""
    tensors: dict[str, Any] = {}
    copies: Origins = {}
    if newest_storage is not None:
        reader = CheckpointReader(root, Manifest.load(root, newest_storage))
        for key, entry in reader.manifest.entries.items():
            tensors[key] = LazyKey(reader, key)
            copies[key] = (entry.step, "storage")
    return tensors, copies


def _peer_reader(tensors: dict[str, torch.Tensor], root: Path, step: int,
                 newest_storage: int | None) -> tuple[DictReader, Origins]:
    """A peer copy of `step`, and for the keys it does not carry (a partial replica)
    the newest persisted manifest."""
    out, copies = _from_storage(root, newest_storage)
    for key, t in tensors.items():
        out[key], copies[key] = t, (step, "peer")
    return DictReader(out, one_rank=True), copies


def _memory_reader(store: SnapshotStore, root: Path, step: int,
                   headers: dict[int, SnapshotHeader], newest_storage: int | None
                   ) -> tuple[DictReader, Origins]:
    """Every key at its newest copy no newer than `step`: the snapshot of `step`, older
    snapshots, the newest persisted manifest (a snapshot's copy wins a tie).

    Snapshots are read newest first, and of an older one only the keys it still
    supplies (the experts a partial snapshot of `step` lacks), each read checked on a few
    native threads: a restore is downtime, and reading and hashing every older snapshot
    whole, as before issue 45, was about 28 GB on one thread at gpu-800m for keys the
    snapshot of `step` already held."""
    tensors, copies = _from_storage(root, newest_storage)
    from_slots: set[str] = set()
    threads = default_threads()
    for slot, header in sorted(headers.items(), key=lambda kv: -kv[1].step):
        if header.step > step:
            continue
        keys = [k for k in header.entries if k not in from_slots
                and (k not in copies or header.step >= copies[k][0])]
        if not keys:
            continue
        try:
            snap = store.read(slot, header, keys=keys, threads=threads)
        except CheckpointError:
            if header.step == step:
                raise
            continue  # an older snapshot that does not verify is simply not used
        for key, t in snap.items():
            tensors[key], copies[key] = t, (header.step, f"slot-{slot}")
        from_slots.update(snap)
    return DictReader(tensors, one_rank=True), copies
