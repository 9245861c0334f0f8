"""What one snapshot copies, in the form the capture takes it, made once per layout.

    picked = Picked.of(layout, tensors)    # the tensors, their places, their header's JSON
    snap = SnapshotTensors(picked, tail)   # + the few tensors made anew for each snapshot

A snapshot of the gpu-400m preset copies about a thousand tensors, and everything the
snapshot thread derived from them per snapshot in Python (a version counter before and
after, a numpy view of each source and destination, a header entry) cost it a Python
call or more per tensor, per snapshot, holding the GIL the training thread needs to
launch its kernels (on an H200 forward and backward took 152 ms to launch with a
snapshot in flight, 112 ms without). None of it changes while the state keeps its
tensors: a `Picked` is made once per cached layout (`twolevel.snapshot.state_cache`) and given to
every snapshot of it, and what a copy derives from its tensors is kept on its
`TensorList`. Per snapshot there remain a few C-level passes over cached lists
(`operator.attrgetter` through `map`) and the tail: the param groups' JSON, the RNG
states and the buffers taken at `save()`, a handful of tensors.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from moc.checkpoint.twolevel.memory.places import SlotLayout, as_bytes

_VERSION = operator.attrgetter("_version")
_IS_CUDA = operator.attrgetter("is_cuda")


def version(t: torch.Tensor) -> int | None:
    """`t`'s version counter: every in-place change of a tensor, or of a view of its
    storage made through torch (the optimizer's foreach updates too), increments it, and
    a view shares its base's. None for an inference tensor, which keeps none."""
    try:
        return t._version
    except RuntimeError:
        return None


def host_bytes(t: torch.Tensor) -> np.ndarray:
    """The bytes of `t` in host memory, C-contiguous (a strided view is made contiguous;
    another accelerator's tensor is copied to the host first). A contiguous tensor of a
    dtype numpy has is exported as it is: three calls, where the general path's six
    took 17 us a tensor, 10.6 ms of held GIL per snapshot of `bench`'s 610 tensors."""
    src = t.detach()
    if src.device.type == "cpu" and src.dtype in _NUMPY_DTYPES and src.is_contiguous():
        return src.numpy()
    if src.device.type != "cpu":
        src = src.cpu()
    return as_bytes(src.contiguous().reshape(-1).view(torch.uint8))


_NUMPY_DTYPES = frozenset((torch.float64, torch.float32, torch.float16, torch.int64,
                           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool))
"""The dtypes whose tensors `Tensor.numpy()` exports as they are (not bfloat16)."""


def _in_place(t: torch.Tensor) -> bool:
    """Whether `host_bytes(t)` views `t`'s own memory (a contiguous host tensor), so that
    it can be made once and read at every later copy; else it is a copy made per copy."""
    return t.device.type == "cpu" and t.is_contiguous()


class TensorList(list):
    """A snapshot's tensors, in slot order, with what the copies derive from them kept
    (their host bytes, which are on a device): a cached `Picked` hands the capture the
    same list snapshot after snapshot, so each is made once. Never changed once made. A
    copier handed a plain list derives the same each time."""

    def __init__(self, tensors: Iterable[torch.Tensor] = ()) -> None:
        super().__init__(tensors)
        self._host: list[np.ndarray] | None = None
        self._per_copy: list[int] = []  # where host bytes are a copy, made at each copy
        self._split: tuple[list[int], list[int], TensorList, TensorList] | None = None

    def versions(self) -> list[int | None]:
        """Every tensor's version counter, in one C-level pass (`version` per tensor
        where one is an inference tensor)."""
        try:
            return list(map(_VERSION, self))
        except RuntimeError:
            return [version(t) for t in self]

    def host_arrays(self) -> list[np.ndarray]:
        """`host_bytes` of every tensor: those that view the tensor's memory made once,
        the others (a strided view, a device's tensor) at each call."""
        if self._host is None:
            in_place = [_in_place(t) for t in self]
            self._host = [host_bytes(t) if i else as_bytes(torch.empty(0, dtype=torch.uint8))
                          for t, i in zip(self, in_place, strict=True)]
            self._per_copy = [i for i, ok in enumerate(in_place) if not ok]
        if not self._per_copy:
            return self._host
        out = list(self._host)
        for i in self._per_copy:
            out[i] = host_bytes(self[i])
        return out

    def by_device(self) -> tuple[list[int], list[int], TensorList, TensorList]:
        """(positions of the CUDA tensors, positions of the others, the CUDA tensors, the
        others), made once: a device copy issues the first in one call and copies the
        second (AdamW's `step` scalars, kept on the host) on the host meanwhile."""
        if self._split is None:
            cuda = list(map(_IS_CUDA, self))
            on = [i for i, c in enumerate(cuda) if c]
            off = [i for i, c in enumerate(cuda) if not c]
            self._split = (on, off, TensorList(map(self.__getitem__, on)),
                           TensorList(map(self.__getitem__, off)))
        return self._split


def entry_fragment(key: str, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> str:
    """The JSON of `key`'s header entry up to its checksum, as `SnapshotHeader.to_json`
    writes it: made once per layout, a sealed header's JSON is then these joined with
    the checksums in one C-level pass (`capture.SealedHeader`)."""
    name = str(dtype).removeprefix("torch.")
    return f"{json.dumps(key)}: [{offset}, {json.dumps(name)}, {json.dumps(list(shape))}, "


@dataclass(frozen=True, eq=False)
class Picked:
    """Tensors a snapshot copies (`tensors`, in the order of `layout`: their places in
    the whole state's slot layout), with their header entries' JSON up to the checksum
    (`fragments`) and their bytes. Made once per layout and selection of experts
    (`state_cache.StateLayout.pick`), or per call for a plain dict (`of_dict`)."""

    layout: SlotLayout
    tensors: TensorList
    fragments: list[str]
    nbytes: int

    @classmethod
    def of(cls, layout: SlotLayout, tensors: Iterable[torch.Tensor]) -> Picked:
        held = tensors if isinstance(tensors, TensorList) else TensorList(tensors)
        assert len(held) == len(layout.keys), "one tensor per place"
        places = zip(layout.keys, layout.offsets, layout.dtypes, layout.shapes, strict=True)
        fragments = [entry_fragment(*place) for place in places]
        nbytes = sum(torch.Size(s).numel() * d.itemsize
                     for d, s in zip(layout.dtypes, layout.shapes, strict=True))
        return cls(layout, held, fragments, nbytes)


@dataclass(frozen=True, eq=False)
class SnapshotTensors:
    """What one snapshot copies: `picked` (cached, laid out from the slot's start) and
    `tail` (the tensors made anew for this snapshot, laid out after the whole state's
    layout: `SnapshotStore.open`)."""

    picked: Picked
    tail: dict[str, torch.Tensor]

    @classmethod
    def of_dict(cls, tensors: dict[str, torch.Tensor],
                sizing: dict[str, torch.Tensor] | None = None) -> SnapshotTensors:
        """`tensors` laid out as `sizing` lays them (the whole state; default `tensors`),
        made for this call alone (tools, tests, drills: the engine caches its layout)."""
        layout = SlotLayout.of(sizing if sizing is not None else tensors)
        if sizing is not None:
            where = {key: i for i, key in enumerate(layout.keys)}
            layout = layout.pick([where[key] for key in tensors])
        return cls(Picked.of(layout, tensors.values()), {})

    @property
    def keys(self) -> list[str]:
        """Every key it copies, in slot order."""
        return self.picked.layout.keys + list(self.tail)
