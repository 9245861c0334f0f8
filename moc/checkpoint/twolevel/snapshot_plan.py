"""What one two-level checkpoint copies and persists: a pure function of the engine's
state at the plan, so that it can be read, and tested, without a process or a thread.

    plan = plan_snapshot(PlanInputs(...))
    plan.tensors     what the snapshot copies into plan.slot (every expert unless K_snapshot < N)
    plan.write       this rank's share of the persist (empty: nothing is persisted)
    plan.template()  the manifest's fields, for node 0's persist process

Nothing here changes the chain, the ledger or the slots: the planner applies the plan
(`SnapshotPlanner._plan`) to the engine's state (`EngineState`).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moc.checkpoint.plan.chain import ChainState
from moc.checkpoint.plan.units import rank_share
from moc.checkpoint.policy.tokens import TokenLedger
from moc.checkpoint.state import RankState
from moc.checkpoint.twolevel.memory.nodes import NodeLayout
from moc.checkpoint.twolevel.persist.lag import LagReport
from moc.checkpoint.twolevel.persist.protocol import Done
from moc.checkpoint.twolevel.snapshot.sizing import snapshot_experts, snapshot_index
from moc.checkpoint.twolevel.snapshot.state_cache import Flat
from moc.checkpoint.twolevel.snapshot.tensors import SnapshotTensors
from moc.topology import ParallelGroups


@dataclass(frozen=True)
class PlanConfig:
    """What the plans of one engine have in common."""

    root: Path
    """The checkpoint directory (manifests committed by the persist process)."""
    mode: str
    model_meta: dict[str, Any]
    persist_policy: str
    """"skip" (persist only when no persist runs) or "wait" (the plan waits for it)."""
    run_id: str | None = None
    """The run the checkpoint directory belongs to; every snapshot carries it, and only
    snapshots of this run are ever restored (`store.identity`)."""
    nodes: NodeLayout | None = None
    """Which ranks share a node (None: one node); each node's leader speaks for its
    persist process."""
    nonce: str = ""
    """This job's mark on the records of a commit across nodes (`twolevel.persist.commit`)."""


@dataclass(frozen=True)
class PlanOutcome:
    """What a plan decided that the checkpoint's result reports."""

    k: int
    experts_saved: list[list[int]]
    persist_skipped: bool
    error: str | None
    k_snapshot: int
    k_snapshot_chosen: dict[str, Any] | None
    persist: Future[Done] | None = None
    """The outcome of its persist (None: not persisted)."""
    lag: LagReport | None = None
    """How far storage was behind at the plan (`twolevel.persist.lag`)."""


@dataclass(frozen=True)
class PlanInputs:
    """The engine's state as one plan sees it."""

    step: int
    final: bool
    persist_now: bool
    """No persist runs and the persist process is alive: this checkpoint is persisted."""
    persist_error: str | None
    """Why nothing can be persisted (the persist process is gone), reported."""
    state: Flat
    """This rank's flattened state (`RankState.flatten`), its layout cached between
    snapshots (`state_cache.FlatState`), with what is derived from it."""
    rank_state: RankState
    groups: ParallelGroups
    chain: ChainState
    ledger: TokenLedger
    config: PlanConfig
    slot: int
    k_snapshot: int
    snap_index: int
    chosen: dict[str, Any] | None
    extra: dict[str, Any]
    run: dict[str, Any]


@dataclass(frozen=True)
class SnapshotPlan:
    step: int
    slot: int
    tensors: SnapshotTensors
    """What the snapshot copies (all of `state` unless K_snapshot < N)."""
    meta: dict[str, Any]
    """What the snapshot's header records: enough to restore and to continue from it."""
    write: list
    """This rank's write units of the persist ([] when nothing is persisted)."""
    outcome: PlanOutcome
    prev_step: int | None
    """The committed step the persist's manifest chains from."""
    template: Callable[[], dict[str, Any]]
    """The persisted manifest's fields but entries and files."""


def plan_snapshot(p: PlanInputs) -> SnapshotPlan:
    """The snapshot and persist of `p.step`: the experts the policy selects (all when
    `final`), this rank's share of their writes, and which experts the snapshot holds.

    The share and the tensors the snapshot copies are functions of the state's layout
    and of the selection: they are made once per layout and selection and kept with the
    layout (`StateLayout.remember`), not derived key by key at every snapshot."""
    g, chain, ledger, cfg, flat = p.groups, p.chain, p.ledger, p.config, p.state
    selected = chain.all_experts() if p.final else chain.select(p.step, ledger)
    written = chain.written(selected, p.step)
    share, write = None, []
    if p.persist_now:
        share = share_key(chain, p.step, selected, flat)
        wanted, keys = chain.wanted(selected, p.step), flat.keys
        write = flat.layout.remember(
            None if share is None else ("write", share),
            lambda: rank_share(p.rank_state, g.layout, keys, wanted))
    spec = p.rank_state.spec
    experts = snapshot_experts(spec.n_experts, spec.n_moe_layers, p.k_snapshot, p.snap_index,
                               g.layout.ep, written if p.persist_now else None,
                               chain.manifest is None or p.final)
    pick = ("pick", tuple(map(frozenset, experts)), share)  # share: None unless persisted
    picked = flat.layout.remember(
        None if p.persist_now and share is None else pick,
        lambda: flat.layout.pick(snapshot_index(flat.layout.keys, experts, chain.stems,
                                                set(write))))
    layout = chain.layout(g.world_size, g.layout.ep)
    meta = {"extra": p.extra, "ledger": ledger.to_json(), **ledger.policy_json(),
            "snap_index": p.snap_index, "k_snapshot": p.k_snapshot,
            "model": cfg.model_meta, "layout": layout, "run_id": cfg.run_id,
            "line": p.run["line"]}
    outcome = PlanOutcome(ledger.k, written, not p.persist_now, p.persist_error,
                          p.k_snapshot, p.chosen)
    step, extra, run = p.step, p.extra, p.run
    return SnapshotPlan(
        step, p.slot, flat.snapshot(picked), meta, write,
        outcome, chain.manifest.step if chain.manifest is not None else None,
        lambda: chain.template(step, mode=cfg.mode, layout=layout, model_meta=cfg.model_meta,
                               extra=extra, written=written, ledger=ledger, run=run))


def share_key(chain: ChainState, step: int, selected: list[list[int]], flat: Flat
              ) -> tuple | None:
    """What `chain.wanted(selected, step)` decides for `flat`'s keys depends on, as a key
    to keep what is derived from it by (None: not to be kept).

    Design note: `ChainState.wanted` keeps a key when it is not an expert's, when the
    chain has no copy of it (absent from the manifest), when its copy is of `step` or
    later (a step saved again), or when it is of the partial kind and its expert is
    selected. For a step after the manifest's, the third never holds (a manifest's
    entries are of its step or older), so the decision follows from the selection, the
    policy's kind and which keys the manifest lacks: one C-level set difference, not a
    Python call per key. A step saved again (a rollback) is derived anew."""
    m = chain.manifest
    if m is not None and step <= m.step:
        return None
    tail = tuple(flat.tail)
    missing = (None if m is None else
               flat.layout.keyset.difference(m.entries) | frozenset(tail).difference(m.entries))
    return (chain.policy.apply_to, tuple(map(tuple, selected)), missing, tail)
