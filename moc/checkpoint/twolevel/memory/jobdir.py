"""A job's directory in node-local shared memory: who owns it, who may write it, and when
a dead job's is removed.

    /dev/shm/moc-<job>/owner.json      the process whose life the snapshots belong to
    /dev/shm/moc-<job>/rank-<r>/       a rank's snapshot slots (`twolevel.memory.slots`)
    /dev/shm/moc-<job>/replica-<r>/    the replicas this node keeps of rank r (`replica`)
    /dev/shm/moc-<job>/owner-gone      when a clean-up first found the owner gone (its grace)

A dead job's directory is removed by the next job's clean-up (`remove_stale_jobs`), but
not at once when it holds a snapshot: the job may be restarted as a new command, and
its memory is its fastest recovery source. It is kept GRACE_S (10 minutes;
$MOC_SHM_GRACE_S) from the first clean-up that found its owner gone, unless the memory
is needed: a job that cannot reserve its own (ENOSPC) removes every dead job's
directory at once and tries again (`make_room`).

Trust: whatever is in a job's directory is loaded into the model (snapshots) and names
the persist process's socket and secret, so only this user may be able to write there.
Directories are created 0700 and files 0600; a directory that already exists is used
only if it is a real directory (not a symbolic link), owned by this user and not
writable by group or others (`secure_dir`), and files are opened without following
symbolic links. See docs/THREAT_MODEL.md.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import stat
import time
from pathlib import Path

from moc.checkpoint.errors import CheckpointError
from moc.checkpoint.liveness import ProcessId, boot_id, pid_namespace
from moc.checkpoint.store.storage import Storage, open_storage
from moc.checkpoint.twolevel.memory.nodes import node_memory_root

log = logging.getLogger(__name__)

shm_root = node_memory_root


def job_dir(job: str) -> Path:
    return shm_root() / f"moc-{job}"


def secure_dir(path: Path) -> Path:
    """`path` as a directory only this user can write: created 0700, or, when it exists,
    checked to be one. Raises CheckpointError naming the path, what is wrong and what to
    do: a directory planted by another user must never be adopted (its files would be
    loaded as snapshots, its socket spoken to as the persist process)."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)  # lstat: a symbolic link is judged, not followed
    problem = None
    if stat.S_ISLNK(st.st_mode):
        problem = "is a symbolic link"
    elif not stat.S_ISDIR(st.st_mode):
        problem = "is not a directory"
    elif st.st_uid != os.getuid():
        problem = f"is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    elif st.st_mode & 0o022:
        problem = f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    if problem is not None:
        raise CheckpointError(
            f"refusing the snapshot directory {path}: it {problem}, so another user could "
            "plant snapshots this job would load or impersonate its persist process; "
            f"remove it if it is a stale one of yours (rm -rf {path}), or point "
            "MOC_SHM_ROOT at a directory only you can write")
    return path


def secure_job_dir(job: str) -> Path:
    """This job's directory, created or checked by `secure_dir`; its root (/dev/shm or
    $MOC_SHM_ROOT) must not let others replace it: not writable by others unless sticky
    (as /dev/shm is: 1777, where only an entry's owner may remove or rename it)."""
    root = shm_root()
    root.mkdir(parents=True, exist_ok=True)
    st = root.stat()
    if st.st_mode & 0o002 and not st.st_mode & stat.S_ISVTX:
        raise CheckpointError(
            f"refusing the shared-memory root {root}: anyone may write it and it is not "
            f"sticky (mode {stat.S_IMODE(st.st_mode):o}), so another user could replace "
            "this job's snapshot directory; point MOC_SHM_ROOT at a directory only you "
            "can write, or chmod +t it")
    return secure_dir(job_dir(job))


def write_private(path: Path, data: str | bytes) -> None:
    """Write a file only this user can read (0600), atomically (a temporary file, then a
    rename), never through a symbolic link planted at the temporary name. A write that
    fails (ENOSPC on a full /dev/shm) leaves neither file changed nor the temporary one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        tmp.rename(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def default_job_id(ckpt_dir: str | Path | Storage) -> str:
    """Stable across torchrun restarts of the same run: derived from the checkpoint dir
    (its absolute path; its URL, for an object store)."""
    return hashlib.sha1(open_storage(ckpt_dir).name.encode()).hexdigest()[:12]


OWNER = "owner.json"
"""In a job's directory: the process whose life its snapshots belong to
(`liveness.ProcessId`)."""
LEGACY_OWNER = "owner.pid"
"""An older moc's owner record: the pid alone, taken to be of this PID namespace."""


