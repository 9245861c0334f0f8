"""Which old checkpoint steps may be deleted, and deleting them off the training path.

With partial checkpoints a step's manifest points at keys stored in older step
directories (an expert not saved lately still lives where it was last written), so
"keep the newest N directories" would silently break the newest checkpoints. Following
the references transitively does not work either: every manifest references the few
steps before it, so each step would keep its predecessors alive and nothing would ever
be deleted. Retention therefore separates two roles a step directory can play:

    restorable  the newest `keep_last` complete steps: they keep their manifest.json and
                recovery may load them
    data        every step a restorable manifest references: its tensor files stay,
                because a restorable manifest reads them by path (step-N/<file>)

A step that is data but not restorable is *demoted*: its manifest.json is renamed to
manifest.superseded.json, so it stops being a complete step (steps.complete_steps,
recovery and the tools never read it as a checkpoint) and its own references stop
counting, which is what lets older steps go. Every other `step-N` directory, complete
or demoted, is deleted.

    plan_retention     what to keep, demote and delete: a pure function of the references
    apply_retention    lists the steps, reads their manifests, plans, then demotes and
                       deletes (oldest first, crash-safe)
    BackgroundRetention  runs apply_retention on a thread so saves never wait for it

Demotion comes before any deletion and is one atomic rename, so at every instant each
complete step is restorable: a crash can leave a step demoted whose references are still
on disk, never a complete step whose data is gone. Deleting a step is two operations:
rename `step-N` to `step-N.deleting` (atomic; the step is gone for readers, which only
match `step-NNNNNNNN`), then remove the files. A crash in between leaves a `.deleting`
directory, which the next `apply_retention` removes.

In an object store the same plan is applied with the operations a store has: demoting
copies manifest.json to SUPERSEDED and then deletes manifest.json (a crash in between
leaves both: still a complete step, demoted again next time); deleting a step deletes
its manifest.json first (the step is then no longer complete) and then its objects. A
prefix a crash left with neither file is abandoned, and `steps.remove_abandoned`
deletes it at the next restore; retention leaves it alone, as it may be a save in
progress.
"""

from __future__ import annotations

import logging
import re
import shutil
import threading
from collections.abc import Mapping, Set
from dataclasses import dataclass
from pathlib import Path

from moc.checkpoint.errors import CheckpointError
from moc.checkpoint.store.backend import ObjectPath, open_root
from moc.checkpoint.store.manifest import Manifest
from moc.checkpoint.store.steps import (
    MANIFEST,
    STEP_RE,
    SUPERSEDED,
    fsync_dir,
    object_steps,
    step_dir,
)

log = logging.getLogger(__name__)

# SUPERSEDED (steps.py): what a demoted step's manifest.json is renamed to; kept for
# inspection (it says what the step once was), never read as a checkpoint.
DELETING_SUFFIX = ".deleting"
_DELETING_RE = re.compile(r"^step-\d{8}\.deleting$")


def referenced_steps(manifest: Manifest) -> set[int]:
    """The step directories `manifest` needs: its own and those of its older entries.

    The manifest's own step is always included, even when every entry lives elsewhere,
    because the manifest itself is stored there.
    """
    return {entry.step for entry in manifest.entries.values()} | {manifest.step}


@dataclass(frozen=True)
class RetentionPlan:
    """The outcome of `plan_retention`; every step directory is in exactly one of keep
    and delete, and the steps to demote are among those kept."""

    keep: tuple[int, ...]
    """Steps whose directory stays (restorable or data), oldest first."""
    delete: tuple[int, ...]
    """Steps to delete, oldest first: the order `apply_retention` deletes them in."""
    demote: tuple[int, ...] = ()
    """Complete steps to keep as data only (manifest.json renamed to SUPERSEDED), oldest
    first: a restorable manifest reads their files, but they are not restorable
    themselves."""
    missing: tuple[int, ...] = ()
    """Steps a restorable manifest references that have no step directory: those
    checkpoints are already broken (recovery will skip them); retention cannot repair
    them."""


def _check_keep_last(keep_last: int) -> None:
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (the newest step is always kept), "
                         f"got {keep_last}")


