"""`moc.Checkpointer`: the synchronous engine a user drops into their own training loop.

    ckpt = moc.Checkpointer(model, optimizer, "ckpt/", policy=moc.PECPolicy(k=1),
                            interval=10, keep_last=3)
    ckpt.watch_routing(model)               # routed tokens, for PLT (moc.RoutingRecorder)

The training loop around it is the contract's, the same for every engine (the module
docstring of moc/checkpoint/api.py, the README and examples/ show it whole).

Instead of `watch_routing`, a loop may hand the counts itself every step:
`ckpt.record_routing(tokens_per_expert)`, (MoE layers, global experts) of this rank.

A save is a pipeline over small parts, each deciding one thing:

    token counts     summed over ranks (Dist) into the ledger (policy/tokens)
    what             the experts to save (ChainState.select: the PEC policy), and from
                     them which keys are written (ChainState.wanted)
    who              this rank's share (a Placement: the fully sharded plan by default)
    how, where       the rank's safetensors file in `step-N.tmp/` (store)
    agree            every rank's entries and errors, on every rank (Dist)
    commit           rank 0 writes the manifest and renames the step (store)
    chain            the chain continues from the committed manifest (ChainState)

Every key of the model and optimizer is in every manifest: keys not written at a step
point at the older step that holds their newest copy, so one manifest resolves the whole
state.

Failures. A rank that fails to write makes the step incomplete on every rank: nothing is
committed, the result carries `error`, and the chain goes on from the previous complete
checkpoint. Every collective is entered by every rank in the same order whatever fails,
so no rank is left waiting.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from moc.checkpoint.api import (
    CheckpointEngine,
    CheckpointResult,
    RecoveryReport,
    checked_save,
)
from moc.checkpoint.dist import Dist, describe, raise_failures
from moc.checkpoint.errors import CheckpointError
from moc.checkpoint.failures import DEFAULT_MAX_FAILURES, CheckpointFailedError
from moc.checkpoint.parts import EngineParts
from moc.checkpoint.plan.units import Wanted, rank_share
from moc.checkpoint.policy.selection import PECPolicy
from moc.checkpoint.recovery import resume_from_storage
from moc.checkpoint.routing import EngineRouting
from moc.checkpoint.spec import ExpertSpec, rng_rank_of
from moc.checkpoint.state import RankState
from moc.checkpoint.store import format as tensor_files
from moc.checkpoint.store.manifest import Entry, Manifest
from moc.checkpoint.store.steps import begin_step, commit_step, rank_file, tmp_dir
from moc.topology import ParallelGroups

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WriteContext:
    """What a placement may look at to choose this rank's tensors."""

    state: RankState
    groups: ParallelGroups
    dist: Dist


class Placement(Protocol):
    """Who writes what: this rank's tensors for one checkpoint (collective if it must
    move state between ranks)."""

    def tensors(self, ctx: WriteContext, wanted: Wanted) -> dict[str, torch.Tensor]: ...


class ShardedPlacement:
    """Every rank writes an equal share at the same time (`moc.checkpoint.plan`): the
    optimizer state it owns under ZeRO, its RNG, and the expert and non-expert modules
    the planner gives it among the ranks holding them; nothing moves between ranks."""

    def tensors(self, ctx: WriteContext, wanted: Wanted) -> dict[str, torch.Tensor]:
        state = ctx.state.flatten()
        return {k: state[k] for k in rank_share(ctx.state, ctx.groups.layout, state, wanted)}


