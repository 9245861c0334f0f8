"""Level 2: a persist process per node writes snapshots from shared memory to storage.

A separate process, not a thread of a training process: writing hundreds of MB and
checksumming them would otherwise contend for the GIL with training. The messages it
exchanges with the ranks are in `twolevel.protocol`.

    serve(job, root, parent_pid)   the persist process (server)
    PersistClient                  a training rank's end: the process (rank 0 starts it),
                                   the connection, liveness and timeouts

For a persist request of step s the process waits until every rank of the node has
reported its snapshot of s complete, writes each rank's file straight from the shared
memory slot (the keys that rank's sharded plan gives it, with the CRCs computed when the
snapshot was taken), fsyncs, and commits the manifest: the template from rank 0 plus
the entries (the previous committed manifest's chain, updated by what was written).
One persist runs at a time. The process exits when rank 0 (its parent) is gone, without
committing what it had not finished: a `.tmp` directory is all a crash leaves.

This release runs one node: the persist process is the commit coordinator, since it sees
every rank's snapshot. (Across nodes, per-node processes would report to a coordinator
through the job's TCPStore.)
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
import traceback
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from queue import Empty, Queue

from moc.checkpoint.store.format import write_safetensors
from moc.checkpoint.store.manifest import Entry, Manifest
from moc.checkpoint.store.steps import begin_step, commit_step, rank_file, tmp_dir
from moc.checkpoint.twolevel.protocol import (
    AUTHKEY,
    PERSIST_GONE,
    PERSIST_TIMEOUT_S,
    Done,
    Failed,
    Hello,
    Persist,
    Ready,
    Stop,
)
from moc.checkpoint.twolevel.slots import SnapshotStore, job_dir

POLL_S = 0.005
"""How often the persist process looks for missing snapshots and a dead parent."""
STALL_ENV = "MOC_PERSIST_STALL_S"
"""Fault injection for tests and drills: the persist process sleeps this long before
each persist, as a slow or stalled disk would make it."""
CONNECT_TIMEOUT_S = 60.0
"""How long a rank waits for its node's persist process to listen (it starts in about a
second: a fresh interpreter importing torch)."""
STOP_TIMEOUT_S = 60.0
"""How long close() lets the persist process finish and exit before killing it."""


def socket_path(jdir: Path) -> str:
    return str(jdir / "persist.sock")


# -- the client: a training rank's end ---------------------------------------------------


class PersistClient:
    """A training rank's connection to its node's persist process; rank 0's also owns the
    process itself (it starts and stops it, and notices when it is gone).

    Owners: `send` may be called from the caller's and the snapshot thread (a lock keeps
    messages whole); `receive`, `alive` and `process` belong to rank 0's thread that
    holds the engine's plan lock.
    """

    def __init__(self, job: str, root: Path, rank: int) -> None:
        self.rank = rank
        self.alive = True
        """Rank 0's view: False once the process is found gone (or hung and killed)."""
        self.process: subprocess.Popen | None = None
        if rank == 0:
            # -c rather than -m: the process imports only what serving needs.
            self.process = subprocess.Popen(
                [sys.executable, "-c", "import sys; from moc.checkpoint.twolevel.persist "
                 "import serve; serve(sys.argv[1], sys.argv[2], int(sys.argv[3]))",
                 job, str(root), str(os.getpid())])
        self._lock = threading.Lock()
        self._conn = _connect(job_dir(job))
        self.send(Hello(rank))

    def send(self, msg: object) -> None:
        """Send one message; a dead persist process is not an error here (rank 0
        notices it in `receive`, and every rank learns it from rank 0)."""
        with self._lock, contextlib.suppress(OSError):
            self._conn.send(msg)

    def receive(self, step: int, block: bool) -> list[Done]:
        """Rank 0: the results that have arrived while the persist of `step` is in
        flight; with `block`, waiting (PERSIST_TIMEOUT_S at most) for that one. A closed
        connection or a timeout ends the persist as failed (PERSIST_GONE), and a hung
        process is killed: it must never commit late."""
        out: list[Done] = []
        while block or self._conn.poll():
            try:
                if not self._conn.poll(PERSIST_TIMEOUT_S):  # blocks until a result
                    raise TimeoutError
                msg = self._conn.recv()
            except (EOFError, OSError):  # TimeoutError is an OSError
                msg = Done(step, False, PERSIST_GONE)
                self.alive = False
                if self.process is not None:
                    self.process.kill()
            out.append(msg)
            if msg.step == step:
                break
        return out

    def stop(self) -> None:
        """Rank 0: ask the process to stop and wait for it (killing it after
        STOP_TIMEOUT_S); every rank: close the connection."""
        try:
            if self.rank == 0:
                self.send(Stop())
                if self.process is not None:
                    try:
                        self.process.wait(timeout=STOP_TIMEOUT_S)
                    except subprocess.TimeoutExpired:
                        self.process.kill()
                        self.process.wait()
        finally:
            self._conn.close()


