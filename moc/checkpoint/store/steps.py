"""Where a step's files land and how a step becomes complete: fsync, atomic commit.

Layout under a checkpoint root:

    step-00000120/              complete: manifest.json exists (written last)
        rank-00003.safetensors
        manifest.json
    step-00000130.tmp/          being written or abandoned: never read

A step is committed by writing every file into `step-N.tmp/`, fsyncing them, writing
and fsyncing the manifest, then renaming the directory (atomic on POSIX) and fsyncing
the root. A crash at any point leaves either the complete step or a `.tmp` directory.

In an object store (`store.backend.ObjectPath`: no rename, no fsync) the objects are
written straight into `step-N/`, each confirmed by the size the store reports, and
the step is committed by writing its manifest last, after every object the manifest
names is confirmed in one listing. A prefix without a manifest is never read, and is
deleted by the writer (`begin_step` for its own step, `remove_abandoned` at its first save).
Re-committing step N deletes N's manifest before any object of N changes
(docs/DECISIONS.md, "Issue 13: object storage").

The bytes inside a file are `moc.checkpoint.store.format`'s; who writes which file is the
plan's; this module only names directories and moves them.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moc.checkpoint.errors import CorruptCheckpointError
from moc.checkpoint.store.backend import ObjectPath, open_root

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
STEP_RE = re.compile(r"^step-(\d{8})$")
"""A step directory proper; `.tmp`, `.replaced`, `.corrupt` and `.deleting` are not."""
RANK_FILE_RE = re.compile(r"^rank-\d{5,}\.safetensors$")
"""The only tensor file names a manifest may hold (`rank_file`): a bare name, so an
entry cannot point outside its step directory (no `/`, no `..`, not absolute)."""
RANK_FILE_PATTERN = "rank-NNNNN.safetensors"
"""RANK_FILE_RE as error messages name it."""
FAULT_BEFORE_MANIFEST_ENV = "MOC_FAULT_BEFORE_MANIFEST"
"""Fault injection for tests and drills: the process committing this step number to an
object store SIGKILLs itself after every object is confirmed and before the manifest is
written (the crash the commit protocol must survive)."""
SUPERSEDED = "manifest.superseded.json"
"""What retention renames a demoted step's manifest.json to (`store.retention`)."""
CORRUPT_SUFFIX = ".corrupt"
"""`step-N.corrupt`: where `set_aside` moves a step that failed verification."""
CORRUPT_NOTE = "CORRUPT.txt"
"""In a step set aside as corrupt: why."""
ROLLED_BACK_SUFFIX = ".rolledback"
"""`step-N.rolledback[-k]`: where a rollback (`restore(step=S)`) moves each step newer
than S. Never overwritten (k counts earlier rollbacks past the same step): what a
rollback set aside is the user's to inspect or delete."""
NOTES = {CORRUPT_SUFFIX: CORRUPT_NOTE, ROLLED_BACK_SUFFIX: "ROLLED_BACK.txt"}


def step_dir(root: Path | ObjectPath, step: int) -> Path | ObjectPath:
    return open_root(root) / f"step-{step:08d}"


def tmp_dir(root: Path | ObjectPath, step: int) -> Path | ObjectPath:
    """Where a step's files are written before the commit: `step-N.tmp/`, or in an
    object store (no rename) `step-N/` itself, which has no manifest until the commit."""
    root = open_root(root)
    if isinstance(root, ObjectPath):
        return step_dir(root, step)
    return root / f"step-{step:08d}.tmp"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def is_rank_file(name: object) -> bool:
    return isinstance(name, str) and RANK_FILE_RE.match(name) is not None


