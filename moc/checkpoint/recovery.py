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
from moc.checkpoint.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
)
from moc.checkpoint.lineage import Lineage
from moc.checkpoint.plan.chain import ChainState
from moc.checkpoint.policy.tokens import TokenLedger
from moc.checkpoint.shards import Box, piece_index
from moc.checkpoint.state import RankState
from moc.checkpoint.store.backend import ObjectPath, open_root
from moc.checkpoint.store.format import TensorReader
from moc.checkpoint.store.manifest import Manifest
from moc.checkpoint.store.steps import (
    MANIFEST,
    ROLLED_BACK_SUFFIX,
    SUPERSEDED,
    checked_step_dir,
    complete_steps,
    interrupted_commits,
    put_back_replaced,
    set_aside,
    step_dir,
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
        if dist.rank == 0:  # every rank agreed on the reason: one line, not one a rank
            log.warning("%s is not usable (%s); trying an older one", label(candidate),
                        reason)
        skipped.append((candidate, reason))
    return None, skipped


class CheckpointReader:
    """Reads keys of one manifest, verifying each against its checksum."""

    one_rank = False  # a manifest lists every rank's pieces

    def __init__(self, root: Path | ObjectPath, manifest: Manifest) -> None:
        self.root = open_root(root)
        self.manifest = manifest
        self._readers: dict[Path | ObjectPath, TensorReader] = {}
        self._pieces: dict[str, list[tuple[str, Box]]] | None = None

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

    def pieces(self, key: str) -> list[tuple[str, Box]]:
        if self._pieces is None:
            self._pieces = piece_index((k, e.shape) for k, e in self.manifest.entries.items())
        return self._pieces.get(key, [])


class DictReader:
    """The reader interface over tensors already in memory (a snapshot), or over lazy
    ones: a value with a `load()` method is read only when it is used.

    `one_rank`: the tensors are one rank's pieces (a snapshot in memory or its peer
    replica), not every rank's, as a state dict gathered by DCP is."""

    def __init__(self, tensors: dict[str, Any], one_rank: bool = False) -> None:
        self.tensors = tensors
        self.one_rank = one_rank
        self._pieces: dict[str, list[tuple[str, Box]]] | None = None

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def get(self, key: str) -> torch.Tensor:
        if key not in self.tensors:
            raise CorruptCheckpointError(f"the snapshot has no key {key!r}")
        t = self.tensors[key]
        return t if isinstance(t, torch.Tensor) else t.load()

    def state_names(self, prefix: str) -> list[str]:
        return _state_names(self.tensors, prefix)

    def pieces(self, key: str) -> list[tuple[str, Box]]:
        if self._pieces is None:
            self._pieces = piece_index((k, tuple(t.shape)) for k, t in self.tensors.items())
        return self._pieces.get(key, [])


class LazyKey:
    """One key of a checkpoint on storage, read (and checked) only if it is used."""

    def __init__(self, reader: CheckpointReader, key: str) -> None:
        self.reader, self.key = reader, key

    def load(self) -> torch.Tensor:
        return self.reader.get(self.key)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.reader.manifest.entries[self.key].shape


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


def restore_from_storage(root: Path, state: RankState, dist: Dist, model_meta: dict[str, Any],
                         run_id: str | None = None, step: int | None = None
                         ) -> StorageRestore | None:
    """Load the newest step every rank can read intact (`step`: that step alone); None
    when there is none. Raises CorruptCheckpointError when there are steps but every one
    is corrupt (or `step` is), ValueError when `step` is not a complete step.

    The candidates are the complete steps as rank 0 lists them: every rank must try the
    same steps in the same order, even where a shared file system shows stale lists. A
    step of another run than `run_id` (the directory's: a step copied in from another
    run's directory) is skipped as corrupt, and the next save sets it aside.
    """
    t0 = time.perf_counter()
    steps = dist.broadcast(list(reversed(complete_steps(root))))
    if step is not None:
        if step not in steps:
            raise ValueError(f"cannot restore step {step}: {root} holds no complete "
                             f"checkpoint of it (complete steps: {describe_steps(steps)})")
        steps = [step]

    def attempt(candidate: int) -> Manifest:
        manifest = Manifest.load(root, candidate)
        source = f"checkpoint {root}/step-{candidate:08d}"
        manifest.check_model(model_meta, source)
        check_run(manifest, run_id, source)
        state.load(CheckpointReader(root, manifest))
        return manifest

    manifest, skipped = restore_loop(steps, attempt, dist,
                                     label=lambda s: f"checkpoint step {s}")
    reasons = [f"step {s}: {reason}" for s, reason in skipped]
    if manifest is None:
        if skipped:
            raise CorruptCheckpointError(
                f"{root}: no intact checkpoint; every step failed: {'; '.join(reasons)}")
        return None
    return StorageRestore(manifest, time.perf_counter() - t0, reasons,
                          [s for s, _ in skipped])


def check_run(manifest: Manifest, run_id: str | None, source: str) -> None:
    """CorruptCheckpointError for a step of another run than `run_id` (None: the
    directory names none; a manifest written before version 5 names none either)."""
    if run_id is not None and manifest.run_id is not None and manifest.run_id != run_id:
        raise CorruptCheckpointError(
            f"{source} belongs to run {manifest.run_id!r}, this directory to run "
            f"{run_id!r} (moc-run.json): a step copied in from another run's directory is "
            "never restored; restore it from its own directory")


def line_problems(root: Path | ObjectPath, manifest: Manifest, run_id: str | None,
                  known: dict[int, Manifest] | None = None) -> list[str]:
    """Why `manifest`'s step is not one line of this directory's run, if it is not: a
    step of another run (`check_run`), or one that reads files of older steps that are
    not its ancestors (another job resumed the directory along another line: restoring
    it would mix two models). Manifests written before lineages were recorded (version
    4 and older) have nothing to check. `known`: manifests already read, by step."""
    try:
        check_run(manifest, run_id, f"step {manifest.step}")
    except CorruptCheckpointError as e:
        return [str(e)]
    line, problems = manifest.lineage, []
    if not line.segments:
        return []
    for older in sorted({e.step for e in manifest.entries.values()} - {manifest.step}):
        held = (known or {}).get(older) or _any_manifest(root, older)
        if held is None or not held.lineage.segments:
            continue  # cannot be told; its files' checksums are still checked
        if not line.descends_from(manifest.step, held.lineage, older):
            problems.append(f"step {manifest.step} reads files of step {older}, which "
                            "belongs to another line of training (another job resumed "
                            "this directory): restoring it would mix two models")
    return problems


def _any_manifest(root: Path | ObjectPath, step: int) -> Manifest | None:
    """`step`'s manifest, or the one retention kept beside a step it keeps as data only
    (SUPERSEDED), read for its lineage; None when there is none or it does not parse."""
    for name in (MANIFEST, SUPERSEDED):
        path = step_dir(root, step) / name
        try:
            return Manifest.decode(path.read_bytes(), path, step)
        except (OSError, CheckpointError):
            continue
    return None


def describe_steps(steps: list[int]) -> str:
    """A list of steps for a message: all of them when few, else the ends."""
    ordered = sorted(steps)
    if not ordered:
        return "none"
    if len(ordered) <= 8:
        return ", ".join(map(str, ordered))
    return f"{', '.join(map(str, ordered[:3]))}, ..., {', '.join(map(str, ordered[-3:]))}"


def roll_back(root: Path, step: int, dist: Dist, tidy: WriteTidy | None) -> list[int]:
    """After `step` was restored on request (`restore(step=...)`): rank 0 of a writing
    engine (`tidy` given) sets every complete step newer than it aside, newest first,
    so that the line continues from `step` and no save replaces a step that newer ones
    read (each moment of it leaves a directory whose newest steps are a consistent
    line). The steps set aside, on every rank; CheckpointError on every rank when rank 0
    could not (saving would then damage them). A reader sets nothing aside. Collective."""
    done, error = [], None
    if dist.rank == 0 and tidy is not None:
        try:
            for newer in sorted((s for s in complete_steps(root) if s > step), reverse=True):
                set_aside(root, newer, f"rolled back: a run restored step {step} and "
                          "continues from there", suffix=ROLLED_BACK_SUFFIX)
                done.append(newer)
        except OSError as e:
            error = (f"rolled back to step {step}, but could not set the newer steps of "
                     f"{root} aside ({e}); saving from step {step} would replace steps "
                     "they depend on: make the directory writable and restore again")
    done, error = dist.broadcast((done, error))
    if error is not None:
        raise CheckpointError(error)
    if done:
        log.warning("rolled back to step %d: set aside steps %s as step-N%s", step,
                    describe_steps(done), ROLLED_BACK_SUFFIX)
    return done


def resume_from_storage(root: Path, state: RankState, dist: Dist, model_meta: dict[str, Any],
                        chain: ChainState, ledger: TokenLedger, tidy: WriteTidy | None = None,
                        *, restored: Callable[[int | None, Lineage], None] | None = None,
                        run_id: str | None = None,
                        step: int | None = None, commits_checked: bool = False
                        ) -> RecoveryReport | None:
    """Restore the newest intact step on storage (`step`: that one, rolling back to it:
    `roll_back`) and continue its chain: the chain continues from the manifest restored,
    the line (`restored`, `EngineParts.restored`) from its lineage, and the ledger
    accounts what the recovery lost
    (every expert came back from its newest persisted copy). Collective.

    Reading changes nothing in the directory (`tidy`, rank 0's, sets corrupt steps aside
    and removes `.tmp` directories at the next save) but for one repair, done only by an
    engine that writes (`tidy` given): a re-commit interrupted between its two renames
    leaves the step's only good copy as `step-N.replaced`, which is put back first
    (unless the caller did: `commits_checked`)."""
    if dist.rank == 0 and not commits_checked:
        warn_interrupted_commits(root, repair=tidy is not None)
    dist.barrier()
    result = restore_from_storage(root, state, dist, model_meta, run_id, step)
    if result is None:
        if restored is not None:
            restored(None, Lineage.unknown())
        return None
    if step is not None:
        roll_back(root, step, dist, tidy)
    if restored is not None:
        restored(result.step, result.manifest.lineage)
    if tidy is not None:
        tidy.note_restore(dict(zip(result.skipped_steps, result.skipped, strict=True)))
    manifest = result.manifest
    chain.advance(manifest)
    ledger.load_json(manifest.tokens)
    stale = bool((chain.saved_at < manifest.step).any())  # experts older than the step
    plt = ledger.recover(ledger.at_save, manifest.policy, stale, warn=dist.rank == 0)
    ledger.all_saved()
    return RecoveryReport(result.step, manifest.extra, "storage", result.recovery_s,
                          plt.lost_tokens, plt.lost_per_layer, plt.plt, plt.k, plt.k_before,
                          result.skipped, sources={"storage": list(range(dist.world_size))})
