"""Level 2: a persist process per node writes snapshots from shared memory to storage.

A separate process, not a thread of a training process: writing hundreds of MB and
checksumming them would otherwise contend for the GIL with training.

    training rank r  --("ready", rank, step, slot, write, held)-->  persist process
    training rank r  --("failed", rank, step, error)-->  persist process   (copy failed)
    rank 0           --("persist", step, template)-->   persist process
    persist process  --("done", step, ok, error, s)-->  rank 0

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

import os
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from queue import Empty, Queue
from typing import Any

AUTHKEY = b"moc-persist"
POLL_S = 0.005
"""How often the persist process looks for missing snapshots and a dead parent."""
STALL_ENV = "MOC_PERSIST_STALL_S"
"""Fault injection for tests and drills: the persist process sleeps this long before
each persist, as a slow or stalled disk would make it."""


def socket_path(job_dir: Path) -> str:
    return str(job_dir / "persist.sock")


@dataclass
class PersistRequest:
    step: int
    prev_step: int | None
    """The committed step whose manifest this one chains from (None: a new chain)."""
    template: dict[str, Any]
    """The manifest's fields except entries and files (JSON-ready)."""
    world_size: int


def connect(job_dir: Path, timeout_s: float = 60.0) -> Connection:
    """A training rank's connection to its node's persist process."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return Client(socket_path(job_dir), family="AF_UNIX", authkey=AUTHKEY)
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def serve(job: str, root: str, parent_pid: int) -> None:
    """Entry point of the persist process."""
    from moc.checkpoint.snapshot import BACKGROUND_NICE, job_dir

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
            if msg[0] == "hello" and msg[1] == 0:
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
    # step -> rank -> (slot, keys to write, every key the rank holds)
    ready: dict[int, dict[int, tuple[int, list[str], list[str]]]] = {}
    pending: list[PersistRequest] = []
    failed: dict[int, str] = {}  # step -> why a rank's snapshot of it failed
    while True:
        if not _alive(parent_pid):
            return  # rank 0 is gone: finish nothing, commit nothing
        try:
            msg = inbox.get(timeout=POLL_S)
        except Empty:
            msg = None
        if msg is not None:
            if msg[0] == "ready":
                _, rank, step, slot, write, held = msg
                ready.setdefault(step, {})[rank] = (slot, write, held)
            elif msg[0] == "failed":
                _, rank, step, error = msg
                failed.setdefault(step, f"rank {rank}'s snapshot of step {step} failed: "
                                        f"{error}")
            elif msg[0] == "persist":
                pending.append(msg[1])
            elif msg[0] == "stop":
                return
        if pending and pending[0].step in failed:
            # A rank will never report this snapshot ready: nothing to write or commit.
            req = pending.pop(0)
            ready.pop(req.step, None)
            result = ("done", req.step, False, failed.pop(req.step), 0.0, None)
        elif pending and len(ready.get(pending[0].step, {})) == pending[0].world_size:
            req = pending.pop(0)
            t0 = time.perf_counter()
            time.sleep(float(os.environ.get(STALL_ENV, "0")))
            try:
                sizes = _persist(job, Path(root), req, ready.pop(req.step), parent_pid)
                result = ("done", req.step, True, None, time.perf_counter() - t0, sizes)
            except Exception as e:
                result = ("done", req.step, False,
                          f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}",
                          time.perf_counter() - t0, None)
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


def _persist(job: str, root: Path, req: PersistRequest,
             ready: dict[int, tuple[int, list[str], list[str]]], parent_pid: int
             ) -> list[int]:
    """Write and commit one step; the bytes written for each rank."""
    from moc.checkpoint.manifest import Entry, Manifest
    from moc.checkpoint.snapshot import SnapshotStore
    from moc.checkpoint.storage import (
        begin_step,
        commit_step,
        rank_file,
        tmp_dir,
        write_safetensors,
    )

    prev = Manifest.load(root, req.prev_step).entries if req.prev_step is not None else {}
    begin_step(root, req.step)
    entries: dict[str, Entry] = {}
    files: dict[str, int] = {}
    held: set[str] = set()
    for rank, (slot, keys, rank_held) in sorted(ready.items()):
        held.update(rank_held)
        if not keys:
            continue
        store = SnapshotStore(job, rank)
        header = store.headers().get(slot)
        if header is None or header.step != req.step:
            raise RuntimeError(f"rank {rank}'s snapshot of step {req.step} is gone from "
                               f"slot {slot}")
        tensors = store.read(slot, header, verify=False)
        name = rank_file(rank)
        path = tmp_dir(root, req.step) / name
        records = write_safetensors(path, {k: tensors[k] for k in keys},
                                    crcs={k: header.entries[k].crc32 for k in keys})
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