def checked_step_dir(root: Path | ObjectPath, step: int) -> Path | ObjectPath:
    """`step_dir(root, step)`, which must be a real directory inside `root`: a symbolic
    link would make the step's files (and its manifest) those of another directory,
    read with this checkpoint's trust. Raises CorruptCheckpointError otherwise."""
    path = step_dir(root, step)
    if isinstance(path, ObjectPath):
        return path  # no links in an object store; a missing object fails its read
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path}: step directory is missing") from None
    except OSError as e:
        raise CorruptCheckpointError(f"{path}: cannot read ({e.strerror})") from None
    if stat.S_ISLNK(st.st_mode):
        raise CorruptCheckpointError(
            f"{path}: is a symbolic link (to {os.readlink(path)}); a step must be a real "
            "directory inside the checkpoint directory: copy the step in, or remove it")
    if not stat.S_ISDIR(st.st_mode):
        raise CorruptCheckpointError(f"{path}: expected a step directory, found a file")
    return path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def begin_step(root: Path | ObjectPath, step: int) -> Path | ObjectPath:
    """Create an empty `step-N.tmp/` (discarding an abandoned one) and return it."""
    root = open_root(root)
    if isinstance(root, ObjectPath):
        return _begin_object_step(root, step)
    root.mkdir(parents=True, exist_ok=True)
    tmp = tmp_dir(root, step)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def commit_step(root: Path | ObjectPath, step: int, manifest_json: str
                ) -> Path | ObjectPath:
    """Write the manifest into `step-N.tmp/` and atomically publish the step.

    Never overwrites the only good copy: a complete step of the same number (a step
    re-done after recovering from an older one) is moved aside first and deleted only
    after the new one is in place.
    """
    root = open_root(root)
    if isinstance(root, ObjectPath):
        return _commit_object_step(root, step, manifest_json)
    tmp, final = tmp_dir(root, step), step_dir(root, step)
    path = tmp / MANIFEST
    with open(path, "w") as f:
        f.write(manifest_json)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)
    old = None
    if final.exists():
        old = root / f"{final.name}.replaced"
        if old.exists():
            shutil.rmtree(old)
        final.rename(old)
    tmp.rename(final)
    fsync_dir(root)
    if old is not None:
        shutil.rmtree(old)
    return final


def complete_steps(root: Path | ObjectPath) -> list[int]:
    """Steps with a manifest, oldest first. Directories without one are never read."""
    root = open_root(root)
    if isinstance(root, ObjectPath):
        return sorted(s for s, names in object_steps(root).items() if MANIFEST in names)
    if not root.is_dir():
        return []
    steps = []
    for d in root.iterdir():
        m = STEP_RE.match(d.name)
        if m and (d / MANIFEST).is_file():
            steps.append(int(m.group(1)))
    return sorted(steps)


def remove_abandoned(root: Path | ObjectPath) -> list[Path] | list[ObjectPath]:
    """Delete `.tmp` directories left by an interrupted save (the write path: a writing
    engine's first save; on an object store, the objects of a step without a manifest).

    A `.replaced` directory is the previous copy of a step that was being re-committed;
    if the crash came before the new copy took its name, it is the only good copy and is
    put back instead of deleted (`put_back_replaced`).
    """
    root = open_root(root)
    if isinstance(root, ObjectPath):
        return _remove_abandoned_objects(root)
    if not root.is_dir():
        return []
    put_back_replaced(root)
    removed = []
    for d in sorted(root.iterdir()):
        if not (d.is_dir() and d.name.startswith("step-")):
            continue
        if d.is_symlink() and d.name.endswith((".tmp", ".replaced")):
            # Never written by moc: only the link goes, never what it points at (and a
            # linked `.replaced` is not put back as a step).
            d.unlink()
            removed.append(d)
            continue
        if not d.name.endswith((".tmp", ".replaced")):
            continue
        shutil.rmtree(d)
        removed.append(d)
    return removed


def interrupted_commits(root: Path | ObjectPath) -> list[Path]:
    """`.replaced` directories that are the only good copy of their step: a crash fell
    between commit_step's two renames, so `step-N` has no manifest. Reads only. None on
    an object store, whose commit renames nothing (the manifest is the commit)."""
    root = open_root(root)
    if isinstance(root, ObjectPath) or not root.is_dir():
        return []
    return [d for d in sorted(root.iterdir())
            if d.name.startswith("step-") and d.name.endswith(".replaced")
            and d.is_dir() and not d.is_symlink()
            and not (root / d.name.removesuffix(".replaced") / MANIFEST).is_file()]


def put_back_replaced(root: Path | ObjectPath) -> list[Path]:
    """Finish the re-commits a crash interrupted: each `interrupted_commits` directory
    takes its step's name back (the only rename a restore of a writing engine makes:
    without it the step's newest good copy is invisible). Returns the steps put back."""
    out = []
    for d in interrupted_commits(root):
        final = d.parent / d.name.removesuffix(".replaced")
        if final.exists():
            shutil.rmtree(final)
        d.rename(final)
        out.append(final)
    return out


