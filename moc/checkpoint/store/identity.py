"""The identity of the run a checkpoint directory belongs to.

    run_id = ensure_run_id(root)     # rank 0: read <root>/moc-run.json, or create it

A run id is created with the checkpoint directory's first engine and stored in it
(`moc-run.json`); every later engine on that directory (a torchrun restart, a resumed
job) reads the same id. Memory snapshots carry it (with the model's description), and
recovery never restores a snapshot whose run id is not the directory's: snapshots of a
run whose directory was emptied or replaced (`rm -rf DIR/*`, a new run on the same
path) belong to another run, even when their model and layout match.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from pathlib import Path

from moc.checkpoint.errors import CheckpointError
from moc.checkpoint.store.backend import ObjectPath, open_root
from moc.checkpoint.store.manifest import Manifest
from moc.checkpoint.store.steps import complete_steps

RUN_FILE = "moc-run.json"


def read_run_id(root: Path) -> str | None:
    """The directory's run id; None when it has none (a fresh directory)."""
    path = open_root(root) / RUN_FILE
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is unreadable ({e}); it names the run this "
                              "directory belongs to: restore it or move the directory "
                              "away") from None
    run_id = d.get("run_id") if isinstance(d, dict) else None
    if not isinstance(run_id, str) or not run_id:
        raise CheckpointError(f"{path} holds no run id; restore it or move the "
                              "directory away")
    return run_id


def ensure_run_id(root: Path) -> str | None:
    """The directory's run id, created (atomically) when it has none; None when the
    directory is not writable and has none. A directory without one that holds steps
    (copied in from another run's directory, with their chain) takes the run id its
    newest step records: those steps are that run's, and a new id would make every one
    of them foreign to the directory they were copied into."""
    root = open_root(root)
    existing = read_run_id(root)
    if existing is not None:
        return existing
    run_id = _newest_step_run_id(root) or secrets.token_hex(8)
    if isinstance(root, ObjectPath):  # created only if absent (a conditional put on s3)
        created = (root / RUN_FILE).create_exclusive(
            (json.dumps({"run_id": run_id}) + "\n").encode())
        return run_id if created else read_run_id(root)
    tmp = root / f"{RUN_FILE}.{os.getpid()}.tmp"
    try:
        tmp.write_text(json.dumps({"run_id": run_id}) + "\n")
        os.link(tmp, root / RUN_FILE)  # fails if another process created it meanwhile
    except FileExistsError:
        return read_run_id(root)
    except OSError:
        return None  # read-only: nothing is written here, no snapshot will be either
    finally:
        with contextlib.suppress(OSError):  # a read-only mount refuses even this
            tmp.unlink(missing_ok=True)
    return run_id


def _newest_step_run_id(root: Path | ObjectPath) -> str | None:
    """The run id the newest complete step records; None when there is none or it
    cannot be read (then it is not adopted)."""
    steps = complete_steps(root)
    if not steps:
        return None
    try:
        return Manifest.load(root, steps[-1]).run_id
    except (CheckpointError, OSError):
        return None
