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

import functools
import json
import operator
import os
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from moc.checkpoint.errors import CheckpointError
from moc.checkpoint.phases import Phases
from moc.checkpoint.store.format import CHECKSUM
from moc.checkpoint.twolevel.memory import native
from moc.checkpoint.twolevel.memory.places import SlotView
from moc.checkpoint.twolevel.memory.slots import SlotEntry, SnapshotHeader, SnapshotStore
from moc.checkpoint.twolevel.snapshot.tensors import (
    SnapshotTensors,
    TensorList,
    entry_fragment,
    host_bytes,
)

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
        takes them from the slot). `tensors` is a `TensorList` when the engine's cache
        made it: what is derived from it may then be kept on it."""
        ...


_BUFFER = operator.attrgetter("buffer")
_TYPED = operator.attrgetter("typed")


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
        dsts = list(map(_BUFFER, views))  # kept on each view: one C-level pass
        srcs = (tensors.host_arrays() if isinstance(tensors, TensorList)
                else [host_bytes(t) for t in tensors])
        if self.fused:
            return native.copy_and_digest(dsts, srcs, self.threads)
        native.copy_all(dsts, srcs, self.threads)
        return None


class DeviceCopy:
    """Device-to-host copies of one CUDA device's tensors, on a stream of the engine's
    own, into pinned slots (CPU tensors among them, such as AdamW's `step`, are copied by
    the host meanwhile). Owner: the snapshot thread (the stream is used by it alone).

    The copies are issued in one call (`torch._foreach_copy_`: the GIL released once,
    not four Python calls per tensor), after the stream waits for `ready`; the thread
    then sleeps on an event recorded behind them (a blocking event: it never spins)."""

    def __init__(self, device: torch.device) -> None:
        self.pin = device
        self.stream = torch.cuda.Stream(device)

    def copy(self, views: list[SlotView], tensors: list[torch.Tensor], ready: Any
             ) -> list[int] | None:
        held = tensors if isinstance(tensors, TensorList) else TensorList(tensors)
        on, off, dev, host = held.by_device()  # kept on a cached list: made once
        # The current device and stream are per thread: name them here, or the copies
        # would go to cuda:0's default stream and wait for everything training queued.
        with torch.cuda.device(self.pin), torch.cuda.stream(self.stream):
            if ready is not None:
                self.stream.wait_event(ready)
            if dev:
                _copy_all_async(list(map(_TYPED, map(views.__getitem__, on))), dev)
            landed = torch.cuda.Event(blocking=True)
            landed.record(self.stream)
        if host:  # while the copy engine works
            HostCopy(fused=False).copy(list(map(views.__getitem__, off)), host, None)
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
    tensors: SnapshotTensors
    views: list[SlotView]
    """Where each tensor of `tensors` landed, in its order (`SnapshotTensors.keys`)."""
    digests: list[int] | None
    """The checksums the copy took on the way (in `views`' order), else None."""
    prepared: bool = True
    """Whether the slot was ready before (else the capture reserved, mapped or pinned it:
    a one-time cost, in its "reserve" phase)."""

    @property
    def nbytes(self) -> int:
        tail = self.views[len(self.tensors.picked.tensors):]
        return self.tensors.picked.nbytes + sum(v.nbytes for v in tail)


def capture(store: SnapshotStore, copier: Copier, slot: int, step: int,
            tensors: dict[str, torch.Tensor] | SnapshotTensors, ready: Any = None,
            sizing: dict[str, torch.Tensor] | None = None,
            phases: Phases | None = None) -> Captured:
    """Copy `tensors` into `slot` (its header removed first); blocks until every byte
    has landed. StateChangedError when a tensor was changed in place meanwhile: the
    copy then holds some of each version, and is never sealed. `tensors`: the engine's
    cached `SnapshotTensors`, or a dict laid out as `sizing` lays it out (default: as
    it is). `phases` gets "reserve" (the slot's memory, when `prepare` had not made it
    ready) and "copy".

    The cached tensors and the tail go in two copies: the first's lists are the same
    objects at every snapshot, so what the copier derives from them is made once."""
    phases = phases if phases is not None else Phases()
    snap = (tensors if isinstance(tensors, SnapshotTensors)
            else SnapshotTensors.of_dict(tensors, sizing))
    picked, tail = snap.picked.tensors, TensorList(snap.tail.values())
    with phases("reserve"):
        views, tail_views, prepared = store.open(slot, snap.picked.layout, snap.tail)
    before = picked.versions() + tail.versions()  # before any byte is read
    with phases("copy"):
        found = copier.copy(views, picked, ready)
        if tail:
            more = copier.copy(tail_views, tail, ready)
            found = None if found is None or more is None else found + more
    after = picked.versions() + tail.versions()
    if after != before:
        raise StateChangedError(step, [key for key, a, b in zip(snap.keys, before, after,
                                                                  strict=True) if a != b])
    return Captured(slot, step, snap, views + tail_views, found, prepared)


def seal(store: SnapshotStore, captured: Captured, meta: dict[str, Any],
         threads: int = 1, phases: Phases | None = None) -> SnapshotHeader:
    """Take the checksums the copy did not (on `threads` native threads, the GIL
    released once) and publish the slot's header: from here on it is a complete
    snapshot. `phases` gets "checksum" and "header"."""
    phases = phases if phases is not None else Phases()
    stall = float(os.environ.get(SEAL_STALL_ENV, "0"))
    if stall > 0:
        time.sleep(stall)
    with phases("checksum"):
        crcs = captured.digests
        if crcs is None:
            crcs = native.digests(list(map(_BUFFER, captured.views)), threads)
    header = SealedHeader(captured, crcs, meta)
    with phases("header"):
        store.publish(captured.slot, header)
    return header


class SealedHeader(SnapshotHeader):
    """The header of a snapshot just sealed, made from its cached layout: its JSON is
    the layout's entries (`Picked.fragments`, made once) joined with the checksums in
    one C-level pass, and its `entries`, which sealing never reads, are made only when
    read (a replica round, `k_snapshot="auto"`): a SlotEntry per tensor per snapshot,
    and a dict of lists per tensor for its JSON, were a thousand Python calls each at
    every seal of the gpu-400m preset. Read back from its file it is a plain
    `SnapshotHeader`, the same, field for field (`tests/checkpoint/twolevel`)."""

    def __init__(self, captured: Captured, crcs: list[int], meta: dict[str, Any]) -> None:
        # Not the dataclass's __init__: `entries` is made when read (below). The places
        # are kept, not the views: a header may outlive the slot's mapping.
        snap, layout = captured.tensors, captured.tensors.picked.layout
        tail = captured.views[len(snap.picked.tensors):]
        tail_places = [(v.offset, v.dtype, v.shape) for v in tail]
        fragments = [entry_fragment(k, *place) for k, place in zip(snap.tail, tail_places,
                                                                    strict=True)]
        for name, value in (("step", captured.step), ("meta", meta), ("_crcs", crcs),
                            ("_keys", snap.keys),
                            ("_places", (layout.offsets + [p[0] for p in tail_places],
                                         layout.dtypes + [p[1] for p in tail_places],
                                         layout.shapes + [p[2] for p in tail_places])),
                            ("_fragments", snap.picked.fragments + fragments)):
            object.__setattr__(self, name, value)

    @functools.cached_property
    def entries(self) -> dict[str, SlotEntry]:  # type: ignore[override]
        offsets, dtypes, shapes = self._places
        return {k: SlotEntry(o, str(d).removeprefix("torch."), s, crc) for k, o, d, s, crc
                in zip(self._keys, offsets, dtypes, shapes, self._crcs, strict=True)}

    def to_json(self) -> str:
        head = json.dumps({"step": self.step, "meta": self.meta, "checksum": CHECKSUM})
        body = "], ".join(map(str.__add__, self._fragments, map(str, self._crcs)))
        return f'{head[:-1]}, "entries": {{{body}{"]" if body else ""}}}}}'


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


def _copy_all_async(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """Issue every copy on the current stream in one call where torch can
    (`_foreach_copy_`; across devices it loops in C++, the GIL released), else one
    `copy_` per tensor."""
    with torch.no_grad():  # a parameter's view may require grad; its copy never does
        try:
            torch._foreach_copy_(dsts, srcs, non_blocking=True)
        except (AttributeError, RuntimeError, TypeError):  # an older torch, or a refusal
            for d, s in zip(dsts, srcs, strict=True):
                d.copy_(s, non_blocking=True)
