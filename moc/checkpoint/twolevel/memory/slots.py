"""Level 1: the slots that hold one rank's snapshots in node-local shared memory.

Each rank owns three preallocated slots (triple buffering: one being written, one being
persisted, one holding the newest complete snapshot for recovery) under

    /dev/shm/moc-<job>/rank-<r>/slot-<i>.bin     the tensor bytes, 8-byte aligned
    /dev/shm/moc-<job>/rank-<r>/slot-<i>.json    header: step, offsets, dtypes, digests

A slot's header is removed when the slot is opened for a new snapshot (`open`) and
written (atomically, by rename) only when the snapshot is sealed (`publish`): after
every byte has landed and been checksummed. So a header exists exactly when the slot
holds a complete snapshot, and a process killed at any moment in between leaves the
previous sealed snapshot, in another slot, as the newest one.

This module owns the slots alone: their files, mappings, views, pinning and headers.
Filling them is the capture's (`twolevel.snapshot.capture`: the copies, then the seal), run by the
snapshot thread (`twolevel.snapshot.worker`). The files live in shared memory, not in a process:
they survive the crash of the training process that wrote them, and a restarted rank
reads them back. They are reserved, faulted in and (for a GPU) pinned once, before the
first snapshot that needs them (`prepare`), and mapped once: no allocation, page fault or
registration per checkpoint once warm. The job's directory and its trust rules:
`twolevel.memory.jobdir`.
"""

from __future__ import annotations

import functools
import json
import logging
import mmap
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moc.checkpoint.errors import CheckpointError
from moc.checkpoint.store.format import CHECKSUM
from moc.checkpoint.twolevel.memory.jobdir import (
    job_dir,
    reserve,
    secure_dir,
    secure_job_dir,
    write_private,
)
from moc.checkpoint.twolevel.memory.native import digests
from moc.checkpoint.twolevel.memory.places import (
    ALIGN,
    DTYPE_NAMES,
    SlotLayout,
    SlotView,
    as_bytes,
)

log = logging.getLogger(__name__)

