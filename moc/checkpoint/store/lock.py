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
A directory this process cannot write (a read-only mount) is refused: only a training
engine locks, and it could save nothing there; it would warn, train, and lose every
checkpoint up to the final one. A model-only engine (optimizer=None) reads, and reading
takes no lock, so read-only directories remain restorable.

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

A takeover is three requests (read the lock, delete it, create our own), and two jobs
restarted at once may both judge the same dead holder gone. Deleting unconditionally
let the second delete the lock the first had just created, and both held the directory
(issue 29). So the delete is conditional on the ETag of the very object that was judged
(DeleteObject with If-Match, as S3 and moto's S3 server honour it; the ETag comes from
the read itself, whose GETs carry If-Match too): it deletes that object or nothing.
The lock is then created with the conditional put as always, so of any number of
takers exactly one holds it, whatever the delays between their requests:

- both judged the same stale object: one deletes it; the other's delete finds another
  object (412) or none (404). Either way each then tries the conditional put, which
  exactly one of them wins; a taker whose delete found another object is refused.
- a slow taker judged an OLD lock stale long ago and acts after a new lock exists: the
  new lock has another ETag (its content holds a fresh random token), so the delete
  is refused and so is the job. Nothing is left behind to clean up over time: no
  marker objects, only the one lock.

Stores without conditional requests (memory://, another protocol) delete and create
unconditionally: two takers there can race, as two jobs starting at once can.
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
from moc.checkpoint.store.backend import CONDITIONAL_PUT, ObjectPath, open_root, storage_errors

log = logging.getLogger(__name__)

LOCK_FILE = "moc.lock"
TAKEOVER_STALL_ENV = "MOC_LOCK_TAKEOVER_STALL_S"
"""Fault injection for tests and drills: an object-store takeover sleeps this long
between judging the lock stale and deleting it, as a slow or descheduled job would."""
CHANGED_STATUS = (409, 412)
"""HTTP statuses of a conditional request that found another object: 412 Precondition
Failed, 409 ConditionalRequestConflict (a concurrent write won)."""
READ_ATTEMPTS = 3
"""Reads of a lock object replaced while being read, before giving up: each replacement
is another job's takeover or release, which a job sees a few times at most."""


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
                # A training engine alone locks: one that cannot write here would train
                # and lose every checkpoint. Refused now, before any step is trained.
                raise CheckpointError(
                    f"checkpoint directory {root} is not writable ({e.strerror}: {path}): "
                    "a training job saves its checkpoints there; use a writable "
                    "directory (to restore a model read-only, for inference, build the "
                    "engine with optimizer=None)") from None
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
                created = path.create_exclusive(data) or _take_over(path, data)
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


def _take_over(path: ObjectPath, data: bytes) -> bool:
    """Replace an existing lock object with ours (`data`) if its holder is provably gone;
    True when ours is now the lock. Of several takers at once, at most one gets True
    (module docstring): the stale object is deleted only if it is still the one judged,
    and ours is created only if no other exists."""
    seen = _read_lock(path)
    if seen is None:  # released meanwhile: the conditional put decides
        return path.create_exclusive(data)
    info, etag = seen
    if not _stale(info):
        return False
    log.warning("%s names a process of this host that is gone (%s); taking the lock "
                "over", path, describe_holder(path))
    time.sleep(float(os.environ.get(TAKEOVER_STALL_ENV, "0")))
    if not _delete_if_unchanged(path, etag):
        return False  # another taker replaced it first: that one holds the directory
    return path.create_exclusive(data)


def _read_lock(path: ObjectPath) -> tuple[dict[str, object], str | None] | None:
    """The lock object's content and its ETag, both of one version of the object (on s3
    the reads carry If-Match on the ETag the open found, so a lock replaced in between
    fails the read, and it is read again, instead of mixing two); None when it is gone.
    An unreadable object reads as {}: nobody's, so never stale."""
    for attempt in range(READ_ATTEMPTS):
        try:
            with storage_errors(f"cannot read {path}"), path.open_read() as f:
                raw, etag = f.read(), (getattr(f, "details", None) or {}).get("ETag")
            break
        except FileNotFoundError:
            return None
        except OSError as e:
            if not _changed(e) or attempt == READ_ATTEMPTS - 1:
                raise
    try:
        info = json.loads(raw)
    except ValueError:
        info = {}
    return (info if isinstance(info, dict) else {}), etag


def _changed(e: OSError) -> bool:
    """Whether a conditional request failed because another object is there now."""
    cause: BaseException | None = e
    while cause is not None:  # the client's error, under the OSErrors wrapping it
        response = getattr(cause, "response", None)
        if isinstance(response, dict):
            return response.get("ResponseMetadata", {}).get("HTTPStatusCode") in \
                CHANGED_STATUS
        cause = cause.__cause__
    return False


def _delete_if_unchanged(path: ObjectPath, etag: str | None) -> bool:
    """Delete the lock object only if it is still the version `etag` names (DeleteObject
    with If-Match); False when another object is there now. A lock already gone is True:
    the conditional put that follows decides who holds it. Where the store has no
    conditional requests, an unconditional delete (module docstring)."""
    if path.protocol not in CONDITIONAL_PUT:
        path.unlink(missing_ok=True)
        return True
    if etag is None:
        return False  # nothing to make the delete conditional on: not ours to break
    bucket, _, key = path.key.partition("/")
    with storage_errors(f"could not delete {path}"):
        try:
            path.fs.call_s3("delete_object", Bucket=bucket, Key=key, IfMatch=etag)
        except FileNotFoundError:
            return True
        except OSError as e:
            if _changed(e):
                return False
            raise
    return True


def _stale(info: dict[str, object]) -> bool:
    """Whether a lock object's content names a process that provably no longer runs: one
    of this host name, this boot and this PID namespace whose pid is absent or belongs
    to a process started at another time (`liveness.ProcessId.gone`). Anything else
    (another machine, container or boot, a lock of an older moc that did not record
    these, an unreadable lock) is not ours to break."""
    try:
        host, holder = info["host"], ProcessId.from_json(info)
    except (ValueError, KeyError, TypeError, AttributeError):
        return False
    return host == socket.gethostname() and holder.gone(this_machine=False) is True


def _release_object(root: Path | ObjectPath, token: str) -> None:
    """Delete the lock object if it is still ours (conditional on the version read, as a
    takeover's delete is); a failure is logged, not raised (the next job of this host
    takes a stale lock over)."""
    assert isinstance(root, ObjectPath)
    path = root / LOCK_FILE
    try:
        seen = _read_lock(path)
        if seen is not None and seen[0].get("token") == token:
            _delete_if_unchanged(path, seen[1])
    except OSError as e:
        log.warning("could not release the lock %s: %s", path, e)
