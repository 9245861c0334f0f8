"""Which copy of which step each rank restores from: what every rank learned of the
copies in memory (its own snapshots, and what each node holds), and the choice.

    known = KnownCopies(world, newest, writer, storage_exact, prefer, everyone, holdings,
                        expected)
    for v in known.attempts(all_gather): ...   # the versions to try, in order
    known.source(rank, v)                      # "memory", "peer", "storage" or None

A rank takes a version from its own memory, else a copy in another node's memory (a peer
replica, or its own snapshot left on a node it no longer runs on), else storage when the
same segment committed that step. A copy is exact when it holds every expert of its rank
at its step. The exact copy wins: an older step every rank has an exact copy of comes
before a newer one some rank has only a partial copy of (`prefer="exact"`), and a copy
that failed to read is replaced by the same step's copy elsewhere before anything older
is tried (`attempts`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from moc.checkpoint.errors import CheckpointError
from moc.checkpoint.spec import parse_expert_key
from moc.checkpoint.twolevel.memory.jobdir import job_dir
from moc.checkpoint.twolevel.memory.nodes import NodeLayout
from moc.checkpoint.twolevel.memory.slots import SnapshotHeader, SnapshotStore
from moc.checkpoint.twolevel.replicas.replica import ReplicaStore

Version = tuple[int, str]
"""One checkpoint of one line of training: (step, the id of the segment that wrote it,
`Lineage.writer`). Two jobs that resumed one directory from the same step label their
snapshots with the same steps; only the writer tells them apart."""
Holdings = dict[int, dict[Version, tuple[str, int, int]]]
"""What one node's memory holds: source rank -> version -> (kind: "rank" for the rank's
own snapshot directory, "replica" for a peer replica of it; slot; how many expert weight
keys it holds, `expert_keys`: a copy with all of its rank's is exact)."""
PREFER = ("exact", "newest")
"""A restore's choice between a newer step some rank has only a lossy copy of and an
older one every rank has an exact copy of (`KnownCopies.prefer`)."""


@dataclass(frozen=True)
class Peers:
    """What a restore needs to reach the memory of other nodes."""

    nodes: NodeLayout
    group: Any
    """The replica process group (gloo, every rank)."""
    job: str


def stores(job: str, kind: str, src: int) -> SnapshotStore:
    return SnapshotStore(job, src) if kind == "rank" else ReplicaStore(job, src)


def node_holdings(job: str, version: Callable[[SnapshotHeader], Version | None]
                  ) -> Holdings:
    """Every snapshot and replica in this node's memory that has a `version` (None: not a
    candidate: another run, model, layout or line). A node leader's view, for the other
    ranks' recovery."""
    out: Holdings = {}
    jdir = job_dir(job)
    for kind, prefix in (("rank", "rank-"), ("replica", "replica-")):
        for d in sorted(jdir.glob(f"{prefix}*")) if jdir.is_dir() else []:
            try:
                src = int(d.name[len(prefix):])
            except ValueError:
                continue
            store = stores(job, kind, src)
            try:
                headers = store.headers()
            except CheckpointError:
                continue  # not a directory this user trusts: never a source
            for slot, header in headers.items():
                v = version(header)
                if v is not None:
                    out.setdefault(src, {}).setdefault(
                        v, (kind, slot, expert_keys(header.entries)))
            store.release()
    return out


def expert_keys(keys: Iterable[str]) -> int:
    """How many of `keys` are expert weights: a copy that holds as many as its rank has
    holds every expert of that rank at its step (exact); fewer, a partial snapshot or
    replica, whose other experts come from older copies."""
    return sum(1 for k in keys if (parsed := parse_expert_key(k)) is not None
               and parsed[0] == "param")


def invalidate_node(job: str, step: int) -> None:
    """Forget every snapshot and replica on this node newer than `step` (a leader, after
    the job restored `step`): they belong to a run that will not continue."""
    newer = node_holdings(job, lambda h: (h.step, "") if h.step > step else None)
    for src, steps in newer.items():
        for kind in {kind for kind, *_ in steps.values()}:
            stores(job, kind, src).invalidate_newer_than(step)


