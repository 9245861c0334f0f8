"""After a restore from memory: the replicas of each expert made equal, and the copy each
expert really came back from, for the ledger to count the tokens lost.

    taken = align_expert_replicas(state, dist, freshness, holds)   # collective per EDP group
    counts = copy_counts(origins, metas, manifest, held, kind, stems, meta, taken)
    at_copy = oldest_copy(all ranks' counts)

Replicas of an expert (its EDP group) that came back from different copies take the
freshest one's weights, and its optimizer state where that state is replicated; state
sharded over the replicas (ZeRO) stays its owner's. What a rank took from another counts
as that one's copy; the oldest copy anyone is left with, of the weights or of the
optimizer state, is the expert's (issue 47: the freshest weights counted alone, and a
rank that kept stale moments from partial storage was reported as 0 tokens lost).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch

from moc.checkpoint.dist import Dist
from moc.checkpoint.spec import parse_expert_key
from moc.checkpoint.state import RankState
from moc.checkpoint.store.manifest import Manifest

Origins = dict[str, tuple[int, str]]
"""Per key: the step of the copy restored and where it came from ("slot-<i>", "peer",
"storage")."""


def oldest_copy(counts: torch.Tensor) -> torch.Tensor:
    """Per (layer, expert), the smallest of `counts`' non-negative entries over its
    leading dimensions (ranks, kinds); -1 where none is."""
    flat = counts.reshape(-1, *counts.shape[-2:])
    big = torch.iinfo(torch.int64).max
    oldest = torch.where(flat < 0, big, flat).min(dim=0).values
    return torch.where(oldest == big, -1, oldest)


def copy_counts(origins: Origins, metas: dict[str, dict[str, Any]], manifest: Manifest | None,
             held: set[str], kind: str, stems: dict[str, int], meta: dict[str, Any],
             taken: Collection[tuple[str, str, int]] = ()) -> torch.Tensor:
    """Per (layer, expert) held here: the cumulative token count at the copy restored
    (the oldest of its tensors of `kind`); -1 for experts not held here, or whose
    tensors of that kind this rank took from a fresher replica (`taken`, as
    `align_expert_replicas` says). Every rank knows only its own experts; together they
    know all of them."""
    n_layers = len(meta["ledger"]["cumulative"])
    n_experts = len(meta["ledger"]["cumulative"][0]) if n_layers else 0
    at_copy = torch.full((n_layers, n_experts), -1, dtype=torch.int64)
    for key, (_, origin) in origins.items():
        parsed = parse_expert_key(key)
        if parsed is None or parsed[0] != kind or key not in held or parsed in taken:
            continue
        m, e = stems[parsed[1]], parsed[2]
        if origin == "storage":
            value = int(manifest.tokens["at_save"][m][e]) if manifest is not None else 0
        else:
            value = int(metas[origin]["ledger"]["cumulative"][m][e])
        at_copy[m, e] = value if at_copy[m, e] < 0 else min(int(at_copy[m, e]), value)
    return at_copy


@torch.no_grad()
def align_expert_replicas(state: RankState, dist: Dist, freshness: list[int],
                          holds: list[dict[str, list[str]]]) -> set[tuple[str, str, int]]:
    """Within each EDP group, replicas whose expert weights came from an older copy
    (`freshness`: per rank, the step of its oldest expert weight restored) take those of
    the freshest replica, with their optimizer state (collective over each EDP group
    that needs it): replicas of an expert must never diverge, and a replica is exact
    wherever one of them is. `holds`: per rank, the names of its expert parameters with
    optimizer state, and that state's keys: a parameter's state moves only where every
    replica holds the same (replicated); sharded state (ZeRO) is its one owner's.

    Returns what this rank took from another: (kind, stem, expert) of `parse_expert_key`."""
    layout = dist.groups.layout
    taken: set[tuple[str, str, int]] = set()
    if not dist.enabled or layout.edp == 1:
        return taken
    members = layout.edp_groups()[layout.ep_rank(dist.rank)]
    best = max(members, key=lambda r: (freshness[r], -r))
    if all(freshness[r] == freshness[best] for r in members):
        return taken
    experts = state.spec.by_name()
    # Their optimizer state too: before issue 47 only the weights moved, and a replica
    # restored from partial storage stepped on with its stale moments while the
    # recovery reported 0 tokens lost (3 nodes, ep 1, two machines lost at once).
    states = state.optimizer.local_state()
    for name, p in state.named:
        if name not in experts:
            continue
        p.copy_(dist.broadcast_edp_(p.detach().cpu().clone(), src=best))
        ids = experts[name].global_ids
        stem = experts[name].stem
        if dist.rank != best:
            taken.update(("param", stem, g) for g in ids)
        keys = holds[best].get(name)
        if keys is None or any(holds[r].get(name) != keys for r in members):
            continue  # not replicated: each member decides the same from `holds`
        for key in keys:
            t = states[name][key]
            states[name][key] = dist.broadcast_edp_(t.detach().cpu().clone(),
                                                    src=best).to(t.device)
        if dist.rank != best:
            taken.update(("optim", stem, g) for g in ids)
    state.optimizer.load_local_state(states)
    return taken
