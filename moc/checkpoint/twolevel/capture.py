"""Filling a slot in two moments: captured, then sealed.

    copier = copier_for(device)           # HostCopy or DeviceCopy, one per engine
    captured = capture(store, copier, slot, step, tensors, ready, sizing, phases)
    ...                                   # captured: training may change the state again
    header = seal(store, captured, meta, phases)   # sealed: a recovery source from here

**Captured**: every byte of the state has landed in the slot and no tensor was changed in
place meanwhile (`StateChangedError` otherwise). This is all training waits for
(`wait_for_snapshot`, right before `optimizer.step()`). **Sealed**: the checksums are
taken and the header is published (`SnapshotStore.publish`); only now is the slot
restorable, persisted or replicated. A process killed between the two leaves the slot
without a header: the previous sealed snapshot, in another slot, stays the newest.

DCP's async staging has the same two moments (`staging_completion`, then the upload);
before this cut moc's were one, and on a GPU training waited for the checksums: a
4.6 GB snapshot copied in 0.085 s at 54 GB/s and was then hashed for 0.6 s on one thread.

The two paths go through the same seam:
- `HostCopy` (CPU tensors): by default the copy and the checksums are one pass
  (`native.copy_and_digest`: each chunk is hashed from the source, which brings it into
  cache, then streamed to the slot), so the seal only writes the header. On a CPU the
  copy runs on the cores training uses, and one pass over memory costs less than two.
- `DeviceCopy` (CUDA tensors): the copies run on the engine's own stream, which first
  waits for `ready` (an event the training stream recorded at `save()`), into pinned
  slots; the snapshot thread sleeps on an event until they land. The seal then hashes
  host memory on a few native threads in one call (`native.digests`), while training
  runs its next steps.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from moc.checkpoint.errors import CheckpointError
from moc.checkpoint.phases import Phases
from moc.checkpoint.twolevel import native
from moc.checkpoint.twolevel.slots import SlotEntry, SlotView, SnapshotHeader, SnapshotStore

SEAL_STALL_ENV = "MOC_SEAL_STALL_S"
"""Fault injection for tests and drills: the seal sleeps this long first, so that a
process can be killed between a snapshot's capture and its seal."""


class Copier(Protocol):
    """How a rank's tensors reach a slot (one per engine: it may own a CUDA stream)."""

    pin: torch.device | None
    """The CUDA device the slots must be pinned for (None: no device copies)."""

    def copy(self, views: list[SlotView], tensors: list[torch.Tensor], ready: Any
             ) -> list[int] | None:
        """Copy each tensor into its view; return when every byte has landed. The
        digests of the tensors when the copy took them on the way (else None: the seal
        takes them from the slot)."""
        ...


@dataclass(frozen=True)
class HostCopy:
    """Copies of CPU tensors (and of other accelerators', through the host).

    `fused`: take the checksums in the same pass as the copy (the default: on a CPU the
    capture then costs one read of the state, and the seal only writes the header).
    Without, the capture only copies and the seal hashes the slot: training waits for
    less, but the snapshot reads memory twice, on the same cores training uses.
    `threads`: native threads the copy runs on (1: the snapshot thread alone)."""

    fused: bool = True
    threads: int = 1
    pin: torch.device | None = None

    def copy(self, views: list[SlotView], tensors: list[torch.Tensor], ready: Any
             ) -> list[int] | None:
        dsts = [_bytes(v.raw) for v in views]
        srcs = [_host_bytes(t) for t in tensors]
        if self.fused:
            return native.copy_and_digest(dsts, srcs, self.threads)
        native.copy_all(dsts, srcs, self.threads)
        return None


class DeviceCopy:
    """Device-to-host copies of one CUDA device's tensors, on a stream of the engine's
    own, into pinned slots (CPU tensors among them, such as the RNG state, are copied by
    the host meanwhile). Owner: the snapshot thread (the stream is used by it alone).

    The copies are issued in one call (`torch._foreach_copy_`: the GIL released once,
    not four Python calls per tensor), after the stream waits for `ready`; the thread
    then sleeps on an event recorded behind them (a blocking event: it never spins)."""

    def __init__(self, device: torch.device) -> None:
        self.pin = device
        self.stream = torch.cuda.Stream(device)

    def copy(self, views: list[SlotView], tensors: list[torch.Tensor], ready: Any
             ) -> list[int] | None:
        dev = [(v.typed, t.detach()) for v, t in zip(views, tensors, strict=True) if t.is_cuda]
        host = [(v, t) for v, t in zip(views, tensors, strict=True) if not t.is_cuda]
        # The current device and stream are per thread: name them here, or the copies
        # would go to cuda:0's default stream and wait for everything training queued.
        with torch.cuda.device(self.pin), torch.cuda.stream(self.stream):
            if ready is not None:
                self.stream.wait_event(ready)
            if dev:
                _copy_all_async([d for d, _ in dev], [s for _, s in dev])
            landed = torch.cuda.Event(blocking=True)
            landed.record(self.stream)
        if host:  # while the copy engine works
            HostCopy(fused=False).copy([v for v, _ in host], [t for _, t in host], None)
        landed.synchronize()  # sleeps until the device-to-host copies have landed
        return None


CAPTURE_ENV = "MOC_CPU_CAPTURE"
"""How a CPU snapshot is captured: "fused" (the default: the checksums in the copy's one
pass) or "split" (copy, then the seal hashes the slot), for measuring one against the
other (docs/BENCHMARKS.md, issue 39)."""