@dataclass
class KnownCopies:
    """What every rank learned of the copies of each version (the same on every rank),
    and the choice of the version to restore. Owner: the restore's thread."""

    world: int
    newest: int | None
    """The newest complete step on storage."""
    writer: str | None
    """The segment that wrote it (None: no step, or it cannot be read)."""
    storage_exact: bool
    """Whether that step holds every expert at that step."""
    prefer: str
    """"exact" or "newest" (`PREFER`)."""
    everyone: list[dict[Version, int]]
    """Per rank: the versions in its own memory, with their expert weight keys."""
    holdings: list[Holdings]
    """Per rank (a node leader's, else empty): what its node's memory holds."""
    expected: list[int]
    """Per rank: how many expert weight keys it holds (`expert_keys`)."""
    bad: set[tuple[int, Version]] = field(default_factory=set)
    """(rank, version): own copies that failed to read (a checksum, a missing file), as
    every rank learned after the attempt (`attempts`)."""
    failed: list[Version] = field(default_factory=list)
    """This rank's own copies that failed to read since the last attempt."""
    storage_lost: int | None = None
    """The expert tokens a restore of the newest persisted step from storage alone
    loses (its manifest's ledger); the most the newer choice loses, since a copy in
    memory is never older than storage's (`passed_over`). None: not known."""

    def remote(self, rank: int, v: Version) -> tuple[int, str, int, int] | None:
        """(holder's leader, kind, slot, expert weight keys) of a copy of `rank`'s `v` in
        another node."""
        for holder, held in enumerate(self.holdings):
            found = held.get(rank, {}).get(v)
            if found is not None and holder != rank:
                return (holder, *found)
        return None

    def source(self, rank: int, v: Version) -> str | None:
        """Where `rank` restores `v` from: its memory, a peer's, storage, or nowhere."""
        if v in self.everyone[rank] and (rank, v) not in self.bad:
            return "memory"
        if self.remote(rank, v) is not None:
            return "peer"
        # Storage holds the same checkpoint only if the same segment committed it.
        return "storage" if self.on_storage(v) else None

    def on_storage(self, v: Version) -> bool:
        """Whether storage holds `v`: the same step, committed by the same segment."""
        return self.writer is not None and v == (self.newest, self.writer)

    def exact(self, rank: int, v: Version) -> bool:
        """Whether `rank`'s copy of `v`, where `source` takes it, holds all of its
        experts at that step."""
        source = self.source(rank, v)
        if source == "memory":
            return self.everyone[rank][v] >= self.expected[rank]
        if source == "peer":
            found = self.remote(rank, v)
            return found is not None and found[3] >= self.expected[rank]
        return source == "storage" and self.storage_exact

    def usable(self) -> list[Version]:
        """Versions every rank can restore from somewhere, newest first."""
        in_memory = set().union(*self.everyone, {v for h in self.holdings
                                                 for c in h.values() for v in c})
        return [v for v in sorted(in_memory, reverse=True)
                if all(self.source(r, v) is not None for r in range(self.world))]

    def lossy(self, v: Version) -> list[int]:
        """The ranks whose copy of `v` is not exact."""
        return [r for r in range(self.world) if not self.exact(r, v)]

    def candidates(self) -> list[Version]:
        """The versions to try, in order: newest first, except that a step older than
        the newest persisted one, exact on every rank, comes before a newer one that is
        not (`prefer`, "exact"); older steps are candidates only then."""
        usable = self.usable()
        newest = self.newest if self.newest is not None else -1
        current = [v for v in usable if v[0] >= newest]
        if self.prefer != "exact" or (current and not self.lossy(current[0])):
            return current
        if not current and self.storage_exact:
            return []  # storage's newest is exact: restored from there
        older = [v for v in usable if v[0] < newest and not self.lossy(v)]
        return [*older, *current]

    def attempts(self, all_gather: Callable[[Any], list[Any]]) -> Iterator[Version]:
        """`candidates`, tried in turn by `restore_loop`; after an attempt failed because
        some rank's own copy did not read, the candidates again without that copy: the
        same step from elsewhere (a peer replica) before anything older (issue 47: a
        flipped bit in one rank's newest snapshot sent the whole job to partial storage
        while that step's intact replica sat on a peer). Collective, in step on every
        rank: a failed attempt resumes this generator on all of them (a success ends
        it)."""
        tried: set[tuple[Version, frozenset[tuple[int, Version]]]] = set()
        while True:
            bad = frozenset(self.bad)
            v = next((c for c in self.candidates() if (c, bad) not in tried), None)
            if v is None:
                return
            tried.add((v, bad))
            yield v
            for rank, failed in enumerate(all_gather(self.failed)):
                self.bad.update((rank, tuple(f)) for f in failed)
            self.failed = []

    def passed_over(self, v: Version) -> str | None:
        """What restoring `v` rather than the newest step cost and saved (None: `v` is
        the newest step a restore could take)."""
        usable = self.usable()
        newest = max(usable[0][0] if usable else -1,
                     self.newest if self.newest is not None else -1)
        if newest <= v[0]:
            return None
        at_newest = [c for c in usable if c[0] == newest]
        lossy = self.lossy(at_newest[0]) if at_newest else list(range(self.world))
        if not lossy:
            return None  # the newer exact one failed to load: the restore says why
        cost = ("the tokens routed to them since would be lost"
                if self.storage_lost is None or newest != self.newest
                else f"up to {self.storage_lost} expert tokens would be lost")
        return (f"step {newest} is newer, but rank(s) {lossy} have only a partial copy of "
                f"it (experts older than it: {cost}); step {v[0]} is exact on every "
                f"rank, {newest - v[0]} step(s) to train again")