def claim_job(job: str) -> Path:
    """Rank 0, at the start of a job: remove the snapshot directories of dead jobs (those
    past their grace, `remove_stale_jobs`; every one when the claim finds no room), create
    this job's (or check the one a restart finds: `secure_job_dir`) and record its owner:
    the process whose life the snapshots belong to, which under torchrun is the agent (it
    outlives restarts of the workers).

    Refuses (CheckpointError) a job directory whose owner still runs and is neither this
    process nor its parent: another job with the same job id (`job=`), whose snapshots
    this one would overwrite and whose persist process it would replace; and, with one
    line naming the root and what to do, a shared memory with no room for the claim (a
    full /dev/shm), leaving no directory of its own behind."""
    try:
        grace = grace_s()
    except ValueError as e:  # one line on every rank (the executor shares it), no hang
        raise CheckpointError(str(e)) from None
    existed = os.path.lexists(job_dir(job))
    try:
        try:
            return _claim(job, grace)
        except OSError:
            if not make_room(keep=job):
                raise
            return _claim(job, grace)  # dead jobs' snapshots gave way: try once more
    except OSError as e:
        if not existed:  # ours, made just now: nothing of anyone's can be in it but ours
            with contextlib.suppress(OSError):
                (job_dir(job) / OWNER).unlink(missing_ok=True)
                os.rmdir(job_dir(job))  # only when empty: never a snapshot
        root = shm_root()
        raise CheckpointError(
            f"cannot claim the shared memory of job {job!r} in {root}: {e.strerror or e}; "
            f"free some (df -h {root}; remove stale moc-* directories of yours), give the "
            "node more shared memory (e.g. docker --shm-size) or point MOC_SHM_ROOT at a "
            "larger tmpfs") from None


def _claim(job: str, grace: float) -> Path:
    """`claim_job`'s work; OSError when the shared memory cannot hold it."""
    jdir = secure_job_dir(job)
    remove_stale_jobs(keep=job, grace=grace)
    held = read_owner(jdir)
    ours = held is not None and held.pid in (os.getpid(), os.getppid()) and (
        held.pid_ns == pid_namespace())  # the same number in another namespace is not us
    if held is not None and not ours and held.gone(this_machine=True) is not True:
        where = (" (in another PID namespace: a container sharing this /dev/shm)"
                 if held.pid_ns != pid_namespace() else "")
        raise CheckpointError(
            f"the shared memory of job {job!r} ({jdir}) belongs to a running process, pid "
            f"{held.pid}{where}, that is not this job's: two jobs "
            "with one job id would overwrite each other's snapshots. Give this job its own "
            "job id (the engine's job= argument) or its own MOC_SHM_ROOT; if that process "
            f"is not a moc job, remove {jdir}")
    owner = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else os.getpid()
    record_owner(jdir, owner)
    (jdir / LEGACY_OWNER).unlink(missing_ok=True)
    (jdir / GONE).unlink(missing_ok=True)  # running again: a later death starts a new grace
    return jdir


def record_owner(directory: Path, pid: int) -> None:
    """Record process `pid` (of this machine and PID namespace) as the owner of
    `directory`, a `moc-*` directory under the shm root: `remove_stale_jobs` removes it
    only once that process is provably gone. Every `moc-*` directory must carry one
    (a job's, `moc train --nodes`' simulated machines'), or after STALE_AFTER_S
    untouched it is taken for an abandoned one and removed while in use."""
    write_private(directory / OWNER, json.dumps(ProcessId.of(pid).to_json()))


def read_owner(jdir: Path) -> ProcessId | None:
    """The owner a job directory records; None when it records none (a directory being
    set up, or not moc's) or an unreadable one."""
    try:
        return ProcessId.from_json(json.loads((jdir / OWNER).read_text()))
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    try:
        pid = int((jdir / LEGACY_OWNER).read_text())
    except (OSError, ValueError):
        return None
    return ProcessId(pid, None, boot_id(), pid_namespace()) if pid > 0 else None


def remove_job(job: str) -> None:
    shutil.rmtree(job_dir(job), ignore_errors=True)


def remove_stale_jobs(keep: str, grace: float | None = None) -> list[Path]:
    """Delete snapshot directories of jobs whose owner is provably gone (a finished or
    abandoned job: `liveness.ProcessId.gone`) and whose grace is over (`in_grace`;
    `grace`: seconds, default `grace_s()`; 0 removes every dead job's directory). `keep`
    (this job) is never touched: it may be our recovery source. Nor is a directory of
    another user or a symbolic link, nor one whose owner runs in another PID namespace
    (a container sharing this /dev/shm, with `--ipc=host`: its pids are not visible
    here, so it only looks gone): not ours to judge."""
    grace = grace_s() if grace is None else grace
    removed = []
    for d in shm_root().glob("moc-*"):
        if d.name == f"moc-{keep}":
            continue
        try:
            st = os.lstat(d)
        except FileNotFoundError:
            continue  # removed meanwhile (another job cleaning up)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            continue
        owner = read_owner(d)
        if owner is not None:
            if owner.gone(this_machine=True) is not True:
                continue  # running, or not ours to judge
            if in_grace(d, grace):
                continue  # kept for its restart
        elif time.time() - st.st_mtime < STALE_AFTER_S:
            # No owner record: a directory being set up right now, or not ours; only
            # remove it when it has been left alone for a while.
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed


