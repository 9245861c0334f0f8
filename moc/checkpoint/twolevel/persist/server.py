"""Level 2: a persist process per node writes snapshots from shared memory to storage.

A separate process, not a thread of a training process: writing hundreds of MB and
checksumming them would otherwise contend for the GIL with training. The messages it
exchanges with the ranks, and why they cannot carry code, are in `twolevel.persist.protocol`.

    serve_on()      the persist process's entry point: what to serve, and its secret,
                    on stdin (`twolevel.persist.prestart` starts one ahead); a rank's
                    end is `twolevel.persist.client`

For a persist request of step s the process waits until every rank of the node has
reported its snapshot of s complete, writes each rank's file straight from the shared
memory slot (the keys that rank's sharded plan gives it, with the CRCs computed when the
snapshot was taken), fsyncs, and commits the manifest: the template from rank 0 plus
the entries (the previous committed manifest's chain, updated by what was written).
One persist runs at a time. The process exits when rank 0 (its parent) is gone, without
committing what it had not finished: a `.tmp` directory is all a crash leaves.

Who may talk to it: only holders of its secret (the HMAC challenge of
`multiprocessing.connection`), which lives 0600 in the job's 0700 directory; a client
that fails the challenge, or sends a frame that is not a protocol message, is dropped
and the process goes on serving the others.

Each node runs one, started by its leader (local rank 0) for the node's ranks; node 0's
process commits the manifest once every node's part is on storage (`twolevel.persist.commit`:
records on the shared storage, no connection between the nodes' processes).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from queue import Empty, Queue

from moc.checkpoint import codec
from moc.checkpoint.errors import CheckpointError
from moc.checkpoint.phases import Phases
from moc.checkpoint.store.backend import ObjectPath
from moc.checkpoint.store.format import DirectWriter, write_safetensors
from moc.checkpoint.store.manifest import Entry, Manifest, read_manifest
from moc.checkpoint.store.steps import (
    rank_file,
)
from moc.checkpoint.store.storage import Storage, open_storage
from moc.checkpoint.store.tidy import tidy
from moc.checkpoint.twolevel.memory.jobdir import secure_job_dir
from moc.checkpoint.twolevel.memory.slots import SnapshotStore
from moc.checkpoint.twolevel.persist.address import Listener
from moc.checkpoint.twolevel.persist.commit import (
    Abandoned,
    clear_records,
    gather_parts,
    wait_begun,
    write_begin,
    write_part,
)
from moc.checkpoint.twolevel.persist.protocol import (
    MAX_MESSAGE_BYTES,
    PERSIST_TIMEOUT_S,
    Abandon,
    Done,
    Failed,
    Hello,
    Persist,
    Ready,
    Stop,
)

log = logging.getLogger(__name__)
POLL_S = 0.05
"""How often the persist process, idle, looks for a dead parent (a message wakes it at
once). At 5 ms the idle loop alone cost 0.02 CPU seconds per second (issue 15)."""
STALL_ENV = "MOC_PERSIST_STALL_S"
"""Fault injection for tests and drills: the persist process sleeps this long before
each persist, as a slow or stalled disk would make it."""
_MESSAGES = (Hello, Ready, Failed, Persist, Abandon, Stop, Done)



def serve_on() -> None:
    """Entry point of a persist process started ahead of need (`prestart`, imported
    before it is used): wait for one JSON line on stdin saying what to serve (job, root,
    parent pid, secret as hex, job directory), then `serve` it; exit at EOF (the process
    that started it ended without using it)."""
    line = sys.stdin.readline()
    if not line:
        return
    from moc.checkpoint.twolevel.persist.prestart import serving

    serving()
    serve_order(json.loads(line))


def serve_order(order: dict[str, str], listener: Listener | None = None) -> None:
    """`serve` what rank 0 wrote on stdin; `listener`: bound before this module was
    imported (`prestart.LISTEN_FIRST`), in the job directory rank 0 named."""
    serve(order["job"], order["root"], int(order["parent"]), bytes.fromhex(order["secret"]),
          listener)


def serve(job: str, root: str, parent_pid: int, secret: bytes | None = None,
          listener: Listener | None = None) -> None:
    """Entry point of the persist process; `secret` (None: the first line of stdin, as
    hex, where rank 0 writes it) authenticates every connection; `listener` (None: bound
    here) is the socket they come through."""
    from moc.checkpoint.twolevel.snapshot.worker import lower_process_priority

    # Its life is its parent's: it ends when rank 0 is gone or asks it to stop. A signal
    # sent to the job (a preemption's SIGTERM to the process group, Ctrl-C in a terminal)
    # must not kill the writer of the job's final checkpoint, which rank 0 is about to ask
    # for (`moc.Preemption`); SIGKILL still ends it.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    if secret is None:
        secret = bytes.fromhex(sys.stdin.readline().strip())
    lower_process_priority()  # training first; persisting only bounds checkpoint frequency
    # The one place this process normalises the directory: a URL becomes its own client,
    # from its own environment.
    storage = open_storage(root)
    jdir = secure_job_dir(job)
    if listener is None:
        listener = Listener(jdir, secret)
    elif os.path.realpath(listener.jdir) != os.path.realpath(jdir):
        raise CheckpointError(f"the persist process listens in {listener.jdir}, not in "
                              f"job {job!r}'s directory {jdir}")
    inbox: Queue = Queue()
    rank0: list[Connection] = []
    abandoned: set[int] = set()

    def read(conn: Connection) -> None:
        while True:
            try:
                msg = codec.decode(conn.recv_bytes(MAX_MESSAGE_BYTES))
                if not isinstance(msg, _MESSAGES):
                    raise codec.CodecError(f"not a protocol message: {type(msg).__name__}")
            except (EOFError, OSError):
                return
            except codec.CodecError as e:
                # Not one of ours (or a bug): drop this client, keep serving the others.
                print(f"moc persist: dropped a connection that sent {e}", file=sys.stderr)
                conn.close()
                return
            if isinstance(msg, Hello) and msg.rank == 0:
                rank0.append(conn)
            if isinstance(msg, Abandon):  # read by a persist waiting on other nodes
                abandoned.add(msg.step)
                continue
            if isinstance(msg, Persist):
                # A new attempt at a step given up before (`close` persists the newest
                # snapshot again): the Abandon, sent before it, was for the old one.
                abandoned.discard(msg.step)
            inbox.put(msg)

    def accept() -> None:
        while (conn := listener.accepted.get()) is not None:  # None: closed
            threading.Thread(target=read, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        ready: dict[int, dict[int, Ready]] = {}  # step -> rank -> its snapshot
        cache = PersistCache()
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
                if req.node != 0:  # node 0's process waits for this node's part
                    _give_up(storage, req, result.error or "failed",
                             lambda step=req.step: step in abandoned or not _alive(parent_pid))
            elif pending and len(ready.get(pending[0].step, {})) == pending[0].node_ranks:
                req = pending.pop(0)
                result = _run(job, storage, req, ready.pop(req.step), parent_pid,
                              lambda step=req.step: step in abandoned, cache)
            else:
                continue
            for old in [s for s in ready if s < req.step]:
                ready.pop(old)
            for old in [s for s in failed if s < req.step]:
                failed.pop(old)
            if rank0:
                try:
                    rank0[0].send_bytes(codec.encode(result))
                except OSError:
                    return
    finally:
        listener.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return os.getppid() == pid


def _run(job: str, storage: Storage, req: Persist, ready: dict[int, Ready], parent_pid: int,
         abandoned: Callable[[], bool] = lambda: False,
         cache: PersistCache | None = None) -> Done:
    """Persist one step; its result, failures included. On a node other than 0 a
    failure is also written as the node's part, so that node 0 stops waiting for it."""
    cache = cache if cache is not None else PersistCache()
    t0 = time.perf_counter()

    def cancelled() -> bool:
        return abandoned() or not _alive(parent_pid)

    # The injected stall ends early when the job is gone, as a stalled write would not,
    # but a drill's orphaned process must not outlive its test by the stall.
    stall_until = time.monotonic() + float(os.environ.get(STALL_ENV, "0"))
    while time.monotonic() < stall_until and not cancelled():
        time.sleep(min(POLL_S, max(0.0, stall_until - time.monotonic())))

    phases = Phases()
    try:
        if req.tidy is not None:
            tidy(storage.root, req.tidy)
        sizes, manifest = _persist(job, storage, req, ready, cancelled, phases, cache)
        return Done(req.step, True, None, time.perf_counter() - t0, sizes, phases.to_dict(),
                    manifest)
    except Exception as e:
        if isinstance(e, (OSError, Abandoned)):  # described by `_persist`: no traceback
            error = f"{type(e).__name__}: {e}"
        else:
            error = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"
        if req.node != 0 and not isinstance(e, Abandoned):
            with contextlib.suppress(Exception):  # node 0 then gives up at its timeout
                write_part(storage, req.step, req.node, req.nonce, error=error,
                           keep_existing=True)
        return Done(req.step, False, error, time.perf_counter() - t0)