def capture_mode() -> str:
    """The CAPTURE_ENV setting; ValueError for a value it does not know (checked when an
    engine is made, before it starts anything)."""
    mode = os.environ.get(CAPTURE_ENV, "fused")
    if mode not in ("fused", "split"):
        raise ValueError(f"{CAPTURE_ENV}={mode!r}: expected fused (the default) or split")
    return mode


def copier_for(device: torch.device | None, threads: int = 1) -> Copier:
    """The copier for a model on `device` (a CUDA device: `DeviceCopy`; else `HostCopy`,
    as CAPTURE_ENV says)."""
    if device is not None and device.type == "cuda":
        return DeviceCopy(device)
    return HostCopy(fused=capture_mode() == "fused", threads=threads)


@dataclass(frozen=True)
class Captured:
    """A snapshot whose bytes are all in its slot, not sealed yet."""

    slot: int
    step: int
    views: dict[str, SlotView]
    digests: list[int] | None
    """The checksums the copy took on the way (in `views`' order), else None."""
    prepared: bool = True
    """Whether the slot was ready before (else the capture reserved, mapped or pinned it:
    a one-time cost, in its "reserve" phase)."""

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self.views.values())


def capture(store: SnapshotStore, copier: Copier, slot: int, step: int,
            tensors: dict[str, torch.Tensor], ready: Any = None,
            sizing: dict[str, torch.Tensor] | None = None,
            phases: Phases | None = None) -> Captured:
    """Copy `tensors` into `slot` (its header removed first); blocks until every byte
    has landed. StateChangedError when a tensor was changed in place meanwhile: the
    copy then holds some of each version, and is never sealed. `phases` gets
    "reserve" (the slot's memory, when `prepare` had not made it ready) and "copy"."""
    phases = phases if phases is not None else Phases()
    with phases("reserve"):
        views, prepared = store.open(slot, tensors, sizing)
    versions = {key: _version(t) for key, t in tensors.items()}  # before any byte is read
    with phases("copy"):
        found = copier.copy(list(views.values()), list(tensors.values()), ready)
    changed = [key for key, t in tensors.items() if _version(t) != versions[key]]
    if changed:
        raise StateChangedError(step, changed)
    return Captured(slot, step, views, found, prepared)


def seal(store: SnapshotStore, captured: Captured, meta: dict[str, Any],
         threads: int = 1, phases: Phases | None = None) -> SnapshotHeader:
    """Take the checksums the copy did not (on `threads` native threads, the GIL
    released once) and publish the slot's header: from here on it is a complete
    snapshot. `phases` gets "checksum" and "header"."""
    phases = phases if phases is not None else Phases()
    stall = float(os.environ.get(SEAL_STALL_ENV, "0"))
    if stall > 0:
        time.sleep(stall)
    views = captured.views
    with phases("checksum"):
        crcs = captured.digests
        if crcs is None:
            crcs = native.digests([_bytes(v.raw) for v in views.values()], threads)
    entries = {key: SlotEntry(v.offset, str(v.dtype).removeprefix("torch."), v.shape, crc)
               for (key, v), crc in zip(views.items(), crcs, strict=True)}
    header = SnapshotHeader(captured.step, entries, meta)
    with phases("header"):
        store.publish(captured.slot, header)
    return header


def write_snapshot(store: SnapshotStore, slot: int, step: int,
                   tensors: dict[str, torch.Tensor], meta: dict[str, Any],
                   copier: Copier | None = None) -> SnapshotHeader:
    """Capture and seal in one call, on this thread: a complete snapshot of CPU tensors
    (tools, tests and drills; the engine runs the two apart)."""
    captured = capture(store, copier or HostCopy(), slot, step, tensors)
    return seal(store, captured, meta)


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


def _bytes(raw: torch.Tensor) -> np.ndarray:
    """A uint8 tensor's memory as a buffer (an empty one has none to export)."""
    return raw.numpy() if raw.numel() else np.empty(0, dtype=np.uint8)


def _host_bytes(t: torch.Tensor) -> np.ndarray:
    """The bytes of `t` in host memory, C-contiguous (a strided view is made contiguous;
    another accelerator's tensor is copied to the host first). A contiguous tensor of a
    dtype numpy has is exported as it is: three calls, where the general path's six
    took 17 us a tensor, 10.6 ms of held GIL per snapshot of `bench`'s 610 tensors."""
    src = t.detach()
    if src.device.type == "cpu" and src.dtype in _NUMPY_DTYPES and src.is_contiguous():
        return src.numpy()
    if src.device.type != "cpu":
        src = src.cpu()
    return _bytes(src.contiguous().reshape(-1).view(torch.uint8))


_NUMPY_DTYPES = frozenset((torch.float64, torch.float32, torch.float16, torch.int64,
                           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool))
"""The dtypes whose tensors `Tensor.numpy()` exports as they are (not bfloat16)."""


def _copy_all_async(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """Issue every copy on the current stream in one call where torch can
    (`_foreach_copy_`; across devices it loops in C++, the GIL released), else one
    `copy_` per tensor."""
    try:
        torch._foreach_copy_(dsts, srcs, non_blocking=True)
    except (AttributeError, RuntimeError, TypeError):  # an older torch, or a refusal
        for d, s in zip(dsts, srcs, strict=True):
            d.copy_(s, non_blocking=True)