def make_room(keep: str) -> list[Path]:
    """Remove every dead job's directory but `keep`'s, in its grace or not: called when
    this job cannot reserve shared memory (ENOSPC), where a dead job's snapshots must
    not make a live one fail. The directories removed (none: nothing to free)."""
    removed = remove_stale_jobs(keep, grace=0)
    for d in removed:
        log.warning("moc: removed the snapshots of dead job %s before its grace was over: "
                    "this job needs the shared memory in %s", d.name, shm_root())
    return removed


def in_grace(jdir: Path, grace: float) -> bool:
    """Whether the directory of a dead job is kept for the job's restart: it holds a
    sealed snapshot (a header, `SNAPSHOT_HEADERS`: something to resume from; a job that
    died before its first has none) and a clean-up first found its owner gone less than
    `grace` seconds ago. That first clean-up records the moment (`GONE`): the job's
    death is not known, and the time of its last write says nothing of it (a job can
    run an hour between snapshots). Where even that record cannot be written, the
    memory is full: the grace is over."""
    if grace <= 0 or next(jdir.glob(SNAPSHOT_HEADERS), None) is None:
        return False
    try:
        since = float((jdir / GONE).read_text())
    except FileNotFoundError:
        try:
            write_private(jdir / GONE, repr(time.time()))
        except OSError:
            return False
        return True
    except (OSError, ValueError):
        return False  # not a record moc wrote (those are written whole, by a rename)
    return time.time() - since < grace


def grace_s() -> float:
    """How long a dead job's snapshots are kept: GRACE_ENV if set, else GRACE_S.
    ValueError naming the variable for a value that is not a number of seconds >= 0."""
    text = os.environ.get(GRACE_ENV)
    if text is None:
        return GRACE_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"{GRACE_ENV}={text!r}: expected a number of seconds >= 0 (the "
                         f"default is {GRACE_S:g}; 0 removes a dead job's snapshots at "
                         "the next job's start)")
    return value


STALE_AFTER_S = 3600
"""A snapshot directory without a live owner record is stale after an hour untouched."""
GRACE_S = 600.0
"""How long a dead job's snapshots outlive it in shared memory, from the first clean-up
that finds its owner gone: time for a crashed job to be restarted as a new command (by
hand, or by a scheduler's retry) and resume from memory although another job started on
the node in between. Ten minutes of a dead job's memory held is the cost; a job that
needs that memory takes it at once (`make_room`)."""
GRACE_ENV = "MOC_SHM_GRACE_S"
"""Overrides GRACE_S, in seconds (0: no grace, as before)."""
GONE = "owner-gone"
"""In a dead job's directory: when a clean-up first found its owner gone (time.time(),
as text); removed when the job is claimed again (`claim_job`)."""
SNAPSHOT_HEADERS = "*/slot-*.json"
"""The sealed snapshots of a job's directory (`slots.SnapshotStore.header_path`, in
`rank-*` and `replica-*`): what a restart could resume from."""


def reserve(path: Path, size: int, grow_to: int, job: str) -> int:
    """Make the slot file `path` at least `size` bytes (`grow_to` when it must grow:
    `slots.slot_capacity`) with every page of it reserved (allocated in the file system,
    not merely within its length); its length. CheckpointError when there is no room.

    Design note: a tmpfs file can be longer than the memory it holds (a sparse file),
    and a store into a page it does not hold kills the writer with SIGBUS when the
    file system is full (a receive into one fails with EFAULT), so a writer never maps
    a file whose pages are not all reserved. A file that is long enough is trusted
    only when its allocated blocks cover its length (`st_blocks`): a reservation an
    earlier process failed, or a file created some other way, is reserved again. When
    a reservation fails the file is truncated to nothing, so that it neither holds
    memory others need nor looks reserved by its length. Only a slot that holds no
    complete snapshot is reserved (its header is gone first), so nothing is lost."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        st = os.fstat(fd)
        if st.st_size >= size and st.st_blocks * 512 >= st.st_size:
            return st.st_size  # long enough, and every page of it reserved
        want = st.st_size if st.st_size >= size else grow_to
        try:
            if want:
                # Sizes the file too. Trusted when it succeeds, whatever st_blocks
                # says later (a compressing file system may count fewer blocks).
                _allocate(fd, want, job)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            raise CheckpointError(
                f"cannot reserve {want / 1e6:.1f} MB for a snapshot in {path.parent}: "
                f"{e.strerror}; give the node more shared memory (e.g. docker "
                "--shm-size) or point MOC_SHM_ROOT at a larger tmpfs") from None
        return want
    finally:
        os.close(fd)


def _allocate(fd: int, size: int, job: str) -> None:
    """Reserve `size` bytes of file `fd`; when the shared memory is full, once more after
    removing the dead jobs' snapshots kept for their restart (`jobdir.make_room`): a
    live job's snapshot comes before a dead one's. OSError when there is no room."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno != errno.ENOSPC or not make_room(keep=job):
            raise
        os.posix_fallocate(fd, 0, size)
