"""The snapshot's copies and checksums over many buffers at once, in one native call each.

    digests(buffers, threads)               XXH3-64 of each buffer
    copy_all(dsts, srcs, threads)           streaming copies
    copy_and_digest(dsts, srcs, threads)    both in one pass over each source

Why one call for all of a snapshot's buffers: a snapshot is hundreds of tensors, and a
Python loop of one native call per tensor gives the GIL back and takes it again at every
call. Beside a training thread that runs Python (launching kernels, the optimizer), each
take waits for the training thread to yield (up to sys.getswitchinterval(), 5 ms): 600
checksums of 1 MiB took 57 ms alone and 3.16 s beside a busy Python thread. One call
releases the GIL once for the whole list and hashes it on a few native threads.

The functions come from moc's C extension (`streamcopy.c`, built by setup.py where a C
compiler is there); without it, from the `xxhash` package and numpy, one tensor at a time
(correct, slower beside a busy training thread). The checksums are the format's either
way: XXH3-64, seed 0 (`store.format.CHECKSUM`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from moc.checkpoint.store.format import Digest, digest

try:  # the one compiled part of moc, optional (setup.py): where it is missing, Python copies
    from moc.checkpoint.twolevel.memory import streamcopy
except ImportError:  # pragma: no cover - a build without a C compiler
    streamcopy = None

Buffer = memoryview | np.ndarray | bytes | bytearray

BATCHED = streamcopy is not None and hasattr(streamcopy, "hash_many")
"""Whether the batched native calls are there (else the Python fallbacks run)."""
STREAMING = bool(streamcopy is not None and streamcopy.NONTEMPORAL)
"""Whether copies use streaming (non-temporal) stores (`streamcopy.c`: x86-64 with the
extension built): the copied bytes are never read back by the copy, so they need not
evict training's working set from the cache, and a copy moves 2 bytes of memory traffic
per byte instead of 3."""
COPY_CHUNK = 512 << 10
"""Bytes the fused copy hashes and then copies at a time (the C extension's and the Python
fallback's): small enough that a chunk stays in the core's L2 cache between the hash and
the copy (one pass over memory, not two), large enough that the loop's own cost stays well
under 1% of the copy's. Measured (one thread, 431 MB of float32 tensors): with XXH3 13.9
GB/s against 13.3 in 256 KiB chunks and 12.3 in 1 MiB ones."""


def default_threads() -> int:
    """Native threads a seal hashes on: a quarter of the cores, 1 to 8. Enough for a
    GPU node's snapshot to keep up with a checkpoint every step (one XXH3 thread hashes
    7-15 GB/s), few enough to leave most cores to training's own threads (data loading,
    the launches of other ranks on the node). The threads inherit the snapshot thread's
    scheduling class (SCHED_IDLE: `worker.lower_thread_priority`), so they only ever
    take a core nobody else wants."""
    return max(1, min(8, (os.cpu_count() or 1) // 4))


def digests(buffers: Sequence[Buffer], threads: int = 1) -> list[int]:
    """XXH3-64 (seed 0) of each buffer, the GIL released once for all of them."""
    if BATCHED:
        return streamcopy.hash_many(list(buffers), threads)
    return [digest(memoryview(b)) for b in buffers]


def copy_all(dsts: Sequence[Buffer], srcs: Sequence[Buffer], threads: int = 1) -> None:
    """Copy each source into its destination (same lengths), the GIL released once."""
    if BATCHED:
        streamcopy.copy_many(list(dsts), list(srcs), threads)
        return
    for dst, src in zip(dsts, srcs, strict=True):
        np.frombuffer(dst, dtype=np.uint8)[:] = np.frombuffer(src, dtype=np.uint8)


def copy_and_digest(dsts: Sequence[Buffer], srcs: Sequence[Buffer], threads: int = 1
                    ) -> list[int]:
    """Copy each source into its destination and return the XXH3-64 of each, reading
    each source once: COPY_CHUNK bytes are hashed (which brings them into cache) and then
    copied, so a CPU snapshot costs one pass over memory."""
    if BATCHED:
        return streamcopy.copy_hash_many(list(dsts), list(srcs), threads)
    out = []
    for dst, src in zip(dsts, srcs, strict=True):
        d_np, s_np = np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8)
        if d_np.size != s_np.size:
            raise ValueError(f"copy_and_digest: a destination of {d_np.size} bytes for a "
                             f"source of {s_np.size}; expected equal lengths")
        d = Digest()
        for i in range(0, s_np.size, COPY_CHUNK):
            j = min(s_np.size, i + COPY_CHUNK)
            d_np[i:j] = s_np[i:j]
            d.update(memoryview(d_np[i:j]))
        out.append(d.value)
    return out