def _give_up(storage: Storage, req: Persist, error: str, cancelled: Callable[[], bool]) -> None:
    """Node j > 0, when one of its ranks' snapshots failed: tell node 0, which waits for
    this node's part, with a failed part, once node 0 has begun the step (a part written
    before would be discarded with the directory)."""
    with contextlib.suppress(Exception):  # else node 0 gives up at its timeout
        wait_begun(storage, req.step, req.nonce, PERSIST_TIMEOUT_S, cancelled)
        write_part(storage, req.step, req.node, req.nonce, error=error, keep_existing=True)


def _persist(job: str, storage: Storage, req: Persist, ready: dict[int, Ready],
             cancelled: Callable[[], bool], phases: Phases, cache: PersistCache
             ) -> tuple[list[int], str | None]:
    """Write one step's files of this node's ranks; on node 0 also wait for the other
    nodes' parts and commit the manifest (`twolevel.persist.commit`). The bytes written for
    each rank of the job (on node j > 0: of its own ranks), and on node 0 the manifest
    committed. `phases`: "read" (the snapshots' headers and mappings), "write",
    "fsync", "parts" (waiting for other nodes) and "commit"."""
    others = range(1, req.n_nodes)
    prev = None
    if req.node == 0:
        # Read before the step is begun: on an object store beginning a step deletes its
        # objects, and the final save of close() chains from that very step's manifest.
        prev = (cache.manifest(storage.root, req.prev_step) if req.prev_step is not None
                else None)
        storage.begin(req.step)
        if others:
            write_begin(storage, req.step, req.nonce)
    else:
        wait_begun(storage, req.step, req.nonce, PERSIST_TIMEOUT_S, cancelled)
    entries, files, held, sizes = _write_files(job, storage, req, ready, phases, cache)
    if req.node != 0:
        write_part(storage, req.step, req.node, req.nonce, entries=entries, files=files,
                   held=sorted(held), bytes_per_rank=sizes)
        return [sizes.get(r, 0) for r in range(req.global_world or req.node_ranks)], None
    with phases("parts"):
        parts = gather_parts(storage, req.step, others, req.nonce, PERSIST_TIMEOUT_S, cancelled)
    for part in parts:
        entries.update(part.entries)
        files.update(part.files)
        held.update(part.held)
        sizes.update(part.bytes_per_rank)
    if cancelled():
        raise RuntimeError("the job is gone; step left uncommitted")
    with phases("commit"):
        text = _commit(storage, req, entries, held, files, others, cache, prev)
    return [sizes.get(r, 0) for r in range(req.global_world or req.node_ranks)], text