N_SLOTS = 3
"""Snapshot, persist and recovery roles rotate over three slots (the paper's triple
buffer): a complete snapshot always exists while the next one is being taken."""


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
A slot sized exactly was reallocated, remapped and faulted in again (51k page faults for
211 MB) whenever that happened, and every free slot with it: most of a checkpoint's CPU
time before issue 15."""


def slot_capacity(size: int) -> int:
    """The bytes a slot is reserved at for a snapshot of `size`: SLOT_SLACK and 1/256
    more, in whole pages (a larger snapshot later grows the slot, once)."""
    if not size:
        return 0
    return -(-(size + SLOT_SLACK + size // 256) // mmap.PAGESIZE) * mmap.PAGESIZE


VIEW_LAYOUTS = 64
"""Layouts whose views a slot's mapping keeps: one for complete snapshots, one per
selection of experts for partial ones (a rotation of N/K selections)."""


class PinError(CheckpointError):
    """A slot could not be registered with CUDA as pinned memory."""


class SnapshotStore:
    """The slots of one rank; written by that rank, read by its persist process and by
    the rank after a restart. Owner: the snapshot thread writes (`prepare`, `open`,
    `publish`); readers (recovery, the persist process) hold stores of their own."""

    def __init__(self, job: str, rank: int, n_slots: int = N_SLOTS, name: str | None = None,
                 pin: torch.device | None = None) -> None:
        """`n_slots` and `name` (the directory under the job's, default `rank-<r>`) let
        other holders of snapshots reuse the slot discipline: a peer's replicas
        (`twolevel.replicas.replica.ReplicaStore`). `pin`: the CUDA device whose copies fill the
        slots; every slot mapped for writing is registered with it as pinned memory, so
        that device-to-host copies into it are asynchronous DMA at the copy engine's
        speed (55 GB/s on an H200, against 13 for pageable memory)."""
        if n_slots < 1:
            raise ValueError(f"n_slots must be >= 1, got {n_slots}")
        if name is not None and (not name or "/" in name or name in (".", "..")):
            raise ValueError(f"name must be one directory name (no '/'), got {name!r}")
        self.job = job
        self.dir = job_dir(job) / (name if name is not None else f"rank-{rank:05d}")
        self.rank = rank
        self.n_slots = n_slots
        self.pin = pin
        self._checked = False  # the directories passed `secure_dir` (see `_secure`)
        self._maps: dict[int, torch.Tensor] = {}
        self._inodes: dict[int, int] = {}  # the file each mapping maps
        self._pinned: set[int] = set()
        self._writable: set[int] = set()  # mappings made ready for writing (`_map`)
        self._views: dict[int, dict[int, tuple[SlotLayout, list[SlotView]]]] = {}
        """Per mapping: the views of each layout opened in it (by the layout's id; the
        layout is kept with them, so that its id is not reused meanwhile)."""
        self._reserved = -1  # the slot size every free slot has been prepared at

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

    # -- the writer: prepare, open, publish ------------------------------------------------

    def prepare(self, size: int, stop: Callable[[], bool] | None = None) -> None:
        """Make every slot that holds no snapshot ready for snapshots of `size` bytes, once
        per size: reserved in shared memory, mapped, faulted in and, for a GPU, pinned. A
        slot holding a complete snapshot (a recovery source) keeps its bytes and size: it
        is only pinned (for a GPU), so that the capture that later overwrites it is
        asynchronous DMA like any other (a restore from memory maps those slots to read
        them, unpinned: before issue 45 they stayed so, and every copy into them was
        pageable, about 4x slower, without a word).

        Done ahead of the snapshots that need it (the engine calls it on the snapshot
        thread after the first optimizer step, when the state's size is known), because
        done at a snapshot it was the snapshot's cost: 8.8, 4.9 and 4.9 s for the first
        three checkpointed steps of a 773M-parameter model on an H200, against a 0.39 s
        step. It also makes a node short of shared memory fail at the start, not hours
        later when a slow persist first needs the third slot. `stop`: asked before each
        slot; true ends the preparation there (an engine let go meanwhile), unfinished."""
        if 0 <= size <= self._reserved:
            return
        headers = self.headers()
        for slot in range(self.n_slots):
            if stop is not None and stop():
                return
            if slot not in headers:
                self._map(slot, size, allocate=True)
            elif self.pin is not None:  # pinning locks its pages; it writes none
                held = self._maps.get(slot)
                self._pin(slot, held if held is not None
                          else self._map(slot, self.bin_path(slot).stat().st_size))
        self._reserved = slot_capacity(size)

    def open(self, slot: int, layout: SlotLayout, tail: dict[str, torch.Tensor] | None = None
             ) -> tuple[list[SlotView], list[SlotView], bool]:
        """Open `slot` for a new snapshot: its header is removed (from here on it is no
        recovery source), its memory prepared (`prepare`), and the places of the tensors
        `layout` holds and of `tail` (a few tensors made anew for each snapshot, laid out
        after the whole state's `layout.size`) returned, with whether the slot was ready
        before (prepared: nothing to reserve, map or pin for it).

        The views of a layout are made once per mapping and kept: a cached layout (the
        same object at every snapshot) gets the same list back, checked in a few C-level
        passes (`SlotLayout.placed`), not made and compared one tensor at a time."""
        self.header_path(slot).unlink(missing_ok=True)
        places, size = [], layout.size
        for t in (tail or {}).values():
            n = t.numel() * t.element_size()
            places.append((size, t.dtype, tuple(t.shape)))
            size += n + (-n % ALIGN)
        held = self._maps.get(slot)
        ready = held is not None and held.numel() >= size and slot in self._writable
        buf = self._map(slot, size, allocate=True)
        self.prepare(size)
        cache = self._views.setdefault(slot, {})
        kept = cache.get(id(layout))
        if kept is None or kept[0] is not layout or not layout.placed(kept[1]):
            views = list(map(functools.partial(SlotView.at, buf), layout.offsets,
                             layout.dtypes, layout.shapes))
            if len(cache) >= VIEW_LAYOUTS:  # a rotation of partial snapshots: bounded
                cache.pop(next(iter(cache)))
            kept = cache[id(layout)] = (layout, views)
        return kept[1], [SlotView.at(buf, *place) for place in places], ready

    def publish(self, slot: int, header: SnapshotHeader) -> None:
        """Write `slot`'s header: from here on it holds a complete snapshot."""
        try:
            write_private(self.header_path(slot), header.to_json())
        except OSError as e:  # the slot is reserved, its header is a new file: ENOSPC
            raise CheckpointError(
                f"cannot write the header of the snapshot of step {header.step} in "
                f"{self.dir}: {e.strerror or e}; give the node more shared memory (e.g. "
                "docker --shm-size) or point MOC_SHM_ROOT at a larger tmpfs") from None

    # -- mappings --------------------------------------------------------------------------

    def _map(self, slot: int, size: int, allocate: bool = False) -> torch.Tensor:
        """The slot's bytes as a shared mapping, kept for reuse. A writer (`allocate`)
        gets a mapping of at least `size` bytes: the slot's file is sized to
        `slot_capacity(size)` and its pages reserved up front (tmpfs allocates lazily,
        and a full /dev/shm would otherwise kill the process with SIGBUS mid-copy instead
        of failing here with ENOSPC), faulted in and pinned (`pin`); a slot that is
        already large enough is used as it is. A reader maps the file as it is (`size`:
        its length), never resizing it.

        A reader's mapping that a writer then asks for (a restore from memory read the
        slot, the next capture overwrites it) is made ready for writing once: its pages
        reserved and, for a GPU, pinned."""
        buf = self._maps.get(slot)
        if buf is not None and (buf.numel() >= size if allocate else buf.numel() == size):
            if allocate and slot not in self._writable:
                try:
                    reserve(self.bin_path(slot), buf.numel(), slot_capacity(buf.numel()), self.job)
                except CheckpointError:  # the file may be truncated: never touch the map
                    self._unmap(slot)
                    raise
                self._ready_for_writing(slot, buf)
            return buf
        self._unmap(slot)
        self._secure(create=True)
        path = self.bin_path(slot)
        if allocate:
            size = reserve(path, size, slot_capacity(size), self.job)
        buf = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
        self._maps[slot] = buf
        self._inodes[slot] = path.stat().st_ino
        if allocate:
            self._ready_for_writing(slot, buf)
        return buf

    def _ready_for_writing(self, slot: int, buf: torch.Tensor) -> None:
        """Pin a mapping that copies will fill (faulting every page in, as it locks it),
        or, with no GPU to pin for, fault it in."""
        if self.pin is not None:
            self._pin(slot, buf)
        else:
            _fault_in(buf)
        self._writable.add(slot)

    def _unmap(self, slot: int) -> None:
        buf = self._maps.pop(slot, None)
        self._views.pop(slot, None)
        if buf is not None and slot in self._pinned:
            unregister_host(buf)
        self._pinned.discard(slot)
        self._writable.discard(slot)

    def _pin(self, slot: int, buf: torch.Tensor) -> None:
        """Register a slot's mapping with CUDA, so device-to-host copies into it are
        asynchronous DMA rather than staged through pageable memory. A registration that
        fails is said loudly, once per store, and the copies go on pageable (about 4x
        slower); never silently."""
        if slot in self._pinned or buf.numel() == 0:
            return
        assert self.pin is not None
        rc = register_host(buf, self.pin)
        if rc == 0:
            self._pinned.add(slot)
            return
        message = (f"could not pin the snapshot slot {self.bin_path(slot)} ({buf.numel() / 1e9:.2f}"
                   f" GB) for {self.pin}: cudaHostRegister returned {rc}. Copies into it are "
                   "pageable, about 4x slower (13 against 55 GB/s on an H200), so "
                   "snapshots may stall training. Usual causes: the locked-memory limit "
                   "(ulimit -l; a container's --ulimit memlock=-1), or a tmpfs that "
                   "cannot be registered (point MOC_SHM_ROOT at /dev/shm)")
        if not getattr(self, "_warned_pin", False):
            self._warned_pin = True
            log.warning("%s", message)
            warnings.warn(message, RuntimeWarning, stacklevel=2)

    @property
    def pinned(self) -> bool | None:
        """Whether every slot mapped for writing is pinned (None: no GPU to pin for)."""
        return None if self.pin is None else all(s in self._pinned for s in self._maps)

    def release(self) -> None:
        """Drop every mapping (and its pinned registration); the files stay."""
        for slot in list(self._maps):
            self._unmap(slot)

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

    def invalidate_newer_than(self, step: int) -> None:
        """Forget snapshots newer than `step`: after restoring `step`, they belong to a
        run that will not continue and must never be combined with the new one."""
        for slot, header in self.headers().items():
            if header.step > step:
                self.header_path(slot).unlink(missing_ok=True)

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

    def read(self, slot: int, header: SnapshotHeader, verify: bool = True,
             keys: list[str] | None = None, threads: int = 1) -> dict[str, torch.Tensor]:
        """Views of a complete snapshot's tensors (checked against their digests, in one
        native call on `threads` native threads: `native.digests`), or of those of `keys`
        alone."""
        self._secure(create=False)
        st = self.bin_path(slot).stat()
        if self._inodes.get(slot) != st.st_ino:  # a new file (a reader keeps its maps)
            self._unmap(slot)
        buf = self._map(slot, st.st_size)
        raw = {}
        for key in header.entries if keys is None else keys:
            e = header.entries[key]
            dtype = DTYPE_NAMES[e.dtype]
            n = torch.Size(e.shape).numel() * torch.empty((), dtype=dtype).element_size()
            raw[key] = buf[e.offset:e.offset + n]
        if verify:
            got = digests([as_bytes(r) for r in raw.values()], threads)
            for key, crc in zip(raw, got, strict=True):
                if crc != header.entries[key].crc:
                    raise CheckpointError(f"snapshot {self.dir}/slot-{slot} step "
                                          f"{header.step}: checksum mismatch for {key!r}")
        return {key: r.view(DTYPE_NAMES[header.entries[key].dtype]).view(
            header.entries[key].shape) for key, r in raw.items()}


def register_host(buf: torch.Tensor, device: torch.device) -> int:
    """Register `buf`'s memory with CUDA as pinned (page-locked) for `device`:
    cudaHostRegister's return code (0: pinned). The one place moc pins a mapping."""
    with torch.cuda.device(device):
        return int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 0))


def unregister_host(buf: torch.Tensor) -> None:
    """Undo `register_host` (before the mapping goes)."""
    torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())


def _fault_in(buf: torch.Tensor) -> None:
    """Map every page of a slot into this process by reading one byte of each: the
    first copy into it then pays no page fault (one per 4 KiB: 51k for 211 MB). Read,
    never written: the slot may hold a complete snapshot, a recovery source. numpy, on
    the calling thread: torch would spread it over its intra-op threads, which run at
    training's priority."""
    if buf.numel():
        np.add.reduce(buf.numpy()[::mmap.PAGESIZE], dtype=np.uint64)