class Checkpointer(EngineRouting, CheckpointEngine):
    """Partial experts checkpointing (PEC) with fully sharded writes, synchronous: `save`
    writes this rank's share of the step straight to storage and returns once the step
    is committed (or found incomplete); its result is then in `drain_completed()`.
    Implements `moc.checkpoint.api.CheckpointEngine`.

    Choose it for runs across nodes, for the simplest failure story (what `save`
    returned is on storage), or when a checkpoint every `interval` steps costs little
    next to the step. `moc.TwoLevelCheckpointer` hides the write behind training instead
    (on one node or many). The loop:

        ckpt = moc.Checkpointer(model, optimizer, "ckpt/", policy=moc.PECPolicy(k=1))
        report = ckpt.restore(); start = report.step if report else 0
        ckpt.watch_routing(model)
        for step in range(start + 1, steps + 1):
            train_step(); ckpt.wait_for_snapshot(); optimizer.step()
            ckpt.maybe_save(step, extra_state={...}, final=step == steps)

    Owner of its chain state, token ledger and retention: the caller's thread.
    """

    def __init__(self, model: nn.Module, optimizer: object, directory: str | Path, *,
                 experts: ExpertSpec | None = None, groups: ParallelGroups | None = None,
                 policy: PECPolicy | None = None, interval: int = 10,
                 keep_last: int | None = None, model_meta: dict[str, Any] | None = None,
                 mode: str | None = None, placement: Placement | None = None,
                 max_failures: int | None = DEFAULT_MAX_FAILURES) -> None:
        self.parts = EngineParts.build(model, optimizer, directory, experts=experts,
                                       groups=groups, policy=policy, interval=interval,
                                       keep_last=keep_last, model_meta=model_meta, mode=mode,
                                       max_failures=max_failures)
        self.root, self.spec, self.interval = self.parts.root, self.parts.spec, interval
        self.placement = placement if placement is not None else ShardedPlacement()
        self._done: list[CheckpointResult] = []
        self._retention_error: str | None = None
        self._saved = False  # whether this engine committed a checkpoint (since it was built)

    # -- the training loop's calls -------------------------------------------------------

    def wait_for_snapshot(self) -> None:
        """Nothing to wait for: a synchronous save is complete when it returns."""

    @property
    def pending(self) -> bool:
        return bool(self._done)

    def drain_completed(self) -> list[CheckpointResult]:
        out, self._done = self._done, []
        return out

    def flush(self) -> None:
        """Nothing in flight: every save is finished when it returns."""

    def host_memory(self) -> dict[str, int]:
        return {}

    # -- saving ----------------------------------------------------------------------------

    def save(self, step: int, extra_state: dict[str, Any] | None = None, *,
             final: bool = False) -> None:
        """Checkpoint `step` now. Collective; blocks until the step is committed (or
        found incomplete: then the result's `error` is set and the previous checkpoint
        stays newest). Invalid arguments raise ValueError on every rank before anything
        is written; `max_failures` failures in a row, or a failed `final` checkpoint,
        raise CheckpointFailedError on every rank."""
        t0 = time.perf_counter()
        parts = self.parts
        g, dist, chain, ledger = parts.groups, parts.dist, parts.chain, parts.ledger
        invalid = None
        try:
            extra_state = checked_save(step, extra_state)
            parts.check_save(step)
        except ValueError as e:
            invalid = e
        failures = dist.agree(invalid)  # a rank's bad loop state stops every rank
        if failures:
            raise ValueError(describe(failures, g.world_size))
        parts.order.saved(step)
        pending = ledger.take_pending()
        ledger.add_synced(dist.all_reduce_(pending))
        ledger.warn_if_untracked(step, g.rank)
        selected = chain.all_experts() if final else chain.select(step, ledger)
        wanted = chain.wanted(selected, step)
        tensors = self.placement.tensors(WriteContext(parts.state, g, dist), wanted)
        begun = None
        if g.rank == 0:
            try:
                if parts.tidy is not None:
                    parts.tidy.before_write()  # what the last restore left for the write path
                begin_step(self.root, step)
            except OSError as e:
                begun = f"rank 0 could not create the step directory: {e}"
        begun = dist.broadcast(begun)  # every rank skips writing into a missing directory
        entries, nbytes, error = {}, 0, None
        if tensors and begun is None:
            entries, nbytes, error = self._write(step, tensors)
        # Every rank learns every entry (the next checkpoint's chain needs them) and
        # every failure (so that all ranks take the same path from here).
        reports = dist.all_gather((g.rank, entries, nbytes, error, self._retention_error))
        self._retention_error = None
        bytes_per_rank = [0] * g.world_size
        for rank, _, rank_bytes, _, _ in reports:
            bytes_per_rank[rank] = rank_bytes
        errors = "; ".join([begun] if begun else [r[3] for r in reports if r[3]])
        written = chain.written(selected, step)
        if not errors:
            errors = self._commit(step, extra_state, reports, written) or ""
        self._done.append(CheckpointResult(
            step, parts.mode, ledger.k, [[] for _ in written] if errors else written,
            time.perf_counter() - t0, bytes_per_rank=bytes_per_rank, error=errors or None))
        self._saved = self._saved or not errors
        fatal = parts.failures.check(step, errors or None, final)
        if not errors and parts.retention is not None:
            try:
                parts.retention.request()
            except CheckpointError as e:  # reported to every rank with the next save
                self._retention_error = str(e)
        if reports[0][4]:
            raise CheckpointError(reports[0][4])
        if fatal is not None:
            raise CheckpointFailedError(fatal)

    def _write(self, step: int, tensors: dict[str, torch.Tensor]
               ) -> tuple[dict[str, Entry], int, str | None]:
        """This rank's file of `step`: its entries, its bytes, or why it failed."""
        rank = self.parts.groups.rank
        name = rank_file(rank)
        path = tmp_dir(self.root, step) / name
        try:
            records = tensor_files.write_safetensors(path, tensors)
            nbytes = path.stat().st_size
        except OSError as e:  # name the file and the size: `[Errno 28]` alone says neither
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
            return {}, 0, f"rank {rank} could not write {path} ({nbytes} bytes): {e}"
        return ({k: Entry(step, name, r.dtype, r.shape, r.crc, r.algo) for k, r in records.items()},
                nbytes, None)

    def _commit(self, step: int, extra_state: dict[str, Any] | None, reports: list[tuple],
                written: list[list[int]]) -> str | None:
        """Rank 0 commits the manifest; every rank learns whether it could, and the chain
        advances on every rank when it did. Collective."""
        parts = self.parts
        g, chain = parts.groups, parts.chain
        # Ranks that no longer exist (a restart on fewer ranks) leave no RNG behind.
        entries = {k: e for k, e in chain.entries.items()
                   if (r := rng_rank_of(k)) is None or r < g.world_size}
        files = {}
        for rank, rank_entries, rank_bytes, _, _ in reports:
            entries.update(rank_entries)
            if rank_bytes:
                files[rank_file(rank)] = rank_bytes
        template = chain.template(step, mode=parts.mode, layout=parts.layout,
                                  model_meta=parts.model_meta, extra=extra_state,
                                  written=written, ledger=parts.ledger, run=parts.run)
        manifest = Manifest(entries=entries, files=files, **template)
        error = None
        if g.rank == 0:
            try:
                commit_step(self.root, step, manifest.to_json())
            except OSError as e:
                error = f"rank 0 could not commit step {step}: {e}"
        error = parts.dist.broadcast(error)
        if error is None:
            chain.advance(manifest)
            parts.ledger.committed(manifest.tokens)
        return error

    # -- recovery --------------------------------------------------------------------------

    def restore(self, step: int | None = None) -> RecoveryReport | None:
        """Load the newest intact checkpoint into the model and optimizer; None if the
        directory holds none. `step`: roll back to that step (see
        `CheckpointEngine.restore`). Collective."""
        p = self.parts
        return resume_from_storage(p.root, p.state, p.dist, p.model_meta, p.chain, p.ledger,
                                   p.tidy, restored=p.restored, run_id=p.run_id, step=step)

    def abandon(self) -> None:
        """`CheckpointEngine.abandon`: a save is synchronous, so nothing is in flight;
        retention stops and the directory's lock is released."""
        p = self.parts
        try:
            if p.retention is not None:
                p.retention.close()
        except Exception as e:
            log.warning("retention did not stop cleanly while abandoning the engine: %s", e)
        finally:
            p.release()

    def close(self) -> None:
        """Finish background work (retention) and raise any error it met, on every
        rank. Collective."""
        # A retention error met at the last save has no later save to share it.
        p = self.parts
        try:
            failures = p.dist.agree(self._retention_error)
            self._retention_error = None
            if p.retention is not None:
                p.retention.close()
        finally:
            p.release()
        # Only about what this engine wrote: a restore-only engine has nothing to say about
        # a step it did not write (and a complete one restored is complete).
        m = p.chain.manifest
        if (self._saved and m is not None and p.groups.rank == 0
                and not bool((p.chain.saved_at >= m.step).all())):
            log.warning("the newest checkpoint (step %d) is partial (K=%d of %d experts "
                        "per layer); pass final=True to the last save for a complete one",
                        m.step, p.ledger.k, p.spec.n_experts)
        raise_failures(failures, p.groups.world_size)