def _commit(storage: Storage, req: Persist, entries: dict[str, Entry], held: set[str],
            files: dict[str, int], others: range, cache: PersistCache,
            prev: Manifest | None) -> str:
    """Node 0: the step's manifest, from this step's entries and the previous step's
    (`prev`, the manifest of `req.prev_step`) for the keys not written now; its JSON,
    as committed."""
    clear_records(storage, req.step, others)
    assert req.template is not None  # node 0's request carries it
    # The state is what the ranks hold now: keys of ranks that no longer exist drop out.
    all_entries = {k: e for k, e in (prev.entries if prev else {}).items() if k in held}
    all_entries.update(entries)
    missing = held - set(all_entries)
    if missing:
        raise RuntimeError(f"step {req.step}: {len(missing)} keys neither written nor in "
                           f"step {req.prev_step}, e.g. {sorted(missing)[:3]}")
    manifest = Manifest(entries=all_entries, files=files, **req.template)
    text = manifest.to_json()
    try:
        storage.commit(req.step, text)
    except OSError as e:
        raise _storage_error(e, f"could not commit step {req.step} in {storage} (a manifest "
                                f"of {len(text.encode())} bytes)") from None
    cache.committed(manifest, text)
    return text


class PersistCache:
    """What the persist process keeps from one persist to the next: the ranks' snapshot
    slots, mapped once (a fresh mapping per persist costs a page fault per 4 KiB read),
    the aligned buffer of its O_DIRECT writes, and the manifest it committed last, which
    the next commit builds on (parsing and validating it again cost more CPU than
    writing it). The manifest is reused only while the file holds the very bytes
    committed: reading them is cheap, and anything that replaced or rewrote it since (a
    rollback's new chain, a hand edit, even one that kept its size and set its mtime
    back) is parsed afresh. No file metadata is trusted for this."""

    def __init__(self) -> None:
        self.stores: dict[int, SnapshotStore] = {}
        self.direct = DirectWriter()
        self._last: tuple[Manifest, bytes] | None = None

    def committed(self, manifest: Manifest, text: str) -> None:
        self._last = (manifest, text.encode())

    def manifest(self, root: Path | ObjectPath, step: int) -> Manifest:
        raw, path = read_manifest(root, step)
        if self._last is not None and self._last[0].step == step and raw == self._last[1]:
            return self._last[0]
        return Manifest.decode(raw, path, step)


