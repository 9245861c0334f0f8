"""One job per checkpoint directory: an exclusive lock that the kernel releases.

    lock = DirectoryLock.acquire(root)     # raises DirectoryInUseError naming the holder
    ...
    lock.release()

Two jobs writing one directory destroy each other's checkpoints (one's retention deletes
the other's steps, and two-level jobs would share node-local snapshots and chain from
each other's steps). The lock is `flock(2)` on `<root>/moc.lock`, taken by rank 0 when
an engine is built:

- The kernel releases it when the holder dies, however it dies (SIGKILL included), so a
  torchrun restart of the same job takes it again at once: there is no stale lock to
  break by hand and no timeout to tune.
- The file's content names the holder (host, pid, user, start time, command) so the
  second job's error says who has the directory. The content is informational only;
  the lock is the flock, never the file's existence.
- Within one process the lock is shared: engines built on the same directory in one
  process (a restore with a fresh engine, tests) count references to one lock.

flock is advisory and local to one machine (and, on NFS, works only where the server
supports it): it keeps moc jobs apart, it does not stop a process that ignores it.
A directory moc cannot write (read-only) is not locked: nothing can be written into it
by this job either, and reading needs no lock.

An object store has no flock and no kernel to release a lock when its holder dies.
There the lock is the object `<prefix>/moc.lock`, created only if absent (a conditional
put, If-None-Match, on S3; a check then a write elsewhere, which two jobs can race) and
deleted at release. An existing lock object is taken over only when it names a process
that this process can prove is gone: same host name, same boot (the kernel's boot_id),
same PID namespace, and that pid either absent or now a different process (its start
time differs). A host name alone proves nothing: two containers sharing one (host
networking) each see the other's pids as absent. Any other lock refuses the job with
DirectoryInUseError naming it: a lock left by a job that died on another host, another
container or before a reboot must be deleted by hand (the error says which object).
docs/THREAT_MODEL.md, "Object storage".
"""

from __future__ import annotations

import contextlib
import fcntl
import getpass
import json
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from moc.checkpoint.errors import CheckpointError
from moc.checkpoint.liveness import ProcessId
from moc.checkpoint.store.backend import ObjectPath, open_root

log = logging.getLogger(__name__)

LOCK_FILE = "moc.lock"


class DirectoryInUseError(CheckpointError):
    """The checkpoint directory is locked by another job."""


@dataclass
class _Held:
    fd: int
    refs: int
    token: str | None = None
    """An object lock's own token (its content names it): released only if it is still
    the one in the store."""


_held: dict[str, _Held] = {}
_mutex = threading.Lock()


def _holder_info() -> dict[str, object]:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    return {"host": socket.gethostname(), "pid": os.getpid(), "user": user,
            "since": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "command": " ".join(sys.argv)[:500], **ProcessId.of(os.getpid()).to_json()}


def describe_holder(path: Path | ObjectPath) -> str:
    """The holder as its lock file names it ("unknown" when unreadable)."""
    try:
        info = json.loads(path.read_text())
        return (f"pid {info['pid']} on {info['host']} (user {info['user']}, since "
                f"{info['since']}: {info['command']})")
    except (OSError, ValueError, KeyError, TypeError):
        return "an unknown process (its lock file is unreadable)"


class DirectoryLock:
    """A reference to this process's exclusive lock on one checkpoint directory."""

    def __init__(self, key: str | None) -> None:
        self._key = key

    @classmethod
    def acquire(cls, root: Path) -> DirectoryLock:
        """Lock `root` (created if missing) for this process, or raise
        DirectoryInUseError naming the process that holds it."""
        root = open_root(root)
        if isinstance(root, ObjectPath):
            return cls._acquire_object(root)
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            if not root.is_dir():
                raise CheckpointError(f"cannot create the checkpoint directory {root}: "
                                      f"{e.strerror}") from None
        key = str(root.resolve())
        with _mutex:
            held = _held.get(key)
            if held is not None:
                held.refs += 1
                return cls(key)
            path = root / LOCK_FILE
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                             0o644)
            except OSError as e:
                # Read-only: this job cannot write here either; reading needs no lock.
                log.warning("checkpoint directory %s is not writable (%s): not locked; "
                            "checkpoints cannot be saved there", root, e.strerror)
                return cls(None)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise DirectoryInUseError(
                    f"checkpoint directory {root} is in use by another job: "
                    f"{describe_holder(path)}. A directory belongs to one job at a time; "
                    "wait for that job to end, or use another directory") from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(_holder_info()) + "\n").encode(), 0)
            _held[key] = _Held(fd, 1)
            return cls(key)

    @classmethod
    def _acquire_object(cls, root: ObjectPath) -> DirectoryLock:
        key = str(root)
        with _mutex:
            held = _held.get(key)
            if held is not None:
                held.refs += 1
                return cls(key)
            path = root / LOCK_FILE
            token = os.urandom(8).hex()
            info = {**_holder_info(), "token": token}
            data = (json.dumps(info) + "\n").encode()
            try:
                created = path.create_exclusive(data)
                if not created and _stale(path):
                    log.warning("%s names a process of this host that is gone (%s); taking "
                                "the lock over", path, describe_holder(path))
                    path.unlink(missing_ok=True)
                    created = path.create_exclusive(data)
            except OSError as e:
                raise CheckpointError(f"cannot lock the checkpoint directory {root}: {e}; "
                                      "check the endpoint, the bucket and the credentials "
                                      "(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, "
                                      "AWS_SECRET_ACCESS_KEY)") from None
            if not created:
                raise DirectoryInUseError(
                    f"checkpoint directory {root} is in use by another job: "
                    f"{describe_holder(path)}. A directory belongs to one job at a time; "
                    "wait for that job to end, or use another directory. If that job is "
                    f"gone (it crashed on another host, in another container or before a "
                    f"reboot, where moc cannot tell a dead job from a live one), delete {path}")
            _held[key] = _Held(-1, 1, token)
            return cls(key)

    @property
    def locked(self) -> bool:
        return self._key is not None

    def release(self) -> None:
        """Drop this reference; the lock goes with the last one (idempotent)."""
        key, self._key = self._key, None
        if key is None:
            return
        with _mutex:
            held = _held[key]
            held.refs -= 1
            if held.refs == 0:
                del _held[key]
                if held.token is not None:
                    _release_object(open_root(key), held.token)
                    return
                with contextlib.suppress(OSError):
                    os.close(held.fd)  # closing the descriptor releases the flock


def _stale(path: ObjectPath) -> bool:
    """Whether an object lock names a process that provably no longer runs: one of this
    host name, this boot and this PID namespace whose pid is absent or belongs to a
    process started at another time (`liveness.ProcessId.gone`). Anything else (another
    machine, container or boot, a lock of an older moc that did not record these, an
    unreadable lock) is not ours to break."""
    try:
        info = json.loads(path.read_text())
        host, holder = info["host"], ProcessId.from_json(info)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    return host == socket.gethostname() and holder.gone(this_machine=False) is True


def _release_object(root: Path | ObjectPath, token: str) -> None:
    """Delete the lock object if it is still ours; a failure is logged, not raised (the
    next job of this host takes a stale lock over)."""
    assert isinstance(root, ObjectPath)
    path = root / LOCK_FILE
    try:
        if json.loads(path.read_text()).get("token") == token:
            path.unlink(missing_ok=True)
    except (OSError, ValueError, AttributeError) as e:
        log.warning("could not release the lock %s: %s", path, e)