def set_aside(root: Path | ObjectPath, step: int, reason: str,
              suffix: str = CORRUPT_SUFFIX) -> Path | ObjectPath:
    """Move a complete step that failed verification to `step-N.corrupt` (`suffix`
    ROLLED_BACK_SUFFIX: one a rollback left behind, to a fresh `step-N.rolledback[-k]`).

    Kept for inspection rather than deleted, and out of the way: it is never read again,
    retention does not count it among the newest steps (where it would crowd out the
    intact step a run continued from), and the step number can be committed anew by the
    run that continues from an older step.

    A step that is a symbolic link is set aside as the link: the reason is logged, not
    written into the directory it points to. In an object store, which cannot rename,
    the step's objects are copied server-side and then deleted, manifest first
    (`_set_aside_objects`). Raises OSError when the root cannot be written (a read-only
    file system, a store refusing writes): the caller decides whether that matters.
    """
    src = step_dir(root, step)
    if isinstance(src, ObjectPath):
        return _set_aside_objects(src, reason, suffix)
    dst = _aside_name(src, suffix, lambda d: d.is_symlink() or d.exists())
    if dst.is_symlink() or dst.is_file():
        dst.unlink()
    elif dst.exists():
        shutil.rmtree(dst)
    link = src.is_symlink()
    src.rename(dst)
    if link:
        log.warning("%s was a symbolic link, renamed to %s: %s", src, dst.name, reason)
    else:
        (dst / NOTES[suffix]).write_text(reason + "\n")
    fsync_dir(Path(root))
    return dst


def _aside_name(src: Path | ObjectPath, suffix: str, taken: Callable[[Any], bool]) -> Any:
    """Where `src` is set aside: `step-N.corrupt` (an older corrupt copy is replaced), or
    the first free `step-N.rolledback[-k]` (nothing rolled back is ever replaced)."""
    dst = src.parent / f"{src.name}{suffix}"
    k = 1
    while suffix == ROLLED_BACK_SUFFIX and taken(dst):
        dst = src.parent / f"{src.name}{suffix}-{k}"
        k += 1
    return dst


def _set_aside_objects(src: ObjectPath, reason: str, suffix: str) -> ObjectPath:
    """The object-store set-aside: copy every object of `src` (the manifest among them)
    to `step-N.corrupt/` with CORRUPT.txt, then delete the manifest of `src` (from here
    on the step is not complete) and the rest. A crash before the manifest goes leaves
    the step complete and corrupt, found and set aside again by the next run; one after
    leaves `src` without a manifest, which `remove_abandoned` deletes."""
    dst = _aside_name(src, suffix, lambda d: d.is_dir())
    dst.remove_tree()  # an earlier set-aside copy of this step number, or a partial one
    for name in sorted(src.listing()):
        (src / name).copy_to(dst / name)
    (dst / NOTES[suffix]).write_confirmed((reason + "\n").encode())
    (src / MANIFEST).unlink(missing_ok=True)
    src.remove_tree()
    return dst


# -- object stores ------------------------------------------------------------------------


def object_steps(root: ObjectPath) -> dict[int, dict[str, int]]:
    """Every `step-N/` prefix under `root`, from one listing: step -> {name: size} of
    the objects directly in it (a key that is not `step-NNNNNNNN/name` is ignored)."""
    out: dict[int, dict[str, int]] = {}
    for key, size in root.listing().items():
        head, _, name = key.partition("/")
        m = STEP_RE.match(head)
        if m and name and "/" not in name:
            out.setdefault(int(m.group(1)), {})[name] = size
    return out


def _begin_object_step(root: ObjectPath, step: int) -> ObjectPath:
    d = step_dir(root, step)
    # The manifest first: from here on the step is not complete, so no reader takes the
    # objects about to be replaced for the old step's.
    (d / MANIFEST).unlink(missing_ok=True)
    d.remove_tree()
    return d


def _commit_object_step(root: ObjectPath, step: int, manifest_json: str) -> ObjectPath:
    """Confirm every object the manifest names in this step, then write it, last."""
    d = step_dir(root, step)
    manifest = json.loads(manifest_json)
    found = object_steps(root).get(step, {})
    needed = dict(manifest.get("files", {}))
    for entry in manifest.get("entries", {}).values():
        if entry["step"] == step:
            needed.setdefault(entry["file"], None)
    for name, size in sorted(needed.items()):
        if name not in found:
            raise OSError(f"{d / name}: not in the store, but the manifest of step {step} "
                          "needs it; the step is left uncommitted")
        if size is not None and found[name] != size:
            raise OSError(f"{d / name}: the store holds {found[name]} bytes, {size} were "
                          f"written; the step is left uncommitted")
    if os.environ.get(FAULT_BEFORE_MANIFEST_ENV) == str(step):
        os.kill(os.getpid(), signal.SIGKILL)
    (d / MANIFEST).write_confirmed(manifest_json.encode())
    return d


def _remove_abandoned_objects(root: ObjectPath) -> list[ObjectPath]:
    """Delete the step prefixes with neither a manifest nor a superseded one: objects of
    a save that never committed (or of a deletion a crash interrupted)."""
    removed = []
    for step, names in sorted(object_steps(root).items()):
        if MANIFEST not in names and SUPERSEDED not in names:
            d = step_dir(root, step)
            d.remove_tree()
            removed.append(d)
    return removed
