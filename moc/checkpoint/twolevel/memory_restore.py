"""Recovery from the snapshots in node-local memory, each rank from its own when it can.

    restored = restore_from_memory(store, root, state, dist, ...)   # None: use storage

The ranks agree on the newest step every rank can restore: from its own snapshot of it
when that is complete and its checksums hold, or from storage when the step is persisted
there. If every rank restored from memory the source is "memory", if some did "mixed";
when no step qualifies the caller restores from storage alone.

A partial snapshot (K_snapshot < N) holds some experts only; each of the others comes
from its newest copy in an older snapshot slot or in storage, and the tokens routed to it
since that copy count as lost (`at_copy`, accounted by the ledger). When the replicas of
an expert came back from different sources ("mixed"), the ones restored from storage take
the weights of one restored from memory, so replicas never diverge.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moc.checkpoint.dist import Dist
from moc.checkpoint.errors import CheckpointError
from moc.checkpoint.recovery import CheckpointReader, DictReader, LazyKey, restore_loop
from moc.checkpoint.spec import parse_expert_key
from moc.checkpoint.state import RankState
from moc.checkpoint.store.manifest import Manifest
from moc.checkpoint.twolevel.slots import SnapshotHeader, SnapshotStore

Copies = dict[str, tuple[int, str]]
"""Per key: the step of the copy restored and where it came from ("slot-<i>", "storage")."""


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


def restore_from_memory(store: SnapshotStore, root: Path, state: RankState, dist: Dist,
                        storage: list[int], layout: dict[str, int],
                        model_meta: dict[str, Any], tracked_kind: str,
                        run_id: str | None) -> MemoryRestore | None:
    """Restore the newest step every rank can restore with some rank's memory; None when
    there is none (or every such step failed on some rank). Collective.

    `storage`: the complete steps on storage (the same list on every rank). A snapshot
    older than the newest persisted step is never used: storage is newer. Only
    snapshots of this run (`run_id`, the checkpoint directory's), of the same model and
    layout, are candidates: memory left by another run is never restored.
    """
    newest_storage = storage[-1] if storage else None
    headers = {slot: h for slot, h in store.headers().items()
               if run_id is not None and h.meta.get("run_id") == run_id
               and h.meta.get("layout") == layout and h.meta.get("model") == model_meta}
    mine = {h.step: slot for slot, h in headers.items()}
    everyone = [set(m) for m in dist.all_gather(sorted(mine))]
    candidates = [step for step in sorted(set().union(*everyone), reverse=True)
                  if (newest_storage is None or step >= newest_storage)
                  # a rank without this snapshot must have it on storage
                  and all(step in m or step in storage for m in everyone)]
    t0 = time.perf_counter()
    copies: Copies = {}

    def attempt(step: int) -> tuple[int, str]:
        nonlocal t0, copies
        t0 = time.perf_counter()
        if step in mine:
            reader, copies = _memory_reader(store, root, step, headers, newest_storage)
            state.load(reader)
            return step, "memory"
        reader = CheckpointReader(root, Manifest.load(root, step))
        copies = {k: (e.step, "storage") for k, e in reader.manifest.entries.items()}
        state.load(reader)
        return step, "storage"

    # Any failure here (a corrupt slot, a missing file) is agreed on, never left to one rank.
    restored, _ = restore_loop(candidates, attempt, dist, skip=(Exception,),
                               label=lambda step: f"the snapshot of step {step}")
    if restored is None:
        return None
    step, source = restored
    sources = dist.all_gather(source)
    if "storage" in sources:
        align_expert_replicas(state, dist, sources)
    meta = dist.broadcast(headers[mine[step]].meta if step in mine else None,
                          src=sources.index("memory"))
    manifest = Manifest.load(root, newest_storage) if newest_storage is not None else None
    held = set(state.flatten())
    at_copy = _at_copy(copies, headers, manifest, held, tracked_kind,
                       state.spec.stems(), meta)
    # As lists: collectives carry data, not tensors (`moc.checkpoint.codec`).
    at_copy = torch.tensor(dist.all_gather(at_copy.tolist()), dtype=torch.int64)
    at_copy = at_copy.max(dim=0).values
    cumulative = torch.tensor(meta["ledger"]["cumulative"], dtype=torch.int64)
    at_copy = torch.where(at_copy < 0, cumulative, at_copy)  # no rank held it: not lost
    older = any(copy_step < step for key, (copy_step, _) in copies.items()
                if key in held and (parsed := parse_expert_key(key)) is not None
                and parsed[0] == tracked_kind)
    return MemoryRestore(step, mine.get(step), meta,
                         "memory" if "storage" not in sources else "mixed",
                         time.perf_counter() - t0, at_copy, any(dist.all_gather(older)))


def _memory_reader(store: SnapshotStore, root: Path, step: int,
                   headers: dict[int, SnapshotHeader], newest_storage: int | None
                   ) -> tuple[DictReader, Copies]:
    """Every key at its newest copy no newer than `step`: the snapshot of `step`, older
    snapshots, the newest persisted manifest."""
    tensors: dict[str, Any] = {}
    copies: Copies = {}
    if newest_storage is not None:
        reader = CheckpointReader(root, Manifest.load(root, newest_storage))
        for key, entry in reader.manifest.entries.items():
            tensors[key] = LazyKey(reader, key)
            copies[key] = (entry.step, "storage")
    for slot, header in sorted(headers.items(), key=lambda kv: kv[1].step):
        if header.step > step:
            continue
        try:
            snap = store.read(slot, header)
        except CheckpointError:
            if header.step == step:
                raise
            continue  # an older snapshot that does not verify is simply not used
        for key, t in snap.items():
            if key not in copies or header.step >= copies[key][0]:
                tensors[key], copies[key] = t, (header.step, f"slot-{slot}")
    return DictReader(tensors), copies


def _at_copy(copies: Copies, headers: dict[int, SnapshotHeader], manifest: Manifest | None,
             held: set[str], kind: str, stems: dict[str, int], meta: dict[str, Any]
             ) -> torch.Tensor:
    """Per (layer, expert) held here: the cumulative token count at the copy restored
    (the oldest of its tensors of the tracked kind); -1 for experts not held here.
    Every rank knows only its own experts; together they know all of them."""
    n_layers = len(meta["ledger"]["cumulative"])
    n_experts = len(meta["ledger"]["cumulative"][0]) if n_layers else 0
    at_copy = torch.full((n_layers, n_experts), -1, dtype=torch.int64)
    for key, (_, origin) in copies.items():
        parsed = parse_expert_key(key)
        if parsed is None or parsed[0] != kind or key not in held:
            continue
        m, e = stems[parsed[1]], parsed[2]
        if origin == "storage":
            value = int(manifest.tokens["at_save"][m][e]) if manifest is not None else 0
        else:
            slot_meta = headers[int(origin.split("-")[1])].meta
            value = int(slot_meta["ledger"]["cumulative"][m][e])
        at_copy[m, e] = value if at_copy[m, e] < 0 else min(int(at_copy[m, e]), value)
    return at_copy


@torch.no_grad()
def align_expert_replicas(state: RankState, dist: Dist, sources: list[str]) -> None:
    """Within each EDP group, replicas restored from storage take the expert weights of
    the first replica restored from memory (collective over the EDP group)."""
    layout = dist.groups.layout
    if not dist.enabled or layout.edp == 1:
        return
    members = layout.edp_groups()[layout.ep_rank(dist.rank)]
    from_memory = [r for r in members if sources[r] == "memory"]
    if not from_memory or len(from_memory) == len(members):
        return
    experts = state.spec.by_name()
    for name, p in state.model.named_parameters():
        if name in experts:
            p.copy_(dist.broadcast_edp_(p.detach().cpu().clone(), src=from_memory[0]))
