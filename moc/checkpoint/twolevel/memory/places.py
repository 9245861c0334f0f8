"""Where each of a snapshot's tensors lies in a slot: pure, no file or mapping.

    offsets, size = slot_layout(tensors)   # in order, each at a multiple of ALIGN
    layout = SlotLayout.of(tensors)        # the same, kept (a cached flatten's places)
    view = SlotView.at(buf, offset, dtype, shape)   # a mapping's bytes at one place

The slots (`twolevel.memory.slots`) keep files, mappings and headers; a replica's slots lay
their tensors out the same way (`twolevel.replicas.replica`).
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

import numpy as np
import torch

ALIGN = 8
"""Every tensor of a slot starts at a multiple of this (snapshots and replicas alike)."""
DTYPE_NAMES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool)}
"""A slot header's dtype names, and the dtypes they stand for."""


def slot_layout(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, int], int]:
    """Where each tensor lies in a slot (in order, each at a multiple of ALIGN), and the
    bytes they need."""
    offsets, size = {}, 0
    for key, t in tensors.items():
        offsets[key] = size
        n = t.numel() * t.element_size()
        size += n + (-n % ALIGN)
    return offsets, size


@dataclass(frozen=True)
class SlotView:
    """Where one tensor lies in an open slot, and the slot's memory there: `raw` (its
    bytes, what a checksum reads) and `typed` (the same bytes with the tensor's dtype
    and shape, what a copy writes). Kept by the store (`open`): `buffer` is made once."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    raw: torch.Tensor
    typed: torch.Tensor

    @classmethod
    def at(cls, buf: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple[int, ...]
           ) -> SlotView:
        """The view of `buf` (a slot's mapping) at `offset` for a tensor of `dtype`, `shape`."""
        n = torch.Size(shape).numel() * dtype.itemsize
        raw = buf[offset:offset + n]
        return cls(offset, dtype, shape, raw, raw.view(dtype).view(shape))

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    @functools.cached_property
    def buffer(self) -> np.ndarray:
        """`raw` as the native copies and checksums take it; once made, reading it over
        a snapshot's views (`operator.attrgetter`) costs no Python call per tensor."""
        return as_bytes(self.raw)


_OFFSET, _DTYPE, _SHAPE = (operator.attrgetter(a) for a in ("offset", "dtype", "shape"))


@dataclass(frozen=True, eq=False)
class SlotLayout:
    """Where a state's tensors lie in a slot laid out for `size` bytes (`keys[i]` at
    `offsets[i]`, of `dtypes[i]`, `shapes[i]`): made once per cached flatten
    (`twolevel.snapshot.state_cache`), so that opening a slot is not a Python loop over a
    thousand tensors. A partial snapshot opens a `pick`: the whole state's places."""

    keys: list[str]
    offsets: list[int]
    dtypes: list[torch.dtype]
    shapes: list[tuple[int, ...]]
    size: int
    """The bytes the whole layout needs (each tensor at a multiple of ALIGN)."""

    @classmethod
    def of(cls, tensors: dict[str, torch.Tensor]) -> SlotLayout:
        """The layout of `tensors`, in order (`slot_layout`)."""
        offsets, size = slot_layout(tensors)
        return cls(list(tensors), list(offsets.values()), [t.dtype for t in tensors.values()],
                   [tuple(t.shape) for t in tensors.values()], size)

    def pick(self, index: list[int]) -> SlotLayout:
        """The tensors at `index`, in their places in the whole layout."""
        take = [self.keys, self.offsets, self.dtypes, self.shapes]
        return SlotLayout(*[list(map(part.__getitem__, index)) for part in take], self.size)

    def placed(self, views: list[SlotView]) -> bool:
        """Whether `views` (one per key) are this layout's places (C-level passes)."""
        return (list(map(_OFFSET, views)) == self.offsets
                and list(map(_DTYPE, views)) == self.dtypes
                and list(map(_SHAPE, views)) == self.shapes)


def as_bytes(raw: torch.Tensor) -> np.ndarray:
    """A uint8 tensor's memory as a buffer (an empty one has none to export)."""
    return raw.numpy() if raw.numel() else np.empty(0, dtype=np.uint8)