def plan_retention(manifests: Mapping[int, Set[int] | None], keep_last: int,
                   data_only: Set[int] = frozenset()) -> RetentionPlan:
    """Keep the newest `keep_last` steps restorable and only the data their manifests read.

    `manifests` maps each complete step to the steps its manifest references (see
    `referenced_steps`), or to None when the manifest could not be read; `data_only`
    holds the steps demoted by an earlier run (a directory without manifest.json). The
    newest `keep_last` complete steps are restorable; every step their manifests
    reference is data. Data that is a complete step but not restorable is demoted, and
    its own references are not followed: the restorable manifests name every file they
    read, so an older step's needs matter only while that step is restorable. Following
    them would keep every step forever (each partial manifest references its
    predecessors). Everything neither restorable nor data is deleted.

    An unreadable restorable manifest's references are unknown, so it is taken to
    reference every step up to and including itself. Entries only ever point at the
    step being written or older ones (a save can reference only copies that already
    exist), so this covers whatever the manifest names should it become readable again
    (a transient I/O error). Those steps are also left as they are rather than demoted:
    if the manifest is really corrupt, recovery falls back to the older complete steps,
    so demoting them would leave no checkpoint at all. The price is that nothing at or
    below the unreadable step is demoted or deleted until it leaves the restorable set;
    an unreadable step that is not restorable is demoted or deleted like any other.
    """
    _check_keep_last(keep_last)
    complete = sorted(manifests)
    existing = set(complete) | set(data_only)
    restorable = set(complete[-keep_last:])
    unreadable = [s for s in restorable if manifests[s] is None]
    # Left exactly as they are: what an unreadable restorable manifest may need, and the
    # complete steps recovery falls back to should it be corrupt.
    frozen = {s for s in existing if s <= max(unreadable)} if unreadable else set()
    referenced: set[int] = set()
    for step in restorable:
        referenced |= manifests[step] or set()
    data = (referenced & existing) | frozen
    keep = restorable | data
    return RetentionPlan(
        keep=tuple(sorted(keep)),
        delete=tuple(sorted(existing - keep)),
        demote=tuple(s for s in complete if s in data and s not in restorable | frozen),
        missing=tuple(sorted(referenced - existing)))


@dataclass(frozen=True)
class _Listing:
    """The step directories under a root at one moment, by what they hold."""

    complete: list[int]
    """With manifest.json: checkpoints (what steps.complete_steps lists)."""
    data_only: list[int]
    """With SUPERSEDED and no manifest.json: demoted by an earlier run."""
    unknown: list[int]
    """With neither: not written by moc's commit or retention; never touched."""


def _list_steps(root: Path | ObjectPath) -> _Listing:
    if isinstance(root, ObjectPath):
        listed = object_steps(root)
        return _Listing(sorted(s for s, n in listed.items() if MANIFEST in n),
                        sorted(s for s, n in listed.items()
                               if SUPERSEDED in n and MANIFEST not in n),
                        sorted(s for s, n in listed.items()
                               if SUPERSEDED not in n and MANIFEST not in n))
    # One pass over the directory, so each step is classified from one observation; a
    # step committed after this pass is not in the listing and is never touched.
    complete, data_only, unknown = [], [], []
    for d in root.iterdir():
        m = STEP_RE.match(d.name)
        if not (m and d.is_dir()):
            continue
        step = int(m.group(1))
        if (d / MANIFEST).is_file():
            complete.append(step)
        elif (d / SUPERSEDED).is_file():
            data_only.append(step)
        else:
            unknown.append(step)
    return _Listing(sorted(complete), sorted(data_only), sorted(unknown))


def _demote_step(root: Path | ObjectPath, step: int) -> None:
    d = step_dir(root, step)
    if isinstance(d, ObjectPath):
        (d / MANIFEST).copy_to(d / SUPERSEDED)
        (d / MANIFEST).unlink()  # confirmed gone before any step it referenced is deleted
        return
    # replace(), not rename(): a stale SUPERSEDED left by hand must not block the demotion.
    (d / MANIFEST).replace(d / SUPERSEDED)
    fsync_dir(d)  # durably not a checkpoint before any step it referenced is deleted


def _delete_step(root: Path | ObjectPath, step: int) -> None:
    src = step_dir(root, step)
    if isinstance(src, ObjectPath):
        (src / MANIFEST).unlink(missing_ok=True)  # not a complete step from here on
        src.remove_tree()
        return
    dst = root / f"{src.name}{DELETING_SUFFIX}"
    if dst.exists():  # left by an earlier crash; rename() will not replace a directory
        shutil.rmtree(dst)
    src.rename(dst)
    fsync_dir(root)  # the step is durably gone before any of its files is
    shutil.rmtree(dst)


def _remove_leftovers(root: Path) -> None:
    """Finish deletions a crash interrupted."""
    for d in sorted(root.iterdir()):
        if d.is_dir() and _DELETING_RE.match(d.name):
            shutil.rmtree(d)