def _connect(jdir: Path, timeout_s: float = CONNECT_TIMEOUT_S) -> Connection:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return Client(socket_path(jdir), family="AF_UNIX", authkey=AUTHKEY)
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


# -- the server: the persist process -----------------------------------------------------


def serve(job: str, root: str, parent_pid: int) -> None:
    """Entry point of the persist process."""
    from moc.checkpoint.twolevel.worker import BACKGROUND_NICE

    os.nice(BACKGROUND_NICE)  # training first; persisting only bounds checkpoint frequency
    jdir = job_dir(job)
    jdir.mkdir(parents=True, exist_ok=True)
    path = socket_path(jdir)
    if os.path.exists(path):
        os.unlink(path)
    listener = Listener(path, family="AF_UNIX", authkey=AUTHKEY)
    inbox: Queue = Queue()
    rank0: list[Connection] = []

    def read(conn: Connection) -> None:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return
            if isinstance(msg, Hello) and msg.rank == 0:
                rank0.append(conn)
            inbox.put(msg)

    def accept() -> None:
        while True:
            try:
                conn = listener.accept()
            except OSError:
                return
            threading.Thread(target=read, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    ready: dict[int, dict[int, Ready]] = {}  # step -> rank -> its snapshot
    pending: list[Persist] = []
    failed: dict[int, str] = {}  # step -> why a rank's snapshot of it failed
    while True:
        if not _alive(parent_pid):
            return  # rank 0 is gone: finish nothing, commit nothing
        try:
            msg = inbox.get(timeout=POLL_S)
        except Empty:
            msg = None
        if isinstance(msg, Ready):
            ready.setdefault(msg.step, {})[msg.rank] = msg
        elif isinstance(msg, Failed):
            failed.setdefault(msg.step, f"rank {msg.rank}'s snapshot of step {msg.step} "
                                        f"failed: {msg.error}")
        elif isinstance(msg, Persist):
            pending.append(msg)
        elif isinstance(msg, Stop):
            return
        if pending and pending[0].step in failed:
            # A rank will never report this snapshot ready: nothing to write or commit.
            req = pending.pop(0)
            ready.pop(req.step, None)
            result = Done(req.step, False, failed.pop(req.step))
        elif pending and len(ready.get(pending[0].step, {})) == pending[0].world_size:
            req = pending.pop(0)
            result = _run(job, Path(root), req, ready.pop(req.step), parent_pid)
        else:
            continue
        for old in [s for s in ready if s < req.step]:
            ready.pop(old)
        for old in [s for s in failed if s < req.step]:
            failed.pop(old)
        if rank0:
            try:
                rank0[0].send(result)
            except OSError:
                return


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return os.getppid() == pid


def _run(job: str, root: Path, req: Persist, ready: dict[int, Ready], parent_pid: int
         ) -> Done:
    """Persist one step; its result, failures included."""
    t0 = time.perf_counter()
    time.sleep(float(os.environ.get(STALL_ENV, "0")))
    try:
        sizes = _persist(job, root, req, ready, parent_pid)
        return Done(req.step, True, None, time.perf_counter() - t0, sizes)
    except Exception as e:
        return Done(req.step, False,
                    f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}",
                    time.perf_counter() - t0)


def _persist(job: str, root: Path, req: Persist, ready: dict[int, Ready], parent_pid: int
             ) -> list[int]:
    """Write and commit one step; the bytes written for each rank."""
    prev = Manifest.load(root, req.prev_step).entries if req.prev_step is not None else {}
    begin_step(root, req.step)
    entries: dict[str, Entry] = {}
    files: dict[str, int] = {}
    held: set[str] = set()
    for rank, snap in sorted(ready.items()):
        held.update(snap.held)
        if not snap.write:
            continue
        store = SnapshotStore(job, rank)
        header = store.headers().get(snap.slot)
        if header is None or header.step != req.step:
            raise RuntimeError(f"rank {rank}'s snapshot of step {req.step} is gone from "
                               f"slot {snap.slot}")
        tensors = store.read(snap.slot, header, verify=False)
        name = rank_file(rank)
        path = tmp_dir(root, req.step) / name
        records = write_safetensors(path, {k: tensors[k] for k in snap.write},
                                    crcs={k: header.entries[k].crc32 for k in snap.write})
        files[name] = path.stat().st_size
        entries.update({k: Entry(req.step, name, r.dtype, r.shape, r.crc32)
                        for k, r in records.items()})
    if not _alive(parent_pid):
        raise RuntimeError("the job is gone; step left uncommitted")
    # The state is what the ranks hold now: keys of ranks that no longer exist drop out.
    all_entries = {k: e for k, e in prev.items() if k in held}
    all_entries.update(entries)
    missing = held - set(all_entries)
    if missing:
        raise RuntimeError(f"step {req.step}: {len(missing)} keys neither written nor in "
                           f"step {req.prev_step}, e.g. {sorted(missing)[:3]}")
    manifest = Manifest(entries=all_entries, files=files, **req.template)
    commit_step(root, req.step, manifest.to_json())
    return [files.get(rank_file(r), 0) for r in range(req.world_size)]
