"""`Storage`: a checkpoint directory behind one interface, a local directory or a prefix in
an object store.

    storage = open_storage("ckpt/")               # LocalStorage
    storage = open_storage("s3://bucket/run")     # ObjectStorage
    d = storage.begin(step)                        # an empty step being written
    storage.write_file(d, name, data)              # whole or absent
    storage.write_record(step, name, {...})        # a small JSON record of a commit
    storage.commit(step, manifest_json)            # the step appears, atomically
    storage.steps()                                # complete steps, oldest first
    storage.set_aside(step, reason)                # step-N.corrupt, kept for inspection
    storage.remove(step)

The directory string is normalised once, by `open_storage`, where an engine, a tool or
the persist process is built; everything after holds a `Storage`. What differs between a
file system and an object store (a rename, an fsync, a conditional put, a listing) is
inside the two implementations and the store layer below them: no code above the store
asks which kind it holds.

`root` is the `Path` or `ObjectPath` the store layer's functions take (tensor files,
manifests, retention, the lock): they keep their local code as it was and their object
store variant beside it (`store.backend`).
"""

from __future__ import annotations

import json
import os
import shutil
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from moc.checkpoint.store.backend import ObjectPath, open_root
from moc.checkpoint.store.steps import (
    CORRUPT_SUFFIX,
    begin_step,
    commit_step,
    complete_steps,
    fsync_dir,
    set_aside,
    step_dir,
    tmp_dir,
)


class Storage(ABC):
    """A checkpoint directory (see the module docstring)."""

    root: Path | ObjectPath

    def __str__(self) -> str:
        return str(self.root)

    # -- what it is -------------------------------------------------------------------------

    @property
    @abstractmethod
    def local(self) -> Path | None:
        """The local directory (absolute); None for an object store."""

    @property
    def shared_across_processes(self) -> bool:
        """Whether another process (a persist process) sees what this one writes."""
        return True

    @property
    @abstractmethod
    def name(self) -> str:
        """What the directory is called wherever it is named: the URL of an object store,
        the absolute path of a local directory."""

    def beside(self, step: int) -> list[str]:
        """What lies under `step`'s name but is not the complete step (`step-N.corrupt`,
        `.rolledback`, `.tmp`): named when a user asks for a step that is not there."""
        return []

    @abstractmethod
    def absent(self) -> str:
        """How a directory with no checkpoint in it is described ("is not a directory")."""

    def exists(self) -> bool:
        return self.root.exists()

    # -- steps ------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Complete steps (with a manifest), oldest first."""
        return complete_steps(self.root)

    def step_dir(self, step: int) -> Path | ObjectPath:
        return step_dir(self.root, step)

    def tmp_dir(self, step: int) -> Path | ObjectPath:
        """Where `step` is written before its commit."""
        return tmp_dir(self.root, step)

    def begin(self, step: int) -> Path | ObjectPath:
        """An empty `step` being written (an abandoned attempt at it discarded)."""
        return begin_step(self.root, step)

    def commit(self, step: int, manifest_json: str) -> Path | ObjectPath:
        """Publish `step` with its manifest, atomically: it is complete, or absent."""
        return commit_step(self.root, step, manifest_json)

    def set_aside(self, step: int, reason: str, suffix: str = CORRUPT_SUFFIX
                  ) -> Path | ObjectPath:
        """Move a complete step out of the way, kept for inspection (`store.steps`)."""
        return set_aside(self.root, step, reason, suffix)

    @abstractmethod
    def remove(self, step: int) -> None:
        """Delete `step` (committed or not) and everything in it."""

    # -- files and records ------------------------------------------------------------------

    @abstractmethod
    def write_file(self, d: Path | ObjectPath, name: str, data: bytes) -> None:
        """`d / name` holds `data`, whole, or does not exist (never a part of it)."""

    def read_file(self, d: Path | ObjectPath, name: str) -> bytes:
        return (d / name).read_bytes()

    def write_record(self, step: int, name: str, record: dict[str, Any]) -> None:
        """A small JSON record beside `step`'s files before its commit (the commit
        across nodes: `twolevel.persist.commit`)."""
        self.write_file(self.tmp_dir(step), name, json.dumps(record).encode())

    def remove_record(self, step: int, name: str) -> None:
        (self.tmp_dir(step) / name).unlink(missing_ok=True)

    @abstractmethod
    def writing(self, step: int) -> bool:
        """Whether `step` may be being written (begun, not committed): what a node that
        reports a failed part asks before it writes one nobody waits for."""

    def read_record(self, step: int, name: str) -> dict[str, Any] | None:
        """The record `name` of `step`; None when it is not there (yet), or not whole."""
        try:
            return json.loads(self.read_file(self.tmp_dir(step), name))
        except (OSError, ValueError):
            return None


class LocalStorage(Storage):
    """A directory of a file system (local, or shared across nodes)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @property
    def local(self) -> Path:
        return self.root.resolve()

    @property
    def name(self) -> str:
        return str(self.root.resolve())

    def absent(self) -> str:
        return "is not a directory"

    def beside(self, step: int) -> list[str]:
        return [d.name for d in sorted(self.root.glob(f"step-{step:08d}.*"))]

    def remove(self, step: int) -> None:
        for d in (self.step_dir(step), self.tmp_dir(step)):
            shutil.rmtree(d, ignore_errors=True)

    def writing(self, step: int) -> bool:
        return Path(self.tmp_dir(step)).is_dir()

    def write_file(self, d: Path | ObjectPath, name: str, data: bytes) -> None:
        assert isinstance(d, Path)
        tmp = d / f"{name}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, d / name)  # whole or absent
        fsync_dir(d)


class ObjectStorage(Storage):
    """A prefix in an object store (s3://, gs://, memory://) over fsspec."""

    def __init__(self, root: ObjectPath) -> None:
        self.root = root

    @property
    def local(self) -> None:
        return None

    @property
    def name(self) -> str:
        return str(self.root)

    @property
    def shared_across_processes(self) -> bool:
        # A memory:// store lives in one process: a persist process would not see it.
        return self.root.protocol != "memory"

    def absent(self) -> str:
        return "holds no objects"

    def remove(self, step: int) -> None:
        self.step_dir(step).remove_tree()

    def writing(self, step: int) -> bool:
        return True  # an empty prefix and none look the same: a part may be awaited

    def write_file(self, d: Path | ObjectPath, name: str, data: bytes) -> None:
        assert isinstance(d, ObjectPath)
        (d / name).write_confirmed(data)  # one put: whole or absent


def open_storage(directory: str | Path | ObjectPath | Storage) -> Storage:
    """The `Storage` a checkpoint directory names: a local directory (a path, or a
    file:// URL) or an object store URL. ValueError for a URL whose protocol fsspec does
    not know, or whose client library is not installed."""
    if isinstance(directory, Storage):
        return directory
    root = open_root(directory)
    return ObjectStorage(root) if isinstance(root, ObjectPath) else LocalStorage(root)
