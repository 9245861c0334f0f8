"""The one restore loop: candidates -> try -> agree -> fall back; and restoring from storage.

    value, skipped = restore_loop(candidates, attempt, dist)

Every engine restores through `restore_loop`: the ranks try the same candidates (steps)
in the same order, each loads its own share of the candidate (`attempt`), and they agree
on the outcome (`Dist.agree`) before anything else happens. A candidate that failed on
any rank is skipped by all of them; IncompatibleCheckpointError (a different model, a
shape that does not fit) is raised on every rank instead, since an older candidate of
the same directory would not fit either.

Restoring from storage: every rank reads only what it holds, its non-expert parameters,
its own experts, and the optimizer state of the parameters it owns; because keys are per
expert and per tensor, the layout at save time does not matter.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from moc.checkpoint.api import RecoveryReport
from moc.checkpoint.dist import Dist, RankError, describe, raise_failures
from moc.checkpoint.errors import CorruptCheckpointError, IncompatibleCheckpointError
from moc.checkpoint.plan.chain import ChainState
from moc.checkpoint.policy.tokens import TokenLedger
from moc.checkpoint.state import RankState
from moc.checkpoint.store.backend import ObjectPath, open_root
from moc.checkpoint.store.format import TensorReader
from moc.checkpoint.store.manifest import Manifest
from moc.checkpoint.store.steps import (
    checked_step_dir,
    complete_steps,
    interrupted_commits,
    put_back_replaced,
)
from moc.checkpoint.store.tidy import WriteTidy

log = logging.getLogger(__name__)

C = TypeVar("C")
T = TypeVar("T")


def restore_loop(candidates: Iterable[C], attempt: Callable[[C], T], dist: Dist, *,
                 skip: tuple[type[BaseException], ...] = (CorruptCheckpointError,),
                 label: Callable[[C], str] = str) -> tuple[T | None, list[tuple[C, str]]]:
    """The first candidate that `attempt` loads on every rank, and the (candidate, reason)
    of those skipped before it. Collective: `candidates` must be the same on every rank.

    `attempt(candidate)` loads this rank's share or raises: an error of a `skip` type
    makes every rank move on to the next candidate, IncompatibleCheckpointError is raised
    on every rank, anything else propagates (a bug, not a bad checkpoint).
    """
    skipped: list[tuple[C, str]] = []
    for candidate in candidates:
        value, error = None, None
        try:
            value = attempt(candidate)
        # Only the error's kind and message are kept: the exception itself (its
        # traceback, and those of the exceptions it was raised from) holds this frame,
        # which would hold the exception; that cycle kept the process groups alive until
        # interpreter exit, where tearing gloo down aborted the process (seen in tests).
        except IncompatibleCheckpointError as e:
            error = RankError.of(dist.rank, e)
        except skip as e:
            error = RankError.of(dist.rank, e)
        failures = dist.agree(error)
        if any(f.kind == IncompatibleCheckpointError.__name__ for f in failures):
            raise_failures(failures, dist.world_size)
        if not failures:
            return value, skipped
        reason = describe(failures, dist.world_size)
        log.warning("%s is not usable (%s); trying an older one", label(candidate), reason)
        skipped.append((candidate, reason))
    return None, skipped


class CheckpointReader:
    """Reads keys of one manifest, verifying each against its checksum."""

    def __init__(self, root: Path | ObjectPath, manifest: Manifest) -> None:
        self.root = open_root(root)
        self.manifest = manifest
        self._readers: dict[Path | ObjectPath, TensorReader] = {}

    def __contains__(self, key: str) -> bool:
        return key in self.manifest.entries

    def get(self, key: str) -> torch.Tensor:
        entry = self.manifest.entries.get(key)
        if entry is None:
            raise CorruptCheckpointError(
                f"step {self.manifest.step}: the manifest has no key {key!r}")
        path = entry.path(self.root)
        if path not in self._readers:
            # The manifest's own checks made `entry.file` a bare rank-file name; the step
            # directory must not be a link elsewhere, nor the file (O_NOFOLLOW).
            checked_step_dir(self.root, entry.step)
            self._readers[path] = TensorReader(path)
        return self._readers[path].read(key, entry.record)

    def state_names(self, prefix: str) -> list[str]:
        return _state_names(self.manifest.entries, prefix)


class DictReader:
    """The reader interface over tensors already in memory (a snapshot), or over lazy
    ones: a value with a `load()` method is read only when it is used."""

    def __init__(self, tensors: dict[str, Any]) -> None:
        self.tensors = tensors

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def get(self, key: str) -> torch.Tensor:
        if key not in self.tensors:
            raise CorruptCheckpointError(f"the snapshot has no key {key!r}")
        t = self.tensors[key]
        return t if isinstance(t, torch.Tensor) else t.load()

    def state_names(self, prefix: str) -> list[str]:
        return _state_names(self.tensors, prefix)


class LazyKey:
    """One key of a checkpoint on storage, read (and checked) only if it is used."""

    def __init__(self, reader: CheckpointReader, key: str) -> None:
        self.reader, self.key = reader, key

    def load(self) -> torch.Tensor:
        return self.reader.get(self.key)


def _state_names(keys: Iterable[str], prefix: str) -> list[str]:
    """Names of the optimizer state tensors stored under `prefix/`."""
    return sorted({k[len(prefix) + 1:] for k in keys
                   if k.startswith(prefix + "/") and "/" not in k[len(prefix) + 1:]})


@dataclass
class StorageRestore:
    """What `restore_from_storage` restored."""

    manifest: Manifest
    recovery_s: float
    skipped: list[str] = field(default_factory=list)
    """Newer steps found corrupt and skipped, with the reason."""
    skipped_steps: list[int] = field(default_factory=list)

    @property
    def step(self) -> int:
        return self.manifest.step


def warn_interrupted_commits(root: Path, repair: bool) -> None:
    """Rank 0, before listing steps: put back (`repair`) or name the `.replaced`
    directories that hold the only good copy of their step. A read-only reader cannot
    see such a step, so it says what would make it visible."""
    if repair:
        try:
            put_back_replaced(root)
            return
        except OSError as e:
            log.warning("could not finish an interrupted re-commit in %s (%s)", root,
                        e.strerror or e)
    for d in interrupted_commits(root):
        log.warning("%s holds the only good copy of its step (a re-commit interrupted by a "
                    "crash): this read-only restore cannot see it; a training job's restore "
                    "puts it back (or rename it to %s)", d, d.name.removesuffix(".replaced"))


def restore_from_storage(root: Path, state: RankState, dist: Dist, model_meta: dict[str, Any]
                         ) -> StorageRestore | None:
    """Load the newest step every rank can read intact; None when there is none.
    Raises CorruptCheckpointError when there are steps but every one is corrupt.

    The candidates are the complete steps as rank 0 lists them: every rank must try the
    same steps in the same order, even where a shared file system shows stale lists.
    """
    t0 = time.perf_counter()
    steps = dist.broadcast(list(reversed(complete_steps(root))))

    def attempt(step: int) -> Manifest:
        manifest = Manifest.load(root, step)
        manifest.check_model(model_meta, f"checkpoint {root}/step-{step:08d}")
        state.load(CheckpointReader(root, manifest))
        return manifest

    manifest, skipped = restore_loop(steps, attempt, dist,
                                     label=lambda step: f"checkpoint step {step}")
    reasons = [f"step {step}: {reason}" for step, reason in skipped]
    if manifest is None:
        if skipped:
            raise CorruptCheckpointError(
                f"{root}: no intact checkpoint; every step failed: {'; '.join(reasons)}")
        return None
    return StorageRestore(manifest, time.perf_counter() - t0, reasons,
                          [step for step, _ in skipped])


def resume_from_storage(root: Path, state: RankState, dist: Dist, model_meta: dict[str, Any],
                        chain: ChainState, ledger: TokenLedger, tidy: WriteTidy | None = None,
                        *, commits_checked: bool = False) -> RecoveryReport | None:
    """Restore the newest intact step on storage and continue its chain: the chain
    continues from the manifest restored, and the ledger accounts what the recovery lost
    (every expert came back from its newest persisted copy). Collective.

    Reading changes nothing in the directory (`tidy`, rank 0's, sets corrupt steps aside
    and removes `.tmp` directories at the next save) but for one repair, done only by an
    engine that writes (`tidy` given): a re-commit interrupted between its two renames
    leaves the step's only good copy as `step-N.replaced`, which is put back first
    (unless the caller did: `commits_checked`)."""
    if dist.rank == 0 and not commits_checked:
        warn_interrupted_commits(root, repair=tidy is not None)
    dist.barrier()
    result = restore_from_storage(root, state, dist, model_meta)
    if result is None:
        return None
    if tidy is not None:
        tidy.note_restore(dict(zip(result.skipped_steps, result.skipped, strict=True)))
    manifest = result.manifest
    chain.advance(manifest)
    ledger.load_json(manifest.tokens)
    stale = bool((chain.saved_at < manifest.step).any())  # experts older than the step
    plt = ledger.recover(ledger.at_save, manifest.policy, stale)
    ledger.all_saved()
    return RecoveryReport(result.step, manifest.extra, "storage", result.recovery_s,
                          plt.lost_tokens, plt.lost_per_layer, plt.plt, plt.k, plt.k_before,
                          result.skipped)
