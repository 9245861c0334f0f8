"""Level 1: a snapshot of one rank's state in node-local shared memory.

Each rank owns three preallocated slots (triple buffering: one being written, one being
persisted, one holding the newest complete snapshot for recovery) under

    /dev/shm/moc-<job>/rank-<r>/slot-<i>.bin     the tensor bytes, 8-byte aligned
    /dev/shm/moc-<job>/rank-<r>/slot-<i>.json    header: step, offsets, dtypes, digests

A slot's header is removed before the slot is overwritten and written (atomically, by
rename) only after every byte is copied and checksummed, so a header exists exactly when
the slot holds a complete snapshot. Each tensor's digest (XXH3) is taken while it is
copied, half a megabyte at a time right behind the copy (the bytes are still in the CPU's cache),
so a snapshot reads the state once and writes the slot once.

The files live in shared memory, not in a process: they survive the crash of the
training process that wrote them, and a restarted rank reads them back. The slot files
are mapped once and reused: no allocation per checkpoint once warm.

The copy is run by the snapshot worker (`twolevel.worker`) on a background thread;
this module only owns the slots: their files, mappings and headers.

Trust: whatever is in a job's directory is loaded into the model (snapshots) and names
the persist process's socket and secret, so only this user may be able to write there.
Directories are created 0700 and files 0600; a directory that already exists is used
only if it is a real directory (not a symbolic link), owned by this user and not
writable by group or others (`secure_dir`), and files are opened without following
symbolic links. See docs/THREAT_MODEL.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moc.checkpoint.errors import CheckpointError
from moc.checkpoint.liveness import ProcessId, boot_id, pid_namespace
from moc.checkpoint.phases import Phases
from moc.checkpoint.store.format import CHECKSUM, Digest, digest, tensor_bytes
from moc.checkpoint.store.storage import Storage, open_storage
from moc.checkpoint.twolevel.nodes import node_memory_root

try:  # the one compiled part of moc, optional (setup.py): where it is missing, numpy copies
    from moc.checkpoint.twolevel import streamcopy
except ImportError:  # pragma: no cover - a build without a C compiler
    streamcopy = None


shm_root = node_memory_root

N_SLOTS = 3
"""Snapshot, persist and recovery roles rotate over three slots (the paper's triple
buffer): a complete snapshot always exists while the next one is being taken."""
ALIGN = 8
"""Every tensor of a slot starts at a multiple of this (snapshots and replicas alike)."""
COPY_CHUNK = 512 << 10
"""Bytes copied per step of the fused copy, each digested while in cache: small enough
that a chunk stays in the core's L2 cache (1 MiB here) between the digest and the copy
(one pass over memory, not two), large enough that the loop's own cost (about a
microsecond a chunk) stays well under 1% of the copy's. Measured (one thread, CPU time,
431 MB of float32 tensors, copy then digest): with XXH3 13.9 GB/s, against 13.3 in 256
KiB chunks and 12.3 in 1 MiB ones; with CRC32C 10.9, 10.7 and 9.9. Streamed (STREAMING,
400 MB, another VM, four interleaved runs): 4.3-5.3 GB/s at every size from 256 KiB to 2
MiB, 3.8-4.5 at 4 MiB."""
STREAMING = bool(streamcopy is not None and streamcopy.NONTEMPORAL)
"""Whether the snapshot's copy uses streaming (non-temporal) stores (`streamcopy.c`: x86-64
with the extension built). Then each chunk is digested from the source, which brings it
into cache, and streamed to the slot, which is never read back: 2 bytes of memory
traffic per byte copied instead of 3, and the copy evicts nothing of training's. 212 MB,
one thread, CPU time, 512 KiB chunks, on a VM whose memcpy runs at 7-8 GB/s: 5.0-5.4 GB/s
against 3.8-4.3 for numpy's copy then the digest of the destination."""
DTYPE_NAMES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool)}


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


@dataclass(frozen=True)
class SlotEntry:
    offset: int
    dtype: str
    shape: tuple[int, ...]
    crc: int
    """The digest (`format.CHECKSUM`, XXH3) of the tensor's bytes alone."""


