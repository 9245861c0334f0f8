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

Writers. Sharded (the default): every rank writes an equal share at the same time
(`moc.checkpoint.plan`): the optimizer state it owns under ZeRO, its RNG, and the expert
and non-expert modules the planner gives it among the ranks holding them; nothing moves
between ranks. Baseline (`sharded=False`): the Megatron-DeepSpeed placement, rank 0 writes
the non-expert state (its optimizer state gathered from the ZeRO owners) and the ranks of
expert-parallel group 0 write the experts; with the full policy that is the blocking
baseline of the paper.

Failures. A rank that fails to write makes the step incomplete on every rank: nothing is
committed, `save` returns stats with `error` set, and the chain goes on from the previous
complete checkpoint. Every collective is entered by every rank in the same order whatever
fails, so no rank is left waiting.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moc.checkpoint.errors import CheckpointError
from moc.checkpoint.manifest import Entry, Manifest
from moc.checkpoint.optim_state import as_optimizer_state
from moc.checkpoint.plan import DENSE, EXPERT, FIXED, WriteUnit, imbalance, plan_writes
from moc.checkpoint.recovery import restore_latest
from moc.checkpoint.selection import PECPolicy, SelectionContext, select_experts
from moc.checkpoint.spec import (
    ExpertSpec,
    expert_key,
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
    error: str | None = None
    """Why the step was not committed (a rank failed to write); None when it was."""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def bytes(self) -> int:
        return sum(self.bytes_per_rank)

    @property
    def imbalance(self) -> float:
        """Busiest rank's bytes over the mean (1.0: every rank wrote the same)."""
        return imbalance(self.bytes_per_rank)

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


OPTIM_BYTES_PER_PARAM_BYTE = 2
"""Planning estimate of optimizer state per byte of parameter (AdamW: two moments). It
only balances the plan; what is written is measured."""

_RNG = re.compile(r"^rng/rank=(\d+)$")


class Checkpointer:
    def __init__(self, model: nn.Module, optimizer: object, directory: str | Path, *,
                 experts: ExpertSpec | None = None, groups: ParallelGroups | None = None,
                 policy: PECPolicy | None = None, interval: int = 10,
                 keep_last: int | None = None, model_meta: dict[str, Any] | None = None,
                 mode: str | None = None, sharded: bool = True) -> None:
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
        self.sharded = sharded
        self.interval = interval
        self.keep_last = keep_last
        self.model_meta = model_meta or default_model_meta(model, self.spec)
        self.k = self.policy.initial_k(self.spec.n_experts)
        self.ledger = TokenLedger(self.spec.n_moe_layers, self.spec.n_experts)
        self._stems = self.spec.stems()
        self._manifest: Manifest | None = None
        self._index = 0  # checkpoints in this chain so far (the sequential rotation's c)
        # Per-layer lost tokens when K last changed: Dynamic-K judges what was lost since.
        self._lost_base = torch.zeros(self.spec.n_moe_layers, dtype=torch.int64)
        # Step of each expert's newest saved copy; load-aware breaks ties by it.
        self._saved_at = torch.zeros((self.spec.n_moe_layers, self.spec.n_experts),
                                     dtype=torch.int64)
        self._retention = None
        self._retention_error: str | None = None
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

    # -- what is written -------------------------------------------------------------------

    def _select(self, step: int) -> list[list[int]]:
        spec = self.spec
        all_experts = [list(range(spec.n_experts)) for _ in range(spec.n_moe_layers)]
        if self._manifest is None:
            return all_experts  # the first checkpoint of a chain has no older copies
        stale = (step - self._saved_at).tolist()
        ctx = SelectionContext(self._index, spec.n_experts, spec.n_moe_layers, self.k,
                               unsaved_tokens=tuple(map(tuple, self.ledger.unsaved().tolist())),
                               staleness=tuple(map(tuple, stale)), ep=self.groups.layout.ep)
        return select_experts(self.policy.selection, ctx)

    def _wanted(self, selected: list[set[int]], prev: dict[str, Entry], step: int):
        """Predicate: is this key written at this checkpoint? Non-expert keys always;
        the partial part of an expert's state when it is selected; any key with no
        usable older copy (none yet, or one in the step directory this save replaces)."""
        apply_to = self.policy.apply_to

        def wanted(key: str) -> bool:
            parsed = parse_expert_key(key)
            if parsed is None or key not in prev or prev[key].step >= step:
                return True
            kind, stem, gid = parsed
            partial = apply_to == "both" or (apply_to == "weights") == (kind == "param")
            return not partial or gid in selected[self._stems[stem]]
        return wanted

    # -- who writes it -----------------------------------------------------------------------

    def _units(self, wanted) -> tuple[list[WriteUnit], dict[str, str]]:
        """The plan's units, the same on every rank, and the unit of each local key.

        Every rank derives every unit from what it can see: the dense parameters (the
        same everywhere), the shape of one expert's tensors (the same for every expert
        of a layer), the layout, and the optimizer's owner map. Sizes of optimizer state
        are estimated (OPTIM_BYTES_PER_PARAM_BYTE): the plan only needs to balance.
        """
        g, layout, spec = self.groups, self.groups.layout, self.spec
        everyone = tuple(range(g.world_size))
        owner_of = getattr(self.optimizer, "owner_of", None)
        replicated_optim = owner_of is None  # each rank holds the state of what it holds
        factor = 1 + (OPTIM_BYTES_PER_PARAM_BYTE if replicated_optim else 0)
        sizes: dict[str, int] = {}
        holders: dict[str, tuple[int, ...]] = {}
        kinds: dict[str, str] = {}
        unit_of: dict[str, str] = {}
        fixed = [0] * g.world_size

        def add(unit: str, nbytes: int, who: tuple[int, ...], kind: str) -> None:
            sizes[unit] = sizes.get(unit, 0) + nbytes
            holders[unit], kinds[unit] = who, kind

        experts = spec.by_name()
        for name, p in self.model.named_parameters():
            nbytes = p.numel() * p.element_size()
            if name not in experts:
                unit = f"dense:{name.rsplit('.', 1)[0]}"
                add(unit, nbytes * factor, everyone, DENSE)
                unit_of[f"param/{name}"] = unit
                if not replicated_optim:
                    fixed[owner_of(name, g.ep_rank)] += nbytes * OPTIM_BYTES_PER_PARAM_BYTE
                continue
            ep = experts[name]
            per_expert = nbytes // len(ep.global_ids)
            for gid in range(spec.n_experts):  # every expert, local or not
                key = expert_key("param", ep.stem, gid)
                if key in unit_of:
                    continue
                unit = unit_of[key] = f"expert:{ep.moe_layer}:{gid}"
                size = per_expert * wanted(key)
                if replicated_optim and wanted(expert_key("optim", ep.stem, gid, "exp_avg")):
                    size += per_expert * OPTIM_BYTES_PER_PARAM_BYTE
                add(unit, size, tuple(layout.expert_replicas(gid)), EXPERT)
            if not replicated_optim:
                for e_rank in range(layout.ep):
                    ids = layout.local_experts(e_rank)
                    n = sum(wanted(expert_key("optim", ep.stem, gid, "exp_avg")) for gid in ids)
                    fixed[owner_of(name, e_rank)] += n * per_expert * OPTIM_BYTES_PER_PARAM_BYTE
        units = [WriteUnit(u, sizes[u], holders[u], kinds[u]) for u in sizes]
        units += [WriteUnit(f"owned:{r}", fixed[r], (r,), FIXED) for r in everyone]
        return units, unit_of

    def _local_state(self, rng: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Everything this rank holds under stable keys (views, no copies): its
        parameters, the optimizer state it owns, its RNG (`rng`: the state taken when
        the checkpoint was requested; now by default)."""
        state = flatten_params(self.model, self.spec)
        state.update(flatten_optimizer(self.optimizer.local_state(), self.spec))
        state[rng_key(self.groups.rank)] = torch.get_rng_state() if rng is None else rng
        return state

    def _sharded_keys(self, wanted, state: dict[str, torch.Tensor]) -> list[str]:
        """The keys of `state` this rank writes under the sharded plan."""
        g = self.groups
        units, unit_of = self._units(wanted)
        writer = plan_writes(units, g.world_size).writer
        replicated_optim = getattr(self.optimizer, "owner_of", None) is None

        def mine(key: str) -> bool:
            if key.startswith("rng/"):
                return True
            if key.startswith("optim/"):
                # Sharded state is written by its owner, i.e. here; replicated state
                # goes with its parameter's unit.
                return not replicated_optim or writer[unit_of[_param_key(key)]] == g.rank
            return writer[unit_of[key]] == g.rank

        return [k for k in state if wanted(k) and mine(k)]

    def _sharded_tensors(self, wanted) -> dict[str, torch.Tensor]:
        """This rank's share: nothing moves between ranks."""
        state = self._local_state()
        return {k: state[k] for k in self._sharded_keys(wanted, state)}

    def _baseline_tensors(self, wanted) -> dict[str, torch.Tensor]:
        """Rank 0: all non-expert state; EP group 0: the experts (collective)."""
        g = self.groups
        expert_names = {p.name for p in self.spec.params}
        local = self.optimizer.local_state()
        dense_optim = flatten_optimizer(
            {n: s for n, s in local.items() if n not in expert_names}, self.spec)
        expert_optim = flatten_optimizer(
            {n: s for n, s in local.items() if n in expert_names}, self.spec)
        expert_optim = {k: v for k, v in expert_optim.items() if wanted(k)}
        dense_optim[rng_key(g.rank)] = torch.get_rng_state()
        dense_parts = gather_tensors(dense_optim, 0, g.side_group)
        expert_parts = gather_tensors(expert_optim, g.ep_rank, g.edp_side_group)
        params = flatten_params(self.model, self.spec)
        tensors: dict[str, torch.Tensor] = {}
        if g.rank == 0:
            tensors.update({k: v for k, v in params.items() if parse_expert_key(k) is None})
            for part in dense_parts:
                tensors.update(part)
        if g.rank < g.layout.ep:  # expert-parallel group 0 writes the experts
            tensors.update({k: v for k, v in params.items()
                            if parse_expert_key(k) is not None and wanted(k)})
            for part in expert_parts:
                tensors.update(part)
        return tensors

    # -- saving ----------------------------------------------------------------------------

    def save(self, step: int, extra_state: dict[str, Any] | None = None) -> SaveStats:
        """Checkpoint `step` now. Collective; blocks until the step is committed (or
        found incomplete: then `error` is set and the previous checkpoint stays newest)."""
        t0 = time.perf_counter()
        g = self.groups
        self.ledger.sync(g.side_group)
        selected = self._select(step)
        prev = self._manifest.entries if self._manifest is not None else {}
        wanted = self._wanted([set(s) for s in selected], prev, step)
        tensors = (self._sharded_tensors(wanted) if self.sharded
                   else self._baseline_tensors(wanted))

        error = None
        if g.rank == 0:
            try:
                begin_step(self.root, step)
            except OSError as e:
                error = f"rank 0 could not create the step directory: {e}"
        self._barrier()
        entries: dict[str, Entry] = {}
        nbytes = 0
        if tensors and error is None:
            name = rank_file(g.rank)
            path = tmp_dir(self.root, step) / name
            try:
                records = write_safetensors(path, tensors)
                nbytes = path.stat().st_size
                entries = {k: Entry(step, name, r.dtype, r.shape, r.crc32)
                           for k, r in records.items()}
            except OSError as e:
                error = f"rank {g.rank} could not write {path}: {e}"
        # Every rank learns every entry (the next checkpoint's chain needs them) and
        # every failure (so that all ranks take the same path from here).
        reports = _all_gather((g.rank, entries, nbytes, error, self._retention_error),
                              g.side_group, g)
        errors = [r[3] for r in reports if r[3]]
        retention_error = reports[0][4]
        self._retention_error = None
        bytes_per_rank = [0] * g.world_size
        for rank, _, rank_bytes, _, _ in reports:
            bytes_per_rank[rank] = rank_bytes
        if errors:
            return SaveStats(step, time.perf_counter() - t0, bytes_per_rank, self.mode,
                             self.k, [[] for _ in selected], "; ".join(errors))

        # Ranks that no longer exist (a restart on fewer ranks) leave no RNG behind.
        all_entries = {k: e for k, e in prev.items()
                       if not ((m := _RNG.match(k)) and int(m.group(1)) >= g.world_size)}
        files = {}
        for rank, rank_entries, rank_bytes, _, _ in reports:
            all_entries.update(rank_entries)
            if rank_bytes:
                files[rank_file(rank)] = rank_bytes
        written = self._experts_written(all_entries, step)
        manifest = Manifest(
            step=step, mode=self.mode, layout={"world_size": g.world_size, "ep": g.layout.ep},
            model=self.model_meta, entries=all_entries, files=files, extra=extra_state or {},
            experts={"n_experts": self.spec.n_experts, "n_moe_layers": self.spec.n_moe_layers,
                     "stems": self._stems},
            policy={**self.policy.to_dict(), "k": self.k, "index": self._index,
                    "lost_base": self._lost_base.tolist()},
            experts_saved={str(m): e for m, e in enumerate(written)},
            tokens={**self.ledger.to_json(),
                    "at_save": self._at_save_after(written).tolist()})
        commit_error = None
        if g.rank == 0:
            try:
                commit_step(self.root, step, manifest.to_json())
            except OSError as e:
                commit_error = f"rank 0 could not commit step {step}: {e}"
        commit_error = _all_gather(commit_error, g.side_group, g)[0]
        if commit_error:
            return SaveStats(step, time.perf_counter() - t0, bytes_per_rank, self.mode,
                             self.k, [[] for _ in selected], commit_error)

        self._manifest = manifest
        self._index += 1
        self.ledger.mark_saved(written)
        self._saved_at = self._newest_copies(all_entries)
        if self._retention is not None:
            try:
                self._retention.request()
            except CheckpointError as e:  # reported to every rank with the next save
                self._retention_error = str(e)
        if retention_error:
            raise CheckpointError(retention_error)
        return SaveStats(step, time.perf_counter() - t0, bytes_per_rank, self.mode, self.k,
                         written)

    def _at_save_after(self, written: list[list[int]]) -> torch.Tensor:
        at_save = self.ledger.at_save.clone()
        for m, experts in enumerate(written):
            at_save[m, experts] = self.ledger.cumulative[m, experts]
        return at_save

    def _tracked_kind(self) -> str:
        """The partial part of expert state that PLT accounting follows: the weights,
        unless only the optimizer state is partial."""
        return "optim" if self.policy.apply_to == "optimizer" else "param"

    def _newest_copies(self, entries: dict[str, Entry]) -> torch.Tensor:
        """(layers x experts) step holding each expert's newest copy (its oldest tensor)."""
        # Plain ints, one tensor at the end: indexing a tensor element by element costs
        # microseconds each, and this runs inside save() on every rank.
        none = 2**62
        saved_at = [[none] * self.spec.n_experts for _ in range(self.spec.n_moe_layers)]
        kind = self._tracked_kind()
        for key, entry in entries.items():
            parsed = parse_expert_key(key)
            if parsed and parsed[0] == kind:
                row = saved_at[self._stems[parsed[1]]]
                row[parsed[2]] = min(row[parsed[2]], entry.step)
        out = torch.tensor(saved_at, dtype=torch.int64)
        return out.masked_fill(out == none, 0)

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
        self.ledger.load_json(manifest.tokens)
        plt = self.ledger.recover()
        # K: what the user asked for, unless Dynamic-K had already raised it in this run.
        k_before = self.k
        if self.policy.dynamic_k and "k" in policy:
            k_before = max(self.k, int(policy["k"]))
            self._lost_base = torch.tensor(policy.get("lost_base", [0] * len(plt.lost_per_layer)),
                                           dtype=torch.int64)
        self.k = k_before
        if (self.policy.dynamic_k and self.k < self.spec.n_experts
                and self.ledger.plt(self._lost_base) > self.policy.plt_threshold):
            self.k = min(2 * self.k, self.spec.n_experts)
            self._lost_base = self.ledger.lost.clone()
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


def _param_key(optim_key: str) -> str:
    """param/<name> or param/<stem>/expert=<g> for an optimizer key of that tensor."""
    parsed = parse_expert_key(optim_key)
    if parsed is not None:
        return expert_key("param", parsed[1], parsed[2])
    return "param/" + optim_key[len("optim/"):].rsplit("/", 1)[0]


def _all_gather(obj: Any, group: dist.ProcessGroup | None, groups: ParallelGroups
                ) -> list[Any]:
    if not groups.distributed:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