def _write_files(job: str, storage: Storage, req: Persist, ready: dict[int, Ready], phases: Phases,
                 cache: PersistCache
                 ) -> tuple[dict[str, Entry], dict[str, int], set[str], dict[int, int]]:
    """Write the file of each of this node's ranks straight from its snapshot slot
    (through the cache's O_DIRECT buffer on a local disk): (entries, file sizes, keys
    the ranks hold, bytes per rank)."""
    stores = cache.stores
    entries: dict[str, Entry] = {}
    files: dict[str, int] = {}
    held: set[str] = set()
    for rank, snap in sorted(ready.items()):
        held.update(snap.held)
        if not snap.write:
            continue
        with phases("read"):
            if rank not in stores:
                stores[rank] = SnapshotStore(job, rank)
            store = stores[rank]
            header = store.header(snap.slot)
            if header is None or header.step != req.step:
                raise RuntimeError(f"rank {rank}'s snapshot of step {req.step} is gone from "
                                   f"slot {snap.slot}")
            chosen = store.read(snap.slot, header, verify=False, keys=list(snap.write))
        name = rank_file(rank)
        path = storage.tmp_dir(req.step) / name
        try:
            records = write_safetensors(path, chosen, phases=phases, direct=cache.direct,
                                        crcs={k: header.entries[k].crc for k in snap.write})
        except OSError as e:
            nbytes = sum(t.numel() * t.element_size() for t in chosen.values())
            raise _storage_error(e, f"could not write {path} ({nbytes} bytes of rank "
                                    f"{rank}'s tensors)") from None
        files[name] = path.stat().st_size
        entries.update({k: Entry(req.step, name, r.dtype, r.shape, r.crc, r.algo)
                        for k, r in records.items()})
    return entries, files, held, {r: files.get(rank_file(r), 0) for r in ready}


def _storage_error(e: OSError, what: str) -> OSError:
    """`e` with what was being written: `[Errno 28]` alone names neither file nor size."""
    return OSError(e.errno, f"{what}: {e.strerror or e}; free space on the checkpoint "
                            "file system (or keep fewer checkpoints: --keep-last); the next "
                            "checkpoint retries")