@dataclass(frozen=True)
class SnapshotHeader:
    step: int
    entries: dict[str, SlotEntry]
    meta: dict[str, Any]
    """What the checkpointer needs to resume from this snapshot (loop state, token
    ledger, policy state)."""

    def to_json(self) -> str:
        return json.dumps({"step": self.step, "meta": self.meta, "checksum": CHECKSUM,
                           "entries": {k: [e.offset, e.dtype, list(e.shape), e.crc]
                                       for k, e in self.entries.items()}})

    @classmethod
    def from_json(cls, text: str) -> SnapshotHeader:
        """ValueError for a header of another checksum (a snapshot an older moc left in
        memory, with CRC32Cs or zlib CRC32s): it is then no recovery source, storage is."""
        d = json.loads(text)
        if d.get("checksum") != CHECKSUM:
            raise ValueError(f"snapshot checksums are {d.get('checksum')!r}, not {CHECKSUM}")
        return cls(int(d["step"]), {k: SlotEntry(int(o), str(t), tuple(s), int(c))
                                    for k, (o, t, s, c) in d["entries"].items()}, d["meta"])


SLOT_SLACK = 64 << 10
"""Bytes a slot is reserved beyond its first snapshot (and 1/256 of its size more). A
state's size is not fixed to the byte: the optimizer's param groups travel as JSON whose
length follows the learning rate's digits (1535 bytes at one step, 1583 at the next).
A slot sized exactly was
reallocated, remapped and faulted in again (51k page faults for 211 MB) whenever that
happened, and every free slot with it: most of a checkpoint's CPU time before issue 15."""


