"""One commit across nodes: every node's persist process writes its ranks' files, node 0's
commits the manifest once every node's part is on storage.

    node 0's process                          node j's process (j > 0)
    begin_step(step); write BEGIN(nonce)      wait for BEGIN(nonce)
    write its ranks' files                    write its ranks' files, fsync
    wait for PART(j, nonce) of every j        write PART(j, nonce): entries, files, held
    merge, remove the records, commit         (or PART(j, nonce, error) when it failed)

The records live in the step's temporary directory (its prefix in an object store),
beside the files: storage is the one thing every node shares, and the handshake needs
no connection between nodes' processes. `begin_step` discards an abandoned directory, so
node j writes only after node 0's BEGIN: a file written before would be discarded with
it (and in an object store, a re-committed step's old objects would be overwritten
while its old manifest still names them). The `nonce` is the request's (rank 0's job
nonce, shared at start, and the count of persist requests so far), so a record left by
an earlier job, or by an earlier attempt at the same step, in a directory it abandoned
is never taken for this request's. The records are removed before the manifest is written: a
committed step holds only what its manifest names.

A part that never comes (node j's process died) ends the wait: its leader writes the
failed PART itself when its process dies with the step in flight (`watch_part`, once
node 0's BEGIN is there), and every wait also stops when the persist is abandoned
(`cancelled`) or its parent is gone.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from moc.checkpoint.store.manifest import Entry
from moc.checkpoint.store.storage import Storage

BEGIN = "moc-begin.json"
POLL_S = 0.02
"""How often a waiting persist process looks for a record (a stat on shared storage)."""


def part_name(node: int) -> str:
    return f"moc-part-node-{node:05d}.json"


class Abandoned(RuntimeError):
    """The persist was given up while waiting for another node (its step is failed)."""


@dataclass(frozen=True)
class Part:
    """What one node's persist process wrote for a step."""

    node: int
    entries: dict[str, Entry]
    files: dict[str, int]
    held: list[str]
    bytes_per_rank: dict[int, int]
    error: str | None = None


def write_begin(storage: Storage, step: int, nonce: str) -> None:
    """Node 0, right after `begin_step`: the other nodes may now write."""
    storage.write_record(step, BEGIN, {"nonce": nonce, "step": step})


def wait_begun(storage: Storage, step: int, nonce: str, timeout_s: float,
               cancelled: Callable[[], bool]) -> None:
    """Node j: block until node 0 has begun `step` for this job."""
    _wait(lambda: (r := storage.read_record(step, BEGIN)) is not None
          and r.get("nonce") == nonce,
          timeout_s, cancelled, f"node 0 to begin step {step} in {storage.tmp_dir(step)}")


def write_part(storage: Storage, step: int, node: int, nonce: str, *,
               entries: dict[str, Entry] | None = None, files: dict[str, int] | None = None,
               held: list[str] | None = None, bytes_per_rank: dict[int, int] | None = None,
               error: str | None = None, keep_existing: bool = False) -> None:
    """Node j's share of `step` is on storage (or failed, with `error`). `keep_existing`
    (a leader reporting its dead process): a part already written stays."""
    if keep_existing:
        found = storage.read_record(step, part_name(node))
        if found is not None and found.get("nonce") == nonce:
            return
        if not storage.writing(step):
            return  # node 0 never began it: nobody waits for this part
    storage.write_record(step, part_name(node), {
        "nonce": nonce, "node": node, "error": error,
        "entries": {k: [e.step, e.file, e.dtype, list(e.shape), e.crc, e.algo]
                    for k, e in (entries or {}).items()},
        "files": files or {}, "held": held or [],
        "bytes_per_rank": {str(r): n for r, n in (bytes_per_rank or {}).items()}})


def watch_part(storage: Storage, step: int, node: int, nonce: str, timeout_s: float,
               gone: Callable[[], bool], settled: Callable[[], bool]) -> threading.Thread:
    """Node j's leader, from the moment it asks its persist process for `step`: when the
    process dies (`gone()`) before the step's result is known (`settled()`), write the
    failed part in its place, so that node 0's wait for it ends.

    A thread, not a check at the next plan: with persist_policy "wait", a final save,
    flush or close, rank 0 waits for node 0's process before the plan's collective, so
    node j's leader, already in that collective, would never get to check; node 0
    would wait `timeout_s` for the part. The part is written only after node 0's BEGIN
    (a part written before it would be discarded with the directory by `begin_step`),
    and a part already there stays (`keep_existing`). The thread, started; it ends
    when the step is settled, its part written, or after `timeout_s`."""

    def run() -> None:
        deadline = time.monotonic() + timeout_s
        while not settled() and time.monotonic() < deadline:
            if gone():
                with contextlib.suppress(Exception):  # node 0 then gives up at its timeout
                    wait_begun(storage, step, nonce, deadline - time.monotonic(), settled)
                    write_part(storage, step, node, nonce, error=error, keep_existing=True)
                return
            time.sleep(POLL_S)

    error = f"node {node}'s persist process exited while it persisted step {step}"
    thread = threading.Thread(target=run, daemon=True, name=f"moc-watch-part-{step}")
    thread.start()
    return thread


def gather_parts(storage: Storage, step: int, nodes: range, nonce: str,
                 timeout_s: float, cancelled: Callable[[], bool]) -> list[Part]:
    """Node 0: every other node's part of `step`, waiting for the missing ones. Raises
    RuntimeError naming the node whose part failed or never came."""
    found: dict[int, dict] = {}

    def all_in() -> bool:
        for node in nodes:
            if node not in found:
                r = storage.read_record(step, part_name(node))
                if r is not None and r.get("nonce") == nonce:
                    found[node] = r
                    if r.get("error"):
                        raise RuntimeError(f"node {node}'s persist of step {step} failed: "
                                           f"{r['error']}")
        return len(found) == len(nodes)

    _wait(all_in, timeout_s, cancelled, f"the parts of nodes {list(nodes)} of step {step}")
    return [Part(node, {k: Entry(int(s), str(f), str(t), tuple(shape), int(c), str(a))
                        for k, (s, f, t, shape, c, a) in r["entries"].items()},
                 {str(k): int(v) for k, v in r["files"].items()}, list(r["held"]),
                 {int(k): int(v) for k, v in r["bytes_per_rank"].items()})
            for node, r in sorted(found.items())]


def clear_records(storage: Storage, step: int, nodes: range) -> None:
    """Node 0, before the manifest: a committed step holds only what its manifest names."""
    for name in [BEGIN, *map(part_name, nodes)]:
        storage.remove_record(step, name)


def _wait(done: Callable[[], bool], timeout_s: float, cancelled: Callable[[], bool],
          what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if cancelled():
            raise Abandoned(f"gave up waiting for {what}: the persist was abandoned")
        if time.monotonic() > deadline:
            raise RuntimeError(f"waited {timeout_s:.0f} s for {what}; giving up this step")
        time.sleep(POLL_S)
