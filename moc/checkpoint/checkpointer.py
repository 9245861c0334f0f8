"""`moc.Checkpointer`: the library a user drops into their own training loop.

    ckpt = moc.Checkpointer(model, optimizer, "ckpt/", policy=moc.PECPolicy(k=1),
                            interval=10, keep_last=3)
    report = ckpt.restore()                 # None on a fresh start
    for step in range(start, steps):
        loss = model(batch); loss.backward()
        ckpt.wait_for_snapshot()            # the only place training may wait on a checkpoint
        optimizer.step()
        ckpt.record_routing(counts)         # (MoE layers, experts) tokens routed this step
        ckpt.maybe_save(step, extra_state={...})
    ckpt.close()

What is written (the policy: all non-expert state + K experts per layer), by whom (the
writers below), and when (every `interval` steps) are separate decisions. Every key of
the model and optimizer is in every manifest: keys not written at a step point at the
older step that holds their newest copy, so one manifest resolves the whole state.

Writers (this release): the Megatron-DeepSpeed placement. Rank 0 writes the non-expert
state (the non-expert optimizer state is gathered to it from its ZeRO owners) and the
ranks of expert-parallel group 0 write the selected experts (their optimizer state
gathered from the expert's replicas). With the full policy this is the blocking baseline.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moc.checkpoint.manifest import Entry, Manifest
from moc.checkpoint.optim_state import as_optimizer_state
from moc.checkpoint.recovery import restore_latest
from moc.checkpoint.selection import PECPolicy, SelectionContext, select_experts
from moc.checkpoint.spec import (
    ExpertSpec,
    flatten_optimizer,
    flatten_params,
    parse_expert_key,
    rng_key,
)
from moc.checkpoint.storage import (
    begin_step,
    commit_step,
    rank_file,
    remove_abandoned,
    set_aside,
    tmp_dir,
    write_safetensors,
)
from moc.checkpoint.tokens import TokenLedger
from moc.parallel.collectives import gather_tensors
from moc.parallel.groups import ParallelGroups


@dataclass(frozen=True)
class SaveStats:
    step: int
    stall_s: float
    """Time the caller was blocked by this save."""
    bytes_per_rank: list[int]
    mode: str
    k: int
    experts_saved: list[list[int]]
    """Global expert ids written per MoE layer."""

    @property
    def bytes(self) -> int:
        return sum(self.bytes_per_rank)

    @property
    def n_experts_saved(self) -> int:
        return sum(len(e) for e in self.experts_saved)


@dataclass(frozen=True)
class RecoveryReport:
    step: int
    """The step restored (training continues after it)."""
    extra: dict[str, Any]
    """The loop state passed to `maybe_save(extra_state=...)` at that step."""
    source: str
    recovery_s: float
    lost_tokens: int
    """Expert token assignments whose updates this recovery lost (0 when every expert
    came back at `step`)."""
    lost_per_layer: list[int]
    plt: float
    """Cumulative proportion of lost tokens of the run, this recovery included."""
    k: int
    """K in force after this recovery (Dynamic-K may have raised it)."""
    k_before: int
    skipped: list[str] = field(default_factory=list)
    """Newer steps found corrupt and skipped, with the reason."""


def default_model_meta(model: nn.Module, spec: ExpertSpec) -> dict[str, Any]:
    """What a checkpoint must match to be restored into `model`: expert geometry and
    the shapes of the non-expert parameters."""
    experts = spec.by_name()
    return {"n_experts": spec.n_experts, "n_moe_layers": spec.n_moe_layers,
            "dense": {n: list(p.shape) for n, p in model.named_parameters()
                      if n not in experts}}


class Checkpointer:
    def __init__(self, model: nn.Module, optimizer: object, directory: str | Path, *,
                 experts: ExpertSpec | None = None, groups: ParallelGroups | None = None,
                 policy: PECPolicy | None = None, interval: int = 10,
                 keep_last: int | None = None, model_meta: dict[str, Any] | None = None,
                 mode: str | None = None) -> None:
        if interval < 1:
            raise ValueError(f"Checkpointer interval must be >= 1, got {interval}")
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"Checkpointer keep_last must be >= 1 or None, got {keep_last}")
        self.root = Path(directory)
        self.model = model
        self.spec = experts if experts is not None else ExpertSpec.infer(model)
        self.groups = groups if groups is not None else ParallelGroups.single(
            self.spec.n_experts)
        self.optimizer = as_optimizer_state(optimizer, model)
        self.policy = policy if policy is not None else PECPolicy.full()
        self.mode = mode or ("full" if self.policy.selection == "full" else "pec")
        self.interval = interval
        self.keep_last = keep_last
        self.model_meta = model_meta or default_model_meta(model, self.spec)
        self.k = self.policy.initial_k(self.spec.n_experts)
        self.ledger = TokenLedger(self.spec.n_moe_layers, self.spec.n_experts)
        self._stems = self.spec.stems()
        self._manifest: Manifest | None = None
        self._index = 0  # checkpoints in this chain so far (the sequential rotation's c)
        self._plt_base = 0.0  # cumulative PLT when K last changed (Dynamic-K)
        # Step of each expert's newest saved copy; load-aware breaks ties by it.
        self._saved_at = torch.zeros((self.spec.n_moe_layers, self.spec.n_experts),
                                     dtype=torch.int64)
        self._retention = None
        if keep_last is not None and self.groups.rank == 0:
            from moc.checkpoint.retention import BackgroundRetention
            self._retention = BackgroundRetention(self.root, keep_last)

    # -- the training loop's calls -------------------------------------------------------

    def record_routing(self, counts: torch.Tensor) -> None:
        """Tokens this rank routed to each (MoE layer, global expert) this step."""
        self.ledger.record(counts)

    def wait_for_snapshot(self) -> None:
        """Blocks until the state being checkpointed may change. Saves are synchronous in
        this release, so there is nothing to wait for."""

    def maybe_save(self, step: int, extra_state: dict[str, Any] | None = None
                   ) -> SaveStats | None:
        if step % self.interval:
            return None
        return self.save(step, extra_state)

    # -- saving ----------------------------------------------------------------------------

    def _select(self, step: int) -> list[list[int]]:
        spec = self.spec
        all_experts = [list(range(spec.n_experts)) for _ in range(spec.n_moe_layers)]
        if self._manifest is None:
            return all_experts  # the first checkpoint of a chain has no older copies
        stale = (step - self._saved_at).tolist()
        ctx = SelectionContext(self._index, spec.n_experts, spec.n_moe_layers, self.k,
                               unsaved_tokens=tuple(map(tuple, self.ledger.unsaved().tolist())),
                               staleness=tuple(map(tuple, stale)))
        return select_experts(self.policy.selection, ctx)

    def _wanted(self, selected: list[set[int]], prev: dict[str, Entry]):
        """Predicate: is this key written at this checkpoint?"""
        apply_to = self.policy.apply_to

        def wanted(key: str) -> bool:
            parsed = parse_expert_key(key)
            if parsed is None or key not in prev:
                return True
            kind, stem, gid = parsed
            partial = apply_to == "both" or (apply_to == "weights") == (kind == "param")
            return not partial or gid in selected[self._stems[stem]]
        return wanted

    def save(self, step: int, extra_state: dict[str, Any] | None = None) -> SaveStats:
        """Checkpoint `step` now. Collective; blocks until the step is committed."""
        t0 = time.perf_counter()
        g = self.groups
        side = g.side_group
        self.ledger.sync(side)
        selected = self._select(step)
        prev = self._manifest.entries if self._manifest is not None else {}
        wanted = self._wanted([set(s) for s in selected], prev)

        expert_names = {p.name for p in self.spec.params}
        local = self.optimizer.local_state()
        dense_optim = flatten_optimizer(
            {n: s for n, s in local.items() if n not in expert_names}, self.spec)
        expert_optim = flatten_optimizer(
            {n: s for n, s in local.items() if n in expert_names}, self.spec)
        expert_optim = {k: v for k, v in expert_optim.items() if wanted(k)}
        # Consolidate onto the writers (the baseline placement).
        dense_optim[rng_key(g.rank)] = torch.get_rng_state()
        dense_optims = gather_tensors(dense_optim, 0, side)
        expert_optims = gather_tensors(expert_optim, g.ep_rank, g.edp_group)

        if g.rank == 0:
            begin_step(self.root, step)
        self._barrier()

        tensors: dict[str, torch.Tensor] = {}
        params = flatten_params(self.model, self.spec)
        if g.rank == 0:
            tensors.update({k: v for k, v in params.items() if parse_expert_key(k) is None})
            for part in dense_optims:
                tensors.update(part)
        if g.rank < g.layout.ep:  # expert-parallel group 0 writes the experts
            tensors.update({k: v for k, v in params.items()
                            if parse_expert_key(k) is not None and wanted(k)})
            for part in expert_optims:
                tensors.update(part)

        entries: dict[str, Entry] = {}
        nbytes = 0
        if tensors:
            name = rank_file(g.rank)
            path = tmp_dir(self.root, step) / name
            records = write_safetensors(path, tensors)
            nbytes = path.stat().st_size
            entries = {k: Entry(step, name, r.dtype, r.shape, r.crc32)
                       for k, r in records.items()}
        # Every rank learns every entry: the next checkpoint's chain needs them everywhere.
        reports = _all_gather((g.rank, entries, nbytes), side, g)

        bytes_per_rank = [0] * g.world_size
        all_entries = dict(prev)
        files = {}
        for rank, rank_entries, rank_bytes in reports:
            all_entries.update(rank_entries)
            bytes_per_rank[rank] = rank_bytes
            if rank_bytes:
                files[rank_file(rank)] = rank_bytes
        written = self._experts_written(all_entries, step)
        self.ledger.mark_saved(written)
        self._saved_at = self._newest_copies(all_entries)
        manifest = Manifest(
            step=step, mode=self.mode, layout={"world_size": g.world_size, "ep": g.layout.ep},
            model=self.model_meta, entries=all_entries, files=files, extra=extra_state or {},
            experts={"n_experts": self.spec.n_experts, "n_moe_layers": self.spec.n_moe_layers,
                     "stems": self._stems},
            policy={**self.policy.to_dict(), "k": self.k, "index": self._index,
                    "plt_base": self._plt_base},
            experts_saved={str(m): e for m, e in enumerate(written)},
            tokens=self.ledger.to_json())
        if g.rank == 0:
            commit_step(self.root, step, manifest.to_json())
        self._barrier()  # blocks until the step is committed
        self._manifest = manifest
        self._index += 1
        if self._retention is not None:
            self._retention.request()
        return SaveStats(step, time.perf_counter() - t0, bytes_per_rank, self.mode, self.k,
                         written)

    def _tracked_kind(self) -> str:
        """The partial part of expert state that PLT accounting follows: the weights,
        unless only the optimizer state is partial."""
        return "optim" if self.policy.apply_to == "optimizer" else "param"

    def _newest_copies(self, entries: dict[str, Entry]) -> torch.Tensor:
        """(layers x experts) step holding each expert's newest copy (its oldest tensor)."""
        saved_at = torch.full((self.spec.n_moe_layers, self.spec.n_experts), 2**62)
        for key, entry in entries.items():
            parsed = parse_expert_key(key)
            if parsed and parsed[0] == self._tracked_kind():
                m, e = self._stems[parsed[1]], parsed[2]
                saved_at[m, e] = min(int(saved_at[m, e]), entry.step)
        return saved_at.masked_fill(saved_at == 2**62, 0)

    def _experts_written(self, entries: dict[str, Entry], step: int) -> list[list[int]]:
        """Experts whose tracked state has its newest copy at `step`."""
        saved_at = self._newest_copies(entries)
        return [[e for e in range(self.spec.n_experts) if saved_at[m, e] == step]
                for m in range(self.spec.n_moe_layers)]

    # -- recovery --------------------------------------------------------------------------

    def restore(self) -> RecoveryReport | None:
        """Load the newest intact checkpoint into the model and optimizer; None if the
        directory holds none. Collective."""
        if self.groups.rank == 0:
            remove_abandoned(self.root)
        self._barrier()
        result = restore_latest(self.root, self.model, self.optimizer, self.spec, self.groups,
                                self.model_meta)
        if result is None:
            return None
        if self.groups.rank == 0:
            for step, reason in zip(result.skipped_steps, result.skipped, strict=True):
                set_aside(self.root, step, reason)
        manifest = result.manifest
        self._manifest = manifest
        self._saved_at = self._newest_copies(manifest.entries)
        policy = manifest.policy
        self._index = int(policy.get("index", -1)) + 1
        self.k = int(policy.get("k", self.k))
        self._plt_base = float(policy.get("plt_base", 0.0))
        self.ledger.load_json(manifest.tokens)
        plt = self.ledger.recover()
        k_before = self.k
        if (self.policy.dynamic_k and self.k < self.spec.n_experts
                and plt.plt - self._plt_base > self.policy.plt_threshold):
            self.k = min(2 * self.k, self.spec.n_experts)
            self._plt_base = plt.plt
        return RecoveryReport(result.step, manifest.extra, result.source, result.recovery_s,
                              plt.lost_tokens, plt.lost_per_layer, plt.plt, self.k, k_before,
                              result.skipped)

    def close(self) -> None:
        """Finish background work (retention) and raise any error it met."""
        if self._retention is not None:
            self._retention.close()

    def _barrier(self) -> None:
        if self.groups.distributed:
            dist.barrier(group=self.groups.side_group)


def _all_gather(obj: Any, group: dist.ProcessGroup | None, groups: ParallelGroups
                ) -> list[Any]:
    if not groups.distributed:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