def slot_capacity(size: int) -> int:
    """The bytes a slot is reserved at for a snapshot of `size`: SLOT_SLACK and 1/256
    more, in whole pages (a larger snapshot later grows the slot, once)."""
    if not size:
        return 0
    return -(-(size + SLOT_SLACK + size // 256) // mmap.PAGESIZE) * mmap.PAGESIZE


def slot_layout(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, int], int]:
    """Where each tensor lies in a slot (in order, each at a multiple of ALIGN), and the
    bytes they need."""
    offsets, size = {}, 0
    for key, t in tensors.items():
        offsets[key] = size
        n = t.numel() * t.element_size()
        size += n + (-n % ALIGN)
    return offsets, size


class SnapshotStore:
    """The slots of one rank; written by that rank, read by its persist process and by
    the rank after a restart."""

    def __init__(self, job: str, rank: int, n_slots: int = N_SLOTS, name: str | None = None
                 ) -> None:
        """`n_slots` and `name` (the directory under the job's, default `rank-<r>`) let
        other holders of snapshots reuse the slot discipline: a peer's replicas
        (`twolevel.replica.ReplicaStore`)."""
        if n_slots < 1:
            raise ValueError(f"n_slots must be >= 1, got {n_slots}")
        if name is not None and (not name or "/" in name or name in (".", "..")):
            raise ValueError(f"name must be one directory name (no '/'), got {name!r}")
        self.job = job
        self.dir = job_dir(job) / (name if name is not None else f"rank-{rank:05d}")
        self.rank = rank
        self.n_slots = n_slots
        self._checked = False  # the directories passed `secure_dir` (see `_secure`)
        self._maps: dict[int, torch.Tensor] = {}
        self._inodes: dict[int, int] = {}  # the file each mapping maps
        self._pinned: set[int] = set()
        self._reserved = -1  # the slot size every free slot has been reserved at

    def sizes(self) -> dict[str, int]:
        """Shared memory held by this rank's slots (`ckpt_host_bytes`) and one snapshot's
        size (`snapshot_bytes`): the first is bounded by `n_slots` times the second."""
        sizes = [p.stat().st_size for p in map(self.bin_path, range(self.n_slots))
                 if p.exists()]
        return {"ckpt_host_bytes": sum(sizes), "snapshot_bytes": max(sizes, default=0)}

    def bin_path(self, slot: int) -> Path:
        return self.dir / f"slot-{slot}.bin"

    def header_path(self, slot: int) -> Path:
        return self.dir / f"slot-{slot}.json"

    def _map(self, slot: int, size: int, allocate: bool = False) -> torch.Tensor:
        """The slot's bytes as a shared mapping, kept for reuse. A writer (`allocate`)
        gets a mapping of at least `size` bytes: the slot's file is sized to
        `slot_capacity(size)` and its pages reserved up front (tmpfs allocates lazily,
        and a full /dev/shm would otherwise kill the process with SIGBUS mid-copy instead
        of failing here with ENOSPC); a slot that is already large enough is used as it
        is. A reader maps the file as it is (`size`: its length), never resizing it."""
        buf = self._maps.get(slot)
        if buf is not None and (buf.numel() >= size if allocate else buf.numel() == size):
            return buf
        self._unmap(slot)
        self._secure(create=True)
        path = self.bin_path(slot)
        if allocate:
            size = self._reserve(path, size)
        buf = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
        self._maps[slot] = buf
        self._inodes[slot] = path.stat().st_ino
        return buf

    def _reserve(self, path: Path, size: int) -> int:
        """Make the slot file `path` at least `size` bytes with every page of it reserved
        (allocated in the file system, not merely within its length); its length.

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
            want = st.st_size if st.st_size >= size else slot_capacity(size)
            try:
                if want:
                    # Sizes the file too. Trusted when it succeeds, whatever st_blocks
                    # says later (a compressing file system may count fewer blocks).
                    os.posix_fallocate(fd, 0, want)
            except OSError as e:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, 0)
                raise CheckpointError(
                    f"cannot reserve {want / 1e6:.1f} MB for a snapshot in {self.dir}: "
                    f"{e.strerror}; give the node more shared memory (e.g. docker "
                    "--shm-size) or point MOC_SHM_ROOT at a larger tmpfs") from None
            return want
        finally:
            os.close(fd)

    def _unmap(self, slot: int) -> None:
        buf = self._maps.pop(slot, None)
        if buf is not None and slot in self._pinned:
            torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
        self._pinned.discard(slot)

    def _secure(self, create: bool) -> bool:
        """Check (once) that the job's and this rank's directories are this user's
        alone, creating them if `create`; False when they do not exist (and not
        `create`): there is nothing to read."""
        if not self._checked:
            if not create and not self.dir.exists():
                return False
            try:
                secure_job_dir(self.job)
                secure_dir(self.dir)
            except OSError as e:  # a full /dev/shm (ENOSPC), a read-only one
                raise CheckpointError(
                    f"cannot create the snapshot directory {self.dir}: {e.strerror or e}; "
                    "give the node more shared memory (e.g. docker --shm-size) or point "
                    "MOC_SHM_ROOT at a larger tmpfs") from None
            self._checked = True
        return True

    def release(self) -> None:
        """Drop every mapping (and its pinned registration); the files stay."""
        for slot in list(self._maps):
            self._unmap(slot)

    def invalidate_newer_than(self, step: int) -> None:
        """Forget snapshots newer than `step`: after restoring `step`, they belong to a
        run that will not continue and must never be combined with the new one."""
        for slot, header in self.headers().items():
            if header.step > step:
                self.header_path(slot).unlink(missing_ok=True)

    def _pin(self, slot: int, buf: torch.Tensor) -> None:
        """Register a slot's mapping with CUDA once, so device-to-host copies into it
        are asynchronous (pinned) rather than staged through pageable memory."""
        if slot in self._pinned or buf.numel() == 0:
            return
        rc = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 0)
        if int(rc) == 0:  # else: copies still work, synchronously
            self._pinned.add(slot)

    def headers(self) -> dict[int, SnapshotHeader]:
        """Complete snapshots by slot (a slot without a readable header is not one)."""
        out: dict[int, SnapshotHeader] = {}
        for slot in range(self.n_slots):
            header = self.header(slot)
            if header is not None:
                out[slot] = header
        return out

    def header(self, slot: int) -> SnapshotHeader | None:
        """The header of `slot` if it holds a complete snapshot, else None."""
        if not self._secure(create=False):
            return None
        try:
            return SnapshotHeader.from_json(self.header_path(slot).read_text())
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def write(self, slot: int, step: int, tensors: dict[str, torch.Tensor],
              meta: dict[str, Any], ready: Any = None,
              sizing: dict[str, torch.Tensor] | None = None,
              phases: Phases | None = None) -> SnapshotHeader:
        """Copy `tensors` into `slot` and publish its header. Blocks until done.

        CPU tensors are copied a chunk at a time, each chunk's digest taken right
        behind it. GPU tensors are copied on a side stream that first waits for `ready`
        (a CUDA event recorded on the training stream when the checkpoint was
        requested), into the slot's mapping registered as pinned memory, so the copies
        are asynchronous DMA that overlaps the next forward and backward; their
        checksums follow, from host memory. `phases` gets "reserve" (the slot's memory:
        a one-time cost), "copy" (with the digests, on a CPU), "checksum" (on a GPU)
        and "header".
        """
        phases = phases if phases is not None else Phases()
        self.header_path(slot).unlink(missing_ok=True)  # the slot is now incomplete
        # Laid out for the whole state (`sizing`), so that partial snapshots of different
        # experts reuse the slot as it is instead of resizing it.
        offsets, size = slot_layout(sizing if sizing is not None else tensors)
        with phases("reserve"):
            buf = self._map(slot, size, allocate=True)
            self._reserve_free_slots(size)
        device = next((t.device for t in tensors.values() if t.is_cuda), None)
        versions = {key: _version(t) for key, t in tensors.items()}  # before any byte is read
        if device is None:
            with phases("copy"):
                crcs = copy_and_checksum(buf, offsets, tensors)
        else:
            # The current device is per thread, and this runs on the snapshot thread:
            # name the rank's device, or a rank on cuda:1 would pin, make its stream and
            # copy against cuda:0, and synchronize a stream its copies never ran on.
            with torch.cuda.device(device), phases("copy"):
                views = self._copy_gpu(slot, buf, offsets, tensors, ready)
            with phases("checksum"):
                crcs = {key: digest(tensor_bytes(v)) for key, v in views.items()}
        changed = [key for key, t in tensors.items() if _version(t) != versions[key]]
        if changed:
            raise StateChangedError(step, changed)
        entries = {key: SlotEntry(offsets[key], str(t.dtype).removeprefix("torch."),
                                  tuple(t.shape), crcs[key]) for key, t in tensors.items()}
        header = SnapshotHeader(step, entries, meta)
        with phases("header"):
            try:
                write_private(self.header_path(slot), header.to_json())  # complete from here
            except OSError as e:  # the slot is reserved, its header is a new file: ENOSPC
                raise CheckpointError(
                    f"cannot write the header of the snapshot of step {step} in {self.dir}: "
                    f"{e.strerror or e}; give the node more shared memory (e.g. docker "
                    "--shm-size) or point MOC_SHM_ROOT at a larger tmpfs") from None
        return header

    def _copy_gpu(self, slot: int, buf: torch.Tensor, offsets: dict[str, int],
                  tensors: dict[str, torch.Tensor], ready: Any) -> dict[str, torch.Tensor]:
        """Copy every tensor to its offset in `buf` (inside the rank's device context):
        a side stream that waits for `ready`, into the pinned mapping, and a wait for
        that stream before returning; the slot's views of them."""
        self._pin(slot, buf)
        stream = torch.cuda.Stream()
        if ready is not None:
            stream.wait_event(ready)
        views = {}
        with torch.cuda.stream(stream):
            for key, t in tensors.items():
                n = t.numel() * t.element_size()
                dst = buf[offsets[key]:offsets[key] + n]
                if n:
                    dst.view(t.dtype).view(t.shape).copy_(t.detach(), non_blocking=True)
                views[key] = dst
        stream.synchronize()  # blocks this (background) thread until the DMA is done
        return views

    def _reserve_free_slots(self, size: int) -> None:
        """Reserve every other slot for snapshots of this size once, before the first
        copy: a node short of shared memory then fails at the first checkpoint, not
        hours later when a slow persist first needs the third slot, and later snapshots
        never pay for allocation. A slot holding a complete snapshot (a recovery source)
        is left as it is."""
        if 0 <= size <= self._reserved:
            return
        headers = self.headers()
        for slot in range(self.n_slots):
            if slot not in headers:
                self._map(slot, size, allocate=True)
        self._reserved = slot_capacity(size)

    def read(self, slot: int, header: SnapshotHeader, verify: bool = True,
             keys: list[str] | None = None) -> dict[str, torch.Tensor]:
        """Views of a complete snapshot's tensors (checked against their digests), or of
        those of `keys` alone."""
        self._secure(create=False)
        st = self.bin_path(slot).stat()
        if self._inodes.get(slot) != st.st_ino:  # a new file (a reader keeps its maps)
            self._unmap(slot)
        buf = self._map(slot, st.st_size)
        out = {}
        for key in header.entries if keys is None else keys:
            e = header.entries[key]
            dtype = DTYPE_NAMES[e.dtype]
            n = torch.Size(e.shape).numel() * torch.empty((), dtype=dtype).element_size()
            raw = buf[e.offset:e.offset + n]
            if verify and digest(tensor_bytes(raw)) != e.crc:
                raise CheckpointError(f"snapshot {self.dir}/slot-{slot} step {header.step}: "
                                      f"checksum mismatch for {key!r}")
            out[key] = raw.view(dtype).view(e.shape)
        return out


class StateChangedError(CheckpointError):
    """The state was changed in place while its snapshot was being copied: the copy
    holds some of each version, so it is discarded (its header is never written)."""

    def __init__(self, step: int, keys: list[str]) -> None:
        few = ", ".join(repr(k) for k in sorted(keys)[:3])
        more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
        super().__init__(
            f"the state changed while the snapshot of step {step} was being copied "
            f"({few}{more} modified in place), so the snapshot was discarded; call "
            "wait_for_snapshot() before anything that changes parameters, optimizer "
            "state or buffers in place (optimizer.step() waits by itself)")
        self.step, self.keys = step, keys


def _version(t: torch.Tensor) -> int | None:
    """`t`'s version counter: every in-place change of a tensor, or of a view of its
    storage made through torch (the optimizer's foreach updates too), increments it, and
    a view shares its base's. None for an inference tensor, which keeps none."""
    try:
        return t._version
    except RuntimeError:
        return None


def copy_and_checksum(buf: torch.Tensor, offsets: dict[str, int],
                      tensors: dict[str, torch.Tensor], algo: str = CHECKSUM,
                      streaming: bool | None = None) -> dict[str, int]:
    """Copy CPU tensors to their offsets in `buf`, COPY_CHUNK bytes at a time, each
    chunk's digest (XXH3) taken while it is in cache; the digest of each tensor's bytes.
    Both the copy and the digest release the GIL. (`algo`, `streaming`: another checksum
    or copy, for the benchmarks' comparisons.)

    With `streaming` (by default STREAMING), each chunk is digested from the source and then
    streamed to the slot. Without, numpy copies it and the digest reads the copy: numpy,
    not torch, because a slice and an assignment cost numpy a fraction of torch's
    per-call overhead (which made chunks this small slower than 1 MiB ones). Either way
    the copy runs on the calling thread alone, so it keeps the snapshot thread's
    scheduling class instead of going to torch's intra-op threads."""
    streaming = STREAMING if streaming is None else streaming
    if streaming and (streamcopy is None or not streamcopy.NONTEMPORAL):
        raise ValueError("copy_and_checksum: streaming copies need moc's streamcopy extension "
                         "on x86-64 (moc.checkpoint.twolevel.slots.STREAMING is False here)")
    dst = buf.numpy() if buf.numel() else np.empty(0, dtype=np.uint8)
    mem = memoryview(dst)
    crcs = {}
    for key, t in tensors.items():
        src = t.detach()
        n = src.numel() * src.element_size()
        at, d = offsets[key], Digest(algo)
        if n:
            if src.device.type != "cpu":  # another accelerator than CUDA: via the host
                src = src.cpu()
            flat = src.contiguous().reshape(-1).view(torch.uint8).numpy()
            if streaming:
                raw = memoryview(flat)
                for i in range(0, n, COPY_CHUNK):
                    j = min(n, i + COPY_CHUNK)
                    d.update(raw[i:j])
                    streamcopy.copy(mem[at + i:at + j], raw[i:j])
            else:
                for i in range(0, n, COPY_CHUNK):
                    j = min(n, i + COPY_CHUNK)
                    dst[at + i:at + j] = flat[i:j]
                    d.update(mem[at + i:at + j])
        crcs[key] = d.value
    return crcs


OWNER = "owner.json"
"""In a job's directory: the process whose life its snapshots belong to
(`liveness.ProcessId`)."""
LEGACY_OWNER = "owner.pid"
"""An older moc's owner record: the pid alone, taken to be of this PID namespace."""


def claim_job(job: str) -> Path:
    """Rank 0, at the start of a job: remove the snapshot directories of dead jobs, create
    this job's (or check the one a restart finds: `secure_job_dir`) and record its owner:
    the process whose life the snapshots belong to, which under torchrun is the agent (it
    outlives restarts of the workers).

    Refuses (CheckpointError) a job directory whose owner still runs and is neither this
    process nor its parent: another job with the same job id (`job=`), whose snapshots
    this one would overwrite and whose persist process it would replace; and, with one
    line naming the root and what to do, a shared memory with no room for the claim (a
    full /dev/shm), leaving no directory of its own behind."""
    existed = os.path.lexists(job_dir(job))
    try:
        return _claim(job)
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


def _claim(job: str) -> Path:
    """`claim_job`'s work; OSError when the shared memory cannot hold it."""
    jdir = secure_job_dir(job)
    remove_stale_jobs(keep=job)
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


def remove_stale_jobs(keep: str) -> list[Path]:
    """Delete snapshot directories of jobs whose owner is provably gone (a finished or
    abandoned job: `liveness.ProcessId.gone`). `keep` (this job) is never touched: it
    may be our recovery source. Nor is a directory of another user or a symbolic link,
    nor one whose owner runs in another PID namespace (a container sharing this
    /dev/shm, with `--ipc=host`: its pids are not visible here, so it only looks gone):
    not ours to judge."""
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
        elif time.time() - st.st_mtime < STALE_AFTER_S:
            # No owner record: a directory being set up right now, or not ours; only
            # remove it when it has been left alone for a while.
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed


STALE_AFTER_S = 3600
"""A snapshot directory without a live owner record is stale after an hour untouched."""
