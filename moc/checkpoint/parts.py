"""The parts every moc engine is built from, built once: the expert spec, the groups and
their collectives, the rank's state, the policy, the chain, the token ledger, retention.

An engine (`sync.Checkpointer`, `twolevel.TwoLevelCheckpointer`) composes them with the
parts of its own; nothing here knows how or when an engine saves.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from moc.checkpoint.dist import Dist
from moc.checkpoint.plan.chain import ChainState
from moc.checkpoint.policy.selection import PECPolicy
from moc.checkpoint.policy.tokens import TokenLedger
from moc.checkpoint.spec import ExpertSpec
from moc.checkpoint.state import RankState, as_optimizer_state, default_model_meta
from moc.checkpoint.store.retention import BackgroundRetention
from moc.topology import ParallelGroups


@dataclass
class EngineParts:
    root: Path
    spec: ExpertSpec
    groups: ParallelGroups
    dist: Dist
    state: RankState
    policy: PECPolicy
    mode: str
    """What the manifests call the strategy (pec, full, moc, blocking, ...)."""
    interval: int
    model_meta: dict[str, Any]
    """What a checkpoint must match to be restored (default: `default_model_meta`)."""
    chain: ChainState
    ledger: TokenLedger
    retention: BackgroundRetention | None
    """Rank 0's background deletion of old steps (`keep_last`); None elsewhere."""

    @classmethod
    def build(cls, model: nn.Module, optimizer: object, directory: str | Path, *,
              experts: ExpertSpec | None, groups: ParallelGroups | None,
              policy: PECPolicy | None, interval: int, keep_last: int | None,
              model_meta: dict[str, Any] | None, mode: str | None) -> EngineParts:
        """Validate the arguments every engine takes and build its parts."""
        if interval < 1:
            raise ValueError(f"Checkpointer interval must be >= 1, got {interval}")
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"Checkpointer keep_last must be >= 1 or None, got {keep_last}")
        spec = experts if experts is not None else ExpertSpec.infer(model)
        groups = groups if groups is not None else ParallelGroups.single(spec.n_experts)
        policy = policy if policy is not None else PECPolicy.full()
        state = RankState(model, as_optimizer_state(optimizer, model), spec, groups.rank)
        root = Path(directory)
        return cls(
            root=root, spec=spec, groups=groups, dist=Dist(groups), state=state,
            policy=policy, mode=mode or ("full" if policy.selection == "full" else "pec"),
            interval=interval, model_meta=model_meta or default_model_meta(model, spec),
            chain=ChainState(spec, policy, groups.layout.ep),
            ledger=TokenLedger(spec.n_moe_layers, spec.n_experts,
                               policy.initial_k(spec.n_experts), policy.dynamic_k,
                               policy.plt_threshold),
            retention=(BackgroundRetention(root, keep_last)
                       if keep_last is not None and groups.rank == 0 else None))

    @property
    def layout(self) -> dict[str, int]:
        """The parallel layout as manifests and snapshots record it."""
        return {"world_size": self.groups.world_size, "ep": self.groups.layout.ep}
