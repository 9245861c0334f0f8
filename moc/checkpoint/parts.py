"""The parts every moc engine is built from, built once: the expert spec, the groups and
their collectives, the rank's state, the policy, the chain, the token ledger, retention,
the directory's lock and run identity, and what a failed checkpoint does.

An engine (`sync.Checkpointer`, `twolevel.TwoLevelCheckpointer`) composes them with the
parts of its own; nothing here knows how or when an engine saves.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as torch_dist
from torch import nn

from moc.checkpoint.dist import Dist, RankError, raise_failures
from moc.checkpoint.failures import DEFAULT_MAX_FAILURES, FailurePolicy
from moc.checkpoint.lineage import Lineage, SaveOrder, segment_id
from moc.checkpoint.modelconfig import model_config_of
from moc.checkpoint.optimizers import NoOptimizer, as_optimizer_state
from moc.checkpoint.plan.chain import ChainState
from moc.checkpoint.policy.selection import PECPolicy
from moc.checkpoint.policy.tokens import TokenLedger
from moc.checkpoint.spec import ExpertSpec
from moc.checkpoint.state import RankState, default_model_meta
from moc.checkpoint.store.backend import ObjectPath
from moc.checkpoint.store.identity import ensure_run_id, read_run_id
from moc.checkpoint.store.lock import DirectoryLock
from moc.checkpoint.store.retention import BackgroundRetention
from moc.checkpoint.store.steps import complete_steps
from moc.checkpoint.store.storage import Storage, open_storage
from moc.checkpoint.store.tidy import WriteTidy
from moc.topology import ParallelGroups

log = logging.getLogger(__name__)


@dataclass
class EngineParts:
    storage: Storage
    """The checkpoint directory, normalised once, here (`store.storage`)."""
    root: Path | ObjectPath
    """`storage.root`: what the store layer's functions take."""
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
    lock: DirectoryLock | None
    """Rank 0's exclusive lock on `root` (`store.lock`); None elsewhere."""
    run_id: str | None
    """The run `root` belongs to (`store.identity`), the same on every rank; None when
    the directory is read-only and has none."""
    failures: FailurePolicy
    tidy: WriteTidy | None
    """Rank 0's deferred clean-up of the directory, done at the first save (None elsewhere,
    and for a model-only engine, which never writes)."""
    order: SaveOrder
    """This engine's line: the lineage its checkpoints record, and the steps it may still
    save (the directory's newest step, until a restore says where the line continues)."""

    @property
    def run(self) -> dict[str, Any]:
        """What this engine's checkpoints record about their run (`Manifest.run`)."""
        return self.order.run(self.run_id)

    def restored(self, step: int | None, lineage: Lineage) -> None:
        """This engine restored `step` (None: nothing) written by `lineage`: its line
        continues from there, as a new segment whose id rank 0 chose. Collective."""
        self.order.restored(step, lineage, self.dist.broadcast(segment_id()))

    @property
    def model_only(self) -> bool:
        """Built with `optimizer=None`: restores the model for inference, never saves."""
        return isinstance(self.state.optimizer, NoOptimizer)

    def check_save(self, step: int) -> None:
        """ValueError, before anything is written, for a save this engine must not make:
        any save of a model-only engine, and a step that is not after the newest one of
        the directory or of this line (`SaveOrder.check`)."""
        if self.model_only:
            raise ValueError(
                "this engine was built with optimizer=None (model-only: restore for "
                "inference) and cannot save a training checkpoint, which must hold the "
                "optimizer state; pass the optimizer to save checkpoints")
        self.order.check(step, self.root)

    @classmethod
    def build(cls, model: nn.Module, optimizer: object, directory: str | Path, *,
              experts: ExpertSpec | None, groups: ParallelGroups | None,
              policy: PECPolicy | None, interval: int, keep_last: int | None,
              model_meta: dict[str, Any] | None, mode: str | None,
              max_failures: int | None = DEFAULT_MAX_FAILURES) -> EngineParts:
        """Validate the arguments every engine takes and build its parts. Collective
        under torch.distributed: rank 0 locks the directory and every rank learns
        whether it could."""
        if interval < 1:
            raise ValueError(f"Checkpointer interval must be >= 1, got {interval}")
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"Checkpointer keep_last must be >= 1 or None, got {keep_last}")
        model = unwrap(model)
        spec, groups, refused = _spec_and_groups(model, experts, groups)
        policy = policy if policy is not None else PECPolicy.full()
        if (spec is not None and policy.k is not None and policy.selection != "full"
                and policy.k > spec.n_experts):
            raise ValueError(f"PECPolicy.k={policy.k} is more than the {spec.n_experts} "
                             "experts per MoE layer; use k <= n_experts, or k=None for all")
        failures = FailurePolicy(max_failures, groups.rank)
        dist = Dist(groups)
        # Collective: a rank that refuses its layout still enters it, so every rank
        # raises the same refusal.
        state = RankState.agreed(model, as_optimizer_state(optimizer, model), spec,
                                 groups.rank, dist.all_gather, refused=refused)
        spec = state.spec
        storage = open_storage(directory)  # the one place the directory is normalised
        root = storage.root
        lock, run_id, newest, failed = None, None, None, None
        writes = optimizer is not None
        if groups.rank == 0:
            try:
                # A model-only engine only reads: no lock (readers need none, and taking
                # it writes the holder into the directory), no new run id.
                lock = DirectoryLock.acquire(root) if writes else None
                run_id = ensure_run_id(root) if writes else read_run_id(root)
                steps = complete_steps(root) if writes else []
                newest = steps[-1] if steps else None
            except Exception as e:  # every rank raises it, none is left waiting
                failed = e
                if lock is not None:
                    lock.release()
        run_id, newest, segment, error = dist.broadcast(
            (run_id, newest, segment_id(), RankError.of(0, failed) if failed is not None
             else None))
        if failed is not None:
            raise failed
        if error is not None:
            raise_failures([error], groups.world_size)
        return cls(
            storage=storage, root=root, spec=spec, groups=groups, dist=dist, state=state,
            policy=policy, mode=mode or ("full" if policy.selection == "full" else "pec"),
            interval=interval, model_meta=model_meta or default_model_meta(model, spec),
            chain=ChainState(spec, policy, groups.layout.ep, model_config_of(model),
                             state.pieces),
            ledger=TokenLedger(spec.n_moe_layers, spec.n_experts,
                               policy.initial_k(spec.n_experts), policy.dynamic_k,
                               policy.plt_threshold),
            retention=(BackgroundRetention(root, keep_last)
                       if keep_last is not None and groups.rank == 0 and writes else None),
            lock=lock, run_id=run_id, failures=failures,
            tidy=WriteTidy(root) if groups.rank == 0 and writes else None,
            order=SaveOrder(newest, segment))

    @property
    def layout(self) -> dict[str, int]:
        """The parallel layout as manifests and snapshots record it (`ChainState.layout`)."""
        return self.chain.layout(self.groups.world_size, self.groups.layout.ep)

    def release(self) -> None:
        """Release the directory lock and end the routing recorder the engine's
        `watch_routing` made (the end of `close` and `abandon`; idempotent)."""
        self.ledger.end_watch()
        if self.lock is not None:
            self.lock.release()


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside DDP / FSDP-style wrappers (`.module`): checkpoints store the
    model's own names, so they restore into the plain model, wrapped or not."""
    wrappers = (nn.parallel.DistributedDataParallel, nn.DataParallel)
    while isinstance(model, wrappers) or (
            type(model).__name__ in ("FullyShardedDataParallel", "DeepSpeedEngine")
            and isinstance(getattr(model, "module", None), nn.Module)):
        model = model.module
    return model