def apply_retention(root: Path, keep_last: int) -> list[int]:
    """Demote and delete the steps under `root` as `plan_retention` says; return the
    deleted steps.

    A step whose manifest cannot be read (corrupt, unreadable, or written by another
    format version) is planned with unknown references (see `plan_retention`); it is
    never a reason to delete anything. A `step-N` directory with neither manifest.json
    nor SUPERSEDED is in a state this code did not create; it is left alone and logged.
    `.tmp`, `.replaced` and `.corrupt` directories belong to steps.py and are never
    touched. Steps are demoted first (each one rename and an fsync), then deleted oldest
    first, each renamed to `step-N.deleting` before its files are removed, so a crash
    leaves no complete step missing data and no partially deleted step visible;
    `.deleting` directories left by an earlier crash are removed before anything else.

    Run it on one process only (the coordinator, rank 0): it is not collective, and two
    processes deleting the same directories would race. It runs on a background thread
    while training saves new steps, which is safe because a save in progress builds on
    the newest committed manifest: its references are a subset of that manifest's
    references plus its own step (still a `.tmp` directory, which this never touches).
    The newest committed manifest is always restorable, so nothing a save in progress
    needs is demoted or deleted; steps committed after the directory listing are not in
    the listing, so they are not touched either. (A step number is committed again only
    by a run restarted from an older step, in a new process with its own retention.)
    """
    _check_keep_last(keep_last)
    root = open_root(root)
    if not root.is_dir():
        return []
    if not isinstance(root, ObjectPath):  # no `.deleting` prefixes in an object store
        _remove_leftovers(root)
    listing = _list_steps(root)
    if listing.unknown and not isinstance(root, ObjectPath):
        log.warning("%s: step directories with neither %s nor %s are left alone (not "
                    "written by moc's commit or retention; inspect and remove them by "
                    "hand): %s", root, MANIFEST, SUPERSEDED,
                    ", ".join(map(str, listing.unknown)))
    manifests: dict[int, set[int] | None] = {}
    for step in listing.complete:
        try:
            manifests[step] = referenced_steps(Manifest.load(root, step))
        except CheckpointError as e:
            log.warning("cannot read the manifest of step %d (%s); keeping every older step "
                        "as it is while it is restorable", step, e)
            manifests[step] = None
    plan = plan_retention(manifests, keep_last, set(listing.data_only))
    if plan.missing:
        log.warning("%s: restorable checkpoints reference steps that are missing or in an "
                    "unknown state: %s", root, ", ".join(map(str, plan.missing)))
    for step in plan.demote:
        _demote_step(root, step)
    if plan.demote:
        log.info("%s: steps %s demoted to data only (%s)", root,
                 ", ".join(map(str, plan.demote)), SUPERSEDED)
    deleted = []
    for step in plan.delete:
        _delete_step(root, step)
        deleted.append(step)
    return deleted


class BackgroundRetention:
    """Runs `apply_retention` on a thread, so a save never waits for deletions.

    One deletion runs at a time; requests made while it runs are coalesced into one
    more run after it, which sees every step committed meanwhile. An error in the
    background is kept and raised once on the caller's thread, by the next `request()`
    or by `close()`, as a CheckpointError naming the directory; the request that raises
    it starts nothing, the one after retries.

    Only the coordinator (rank 0) creates one: deletion is not collective, and the
    other ranks must not touch the step directories.
    """

    def __init__(self, root: str | Path, keep_last: int) -> None:
        _check_keep_last(keep_last)
        self.root = open_root(root)
        self.keep_last = keep_last
        self.deleted: list[int] = []
        """Every step deleted so far, in order (for logs and tests)."""
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pending = False
        self._error: Exception | None = None

    def request(self) -> None:
        """Ask for old steps to be deleted; returns at once."""
        with self._lock:
            error, self._error = self._error, None
            if error is None:
                if self._thread is not None:
                    self._pending = True
                else:
                    # Not a daemon: interpreter exit waits for a deletion to finish
                    # rather than leave a `.deleting` directory behind.
                    self._thread = threading.Thread(target=self._run, name="moc-retention")
                    self._thread.start()
        if error is not None:
            self._raise(error)

    def wait(self) -> None:
        """Block until no deletion is running or pending. Raises nothing."""
        while True:
            with self._lock:
                thread = self._thread
            if thread is None:
                return
            thread.join()

    def close(self) -> None:
        """Wait for the running deletion; raise its error if it failed unreported."""
        self.wait()
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            self._raise(error)

    def _raise(self, error: Exception) -> None:
        raise CheckpointError(f"deleting old checkpoints in {self.root} failed: {error}; "
                              "the checkpoints themselves are intact, only disk space is "
                              "not reclaimed") from error

    def _run(self) -> None:
        while True:
            try:
                deleted = apply_retention(self.root, self.keep_last)
            except Exception as e:  # reported on the caller's thread, never lost
                with self._lock:
                    self._error = e
                    self._pending = False
                    self._thread = None
                return
            with self._lock:
                self.deleted.extend(deleted)
                if not self._pending:
                    self._thread = None
                    return
                self._pending = False
