"""A file's bytes onto a local disk: in as few system calls as the kernel allows
(`write_all`: `writev` of many buffers at once, straight from their memory), or with
O_DIRECT, past the page cache (`DirectWriter`, the persist process's).

What the bytes are (a safetensors file, its checksums) is `format`'s; this module only
moves them, whatever they are, and knows nothing of tensors.
"""

from __future__ import annotations

import errno
import mmap
import os
from collections import deque
from pathlib import Path

from moc.checkpoint.phases import Phases

WRITE_BUFFERS = 512
"""Buffers per `writev` call (Linux takes up to IOV_MAX = 1024)."""
WRITE_BYTES = 1 << 30
"""Bytes per `writev` call: Linux transfers at most 2 GiB - 4 KiB in one."""


def write_all(fd: int, chunks: list[memoryview | bytes]) -> None:
    """Write every byte of `chunks`, in order, with as few system calls as the kernel
    allows (`writev` of many tensors at once, straight from their memory: no buffer in
    between, and a file of small tensors costs a handful of calls, not one each)."""
    pending = deque(memoryview(c).cast("B") for c in chunks if len(c))
    while pending:
        batch, size = [], 0
        for c in pending:
            if len(batch) == WRITE_BUFFERS or size + len(c) > WRITE_BYTES:
                break
            batch.append(c)
            size += len(c)
        if not batch:  # one buffer over WRITE_BYTES: write part of it
            batch = [pending[0][:WRITE_BYTES]]
        n = os.writev(fd, batch)  # blocks until the kernel took n bytes
        if n <= 0:
            raise OSError(f"writev wrote {n} bytes")
        while n:  # drop what was written, keep the rest of a buffer cut short
            if n >= len(pending[0]):
                n -= len(pending.popleft())
            else:
                pending[0], n = pending[0][n:], 0


class DirectWriter:
    """Writes files with O_DIRECT: the bytes go from an aligned buffer to the disk, not
    through the page cache.

    Why, for the persist process: a buffered write copies every byte into the page
    cache, and a checkpoint every step fills the cache with pages no one reads again,
    so each write also pays for reclaiming older ones (measured: 0.09 s of kernel CPU
    per 40 MB persist on the project's machine, against 0.015 s direct), and the cache
    training's data lives in is evicted for nothing. O_DIRECT needs buffers, offsets
    and lengths aligned to the device's blocks, which the bytes of a safetensors file
    (a header, then tensors packed back to back, taken from wherever they lie in the
    snapshot slot) are not; so they are gathered, CHUNK bytes at a time, into one
    page-aligned buffer (a memcpy: a fraction of what the page cache costs), written
    in whole blocks, and the file is truncated to its length at the end.

    A file system that refuses O_DIRECT (tmpfs before Linux 6.6, some network and FUSE
    file systems) is remembered and written the buffered way from then on. One buffer,
    reused: owned by one thread (the persist process's)."""

    CHUNK = 8 << 20
    """Bytes per write: large, and a multiple of every block size."""
    BLOCK = 4096
    """Alignment of offsets and lengths (the largest common logical block size)."""

    def __init__(self) -> None:
        self.supported = hasattr(os, "O_DIRECT")
        self._buf: mmap.mmap | None = None

    def write(self, path: Path, chunks: list[memoryview | bytes], phases: Phases) -> bool:
        """Write `chunks` to `path` (created or truncated) with O_DIRECT and fsync it;
        False, having written nothing, where the file system refuses O_DIRECT."""
        if not self.supported:
            return False
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_DIRECT
        try:
            fd = os.open(path, flags, 0o666)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self.supported = False
            return False
        try:
            with phases("write"):
                if not self._write(fd, chunks):
                    self.supported = False
                    return False
            with phases("fsync"):
                os.fsync(fd)  # the data is on the device; this flushes metadata and cache
        finally:
            os.close(fd)
        return True

    def _write(self, fd: int, chunks: list[memoryview | bytes]) -> bool:
        if self._buf is None:
            self._buf = mmap.mmap(-1, self.CHUNK)  # anonymous: page-aligned
        with memoryview(self._buf) as buf:
            return self._fill(fd, buf, chunks)

    def _fill(self, fd: int, buf: memoryview, chunks: list[memoryview | bytes]) -> bool:
        at = filled = 0
        for chunk in chunks:
            data = memoryview(chunk).cast("B")
            while len(data):
                n = min(len(data), self.CHUNK - filled)
                buf[filled:filled + n] = data[:n]
                filled, data = filled + n, data[n:]
                if filled == self.CHUNK:
                    if not self._pwrite(fd, buf, at):
                        return False
                    at, filled = at + filled, 0
        if filled:
            padded = -(-filled // self.BLOCK) * self.BLOCK
            buf[filled:padded] = bytes(padded - filled)
            if not self._pwrite(fd, buf[:padded], at):
                return False
            os.ftruncate(fd, at + filled)  # the padding was never the file's
        return True

    @staticmethod
    def _pwrite(fd: int, data: memoryview, at: int) -> bool:
        """Write all of `data` at `at`; False on the first EINVAL (O_DIRECT refused
        only now: some file systems accept the flag and fail the write)."""
        done = 0
        while done < len(data):
            try:
                n = os.pwrite(fd, data[done:], at + done)
            except OSError as e:
                if e.errno == errno.EINVAL and at == 0 and done == 0:
                    return False
                raise
            if n <= 0:
                raise OSError(f"pwrite wrote {n} bytes")
            done += n
        return True