def _spec_and_groups(model: nn.Module, experts: ExpertSpec | None,
                     groups: ParallelGroups | None
                     ) -> tuple[ExpertSpec | None, ParallelGroups, ValueError | None]:
    """The experts (found by `ExpertSpec.infer` when not given) and the groups (the
    default ones when not given), or, under an initialised multi-rank process group,
    this rank's refusal of them with groups that every rank builds alike: the refusal
    then goes into the engine's first all-gather (`RankState.agreed`), so that every
    rank raises it. A rank whose model differs (a pipeline stage without MoE layers)
    raising alone would leave its peers in that collective."""
    try:
        spec = experts if experts is not None else ExpertSpec.infer(model)
        return spec, groups if groups is not None else default_groups(spec), None
    except ValueError as e:
        if groups is None and not _multi_rank():
            raise
        # The default groups are plain data parallelism whatever the model: the same
        # `new_group` calls on every rank (`default_groups`).
        return None, groups if groups is not None else ParallelGroups.from_world(1, 1), e


def _multi_rank() -> bool:
    return (torch_dist.is_available() and torch_dist.is_initialized()
            and torch_dist.get_world_size() > 1)


def default_groups(spec: ExpertSpec) -> ParallelGroups:
    """No `groups`: one process, or, under an initialised multi-rank process group, plain
    data parallelism over the world (every rank holds every expert). A model whose
    experts are sharded over the ranks needs the groups that say how."""
    if not _multi_rank():
        return ParallelGroups.single(spec.n_experts)
    held = {g for p in spec.params for g in p.global_ids}
    if any(p.sharding is not None for p in spec.params):
        # DTensor experts say themselves which ranks hold which experts.
        return ParallelGroups.from_world(1, spec.n_experts)
    if len(held) < spec.n_experts:
        raise ValueError(
            f"this rank holds {len(held)} of the {spec.n_experts} experts per MoE layer "
            "(expert parallelism), so the checkpoint needs to know the layout: pass "
            "groups=moc.ParallelGroups.from_world(ep, n_experts)")
    return ParallelGroups.from_world(1, spec.n_experts)
