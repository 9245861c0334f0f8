"""DTensor layouts: where this rank's piece of a tensor lies in the whole, and which ranks
hold the same piece.

FSDP2 (`fully_shard`) turns every parameter into a DTensor `Shard(0)` over its mesh;
expert parallelism as torchtitan does it keeps an `[E, ...]` expert tensor as a DTensor
`Shard(0)` over the expert-parallel mesh dimension (`_StridedShard(0)` where a data-parallel
dimension shards it again); tensor parallelism is `Shard(d)`. A save writes each rank's
local piece under the tensor's stable key with its box as a suffix, and a restore on any
layout reads the slices it needs (docs/FORMAT.md, "Pieces"):

    param/layers.0.attn.wq.weight@64,0      rows 64.. of the global tensor, as a rank holds
    optim/layers.0.attn.wq.weight/exp_avg@64,0
    param/layers.1.moe.experts.w1/expert=5  expert 5, whole (the EP shard holds experts)

Nothing here communicates: every rank computes every box of every tensor from the
DTensor's mesh and placements, so the write plan (which rank writes a piece several ranks
hold) is the same everywhere. A layout that is not a grid of boxes (a `_StridedShard`
whose local rows are not contiguous) and a `Partial` placement are refused with
`UnsupportedLayoutError`, naming the tensor and its placements.

When an engine is built the ranks exchange, once, what each holds (`report`: its own
boxes, or its refusal of the layout) and each computes the verdict from the same list
(`agreed_placements`): the same placements on every rank, or the same one-line error
raised on every rank, never one rank raising while its peers wait in a collective.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def is_instance_of_loaded(obj: object, module: str, name: str) -> bool:
    """Whether `obj` is an instance of class `name` of `module`, without importing it:
    an object can be one only once its module is imported. torch.distributed.tensor,
    fsdp and optim imported with moc took 1.3 s of every moc process's start (`moc
    --help`, each rank, each persist process) on the 2-core VM, for the many models and
    optimizers that are neither DTensors, FSDP2 modules nor ZeRO."""
    cls = getattr(sys.modules.get(module), name, None)
    return cls is not None and isinstance(obj, cls)


def is_dtensor(t: object) -> bool:
    return is_instance_of_loaded(t, "torch.distributed.tensor", "DTensor")


class UnsupportedLayoutError(ValueError):
    """A tensor's distributed layout that moc cannot save as boxes of the whole."""


@dataclass(frozen=True, order=True)
class Box:
    """A rectangular part of a tensor: `shape` elements from `offsets` on, per dimension."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    @classmethod
    def whole(cls, shape: Iterable[int]) -> Box:
        shape = tuple(shape)
        return cls((0,) * len(shape), shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def suffix(self) -> str:
        """The key suffix naming this box: `@` and its offsets (`@64,0`)."""
        return "@" + ",".join(map(str, self.offsets))

    def index(self) -> tuple[slice, ...]:
        """This box as an index into the tensor it lies in."""
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.shape, strict=True))

    def within(self, outer: Box) -> tuple[slice, ...]:
        """This box as an index into `outer`'s own tensor (it lies inside `outer`)."""
        return tuple(slice(o - p, o - p + n) for o, p, n
                     in zip(self.offsets, outer.offsets, self.shape, strict=True))

    def intersect(self, other: Box) -> Box | None:
        """The part both boxes cover; None when they do not meet."""
        lo = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets, strict=True))
        hi = tuple(min(a + n, b + m) for a, n, b, m in zip(
            self.offsets, self.shape, other.offsets, other.shape, strict=True))
        if any(h <= x for x, h in zip(lo, hi, strict=True)):
            return None
        return Box(lo, tuple(h - x for x, h in zip(lo, hi, strict=True)))


_SUFFIX = re.compile(r"@(\d+(?:,\d+)*)$")


def split_key(key: str) -> tuple[str, tuple[int, ...] | None]:
    """(the key without its box suffix, the suffix's offsets; None for a whole tensor)."""
    m = _SUFFIX.search(key)
    if m is None:
        return key, None
    return key[:m.start()], tuple(int(x) for x in m.group(1).split(","))


def logical_key(key: str) -> str:
    """The stable key of the tensor a (piece) key belongs to."""
    return split_key(key)[0]


@dataclass(frozen=True)
class Sharding:
    """How one DTensor's global tensor is spread over the job's ranks."""

    global_shape: tuple[int, ...]
    pieces: tuple[tuple[Box, tuple[int, ...]], ...]
    """Every distinct non-empty box and the global ranks holding it, in box order."""
    mine: Box
    """This rank's box (its local tensor)."""
    empty: tuple[int, ...] = ()
    """The global ranks that hold nothing of it: a dimension smaller than the ranks it is
    sharded over (FSDP2 on a `Linear(D, 1)` over 2 ranks: rank 0 holds the whole weight,
    rank 1 a 0-row piece)."""

    @property
    def whole(self) -> bool:
        """Every rank holds the whole tensor (replicated): saved under its plain key, as
        a plain tensor is. The same answer on every rank: a tensor that one rank holds
        whole and another not at all is sharded, though that rank's piece is the whole."""
        return (not self.empty and len(self.pieces) == 1
                and self.pieces[0][0].shape == self.global_shape)

    def suffix(self, box: Box) -> str:
        """The key suffix of `box`: none for the whole tensor."""
        return "" if box.shape == self.global_shape else box.suffix()


def _describe(t: DTensor) -> str:
    mesh = t.device_mesh
    names = f" {mesh.mesh_dim_names}" if mesh.mesh_dim_names else ""
    return f"placements {tuple(t.placements)} on a mesh of shape {tuple(mesh.shape)}{names}"


def sharding_of(name: str, t: torch.Tensor) -> Sharding | None:
    """The layout of `t` (named `name` in errors) when it is a DTensor, else None.
    Raises UnsupportedLayoutError for a Partial placement (a sum not yet reduced: no rank
    holds the value) or a layout whose local pieces are not boxes of the whole."""
    if not is_dtensor(t):
        return None
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    for p in t.placements:
        if not isinstance(p, Shard | _StridedShard | Replicate):
            raise UnsupportedLayoutError(
                f"{name}: {_describe(t)}: moc saves Shard, _StridedShard and Replicate "
                f"placements only "
                f"({type(p).__name__} holds no value on any one rank); redistribute it to "
                "Replicate or Shard before the checkpointer is built")
    mesh = t.device_mesh
    if mesh.mesh.dim() and mesh.get_coordinate() is None:
        raise UnsupportedLayoutError(f"{name}: this rank is not in its mesh ({_describe(t)})")
    sharding = sharding_on(tuple(t.shape), tuple(t.placements), tuple(mesh.mesh.shape),
                           tuple(mesh.mesh.flatten().tolist()), tuple(mesh.get_coordinate()))
    if sharding is None:
        raise UnsupportedLayoutError(
            f"{name}: {_describe(t)}: its local pieces are not contiguous boxes of the "
            "global tensor (a strided shard whose rows interleave); shard it with plain "
            "Shard placements, or shard the expert-parallel dimension last")
    local = tuple(t.to_local().shape)
    if local != sharding.mine.shape:
        raise UnsupportedLayoutError(
            f"{name}: {_describe(t)}: the local tensor is {local}, its placements say "
            f"{sharding.mine.shape}")
    return sharding


@functools.lru_cache(maxsize=4096)
def sharding_on(global_shape: tuple[int, ...], placements: tuple, mesh_shape: tuple[int, ...],
                ranks: tuple[int, ...], me: tuple[int, ...]) -> Sharding | None:
    """Every box of a tensor of `global_shape` laid out by `placements` on a mesh of
    `mesh_shape` whose coordinates hold `ranks` (row-major), as the rank at coordinate
    `me` sees them (`sharding_of`, pure: no DTensor, no process group); None when the
    boxes do not tile the tensor. All but `mine` is the same at every coordinate.
    Cached: the parameters of a model share a few layouts, and a plan asks for each at
    every checkpoint."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    holders: dict[Box, list[int]] = {}
    empty: list[int] = []
    mine = None
    for i, coord in enumerate(itertools.product(*(range(n) for n in mesh_shape))):
        shape, offsets = _compute_local_shape_and_global_offset(
            global_shape, mesh_shape, list(coord), placements)
        box = Box(tuple(offsets), tuple(shape))
        if coord == me:
            mine = box
        if box.numel:
            holders.setdefault(box, []).append(ranks[i])
        else:
            empty.append(ranks[i])
    assert mine is not None, "a rank in the mesh has a coordinate"
    if not tiles(global_shape, holders):
        return None
    return Sharding(global_shape, tuple((b, tuple(r)) for b, r in sorted(holders.items())),
                    mine, tuple(sorted(empty)))


def tiles(global_shape: tuple[int, ...], boxes: Iterable[Box]) -> bool:
    """Whether `boxes` (non-empty, distinct) cover a tensor of `global_shape` exactly, as
    the product of one partition of each dimension: Shard placements cut a tensor into
    such a grid, and a strided shard whose rows interleave does not."""
    boxes = list(boxes)
    if len(set(boxes)) != len(boxes):  # a piece twice: another one is missing
        return False
    if sum(b.numel for b in boxes) != math.prod(global_shape):
        return False
    for d, n in enumerate(global_shape):
        spans = sorted({(b.offsets[d], b.shape[d]) for b in boxes})
        at = 0
        for o, size in spans:
            if o != at:
                return False
            at = o + size
        if at != n:
            return False
    grid = math.prod(len({(b.offsets[d], b.shape[d]) for b in boxes})
                     for d in range(len(global_shape)))
    return grid == len(boxes)


Placed = tuple[tuple[Box, tuple[int, ...]], ...]
"""Every distinct non-empty piece of a tensor, and the global ranks holding it."""


def report(tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """What this rank tells the others of its layout (plain data, for a collective): the
    box of each DTensor among `tensors` sharded over the ranks, as [offsets, shape, global
    shape]. Raises what `sharding_of` raises; `refusal` reports that instead."""
    pieces = {}
    for name, t in tensors:
        sharding = sharding_of(name, t)
        if sharding is not None and not sharding.whole:
            pieces[name] = [list(sharding.mine.offsets), list(sharding.mine.shape),
                            list(sharding.global_shape)]
    return {"pieces": pieces, "refused": None}


def refusal(error: ValueError) -> dict[str, Any]:
    """The report of a rank that refuses its layout (or another argument): `error`'s
    class name and message, raised on every rank by `agreed_placements`."""
    return {"pieces": {}, "refused": [type(error).__name__, str(error)]}


def agreed_placements(reports: Sequence[dict[str, Any]]) -> dict[str, Placed]:
    """Every piece of each DTensor sharded over the ranks, and the ranks that hold it,
    from every rank's `report` (in rank order); the same on every rank, as is what it
    raises: ValueError (UnsupportedLayoutError when that was the reason) when a rank
    refused, when a tensor is sharded on some ranks only, or when the pieces the ranks
    hold do not tile it. One line, naming the ranks where they differ."""
    refused = [(r, tuple(rep["refused"])) for r, rep in enumerate(reports) if rep["refused"]]
    if refused:
        kinds = {kind for _, (kind, _) in refused}
        cls = UnsupportedLayoutError if UnsupportedLayoutError.__name__ in kinds else ValueError
        by_message: dict[str, list[int]] = {}
        for r, (_, message) in refused:
            by_message.setdefault(message, []).append(r)
        if len(by_message) == 1 and len(refused) == len(reports):  # every rank alike
            raise cls(next(iter(by_message)))
        raise cls("; ".join(f"{_ranks(rs)}: {m}" for m, rs in by_message.items()))
    out: dict[str, Placed] = {}
    for name in dict.fromkeys(n for rep in reports for n in rep["pieces"]):
        missing = [r for r, rep in enumerate(reports) if name not in rep["pieces"]]
        if missing:
            have = [r for r in range(len(reports)) if r not in missing]
            raise UnsupportedLayoutError(
                f"{name} is a DTensor sharded over the ranks on {_ranks(have)} but not on "
                f"{_ranks(missing)}; build the same layout on every rank")
        shapes = [tuple(rep["pieces"][name][2]) for rep in reports]
        if len(set(shapes)) != 1:
            raise UnsupportedLayoutError(
                f"{name}: the ranks hold pieces of tensors of different shapes "
                f"({', '.join(f'rank {r}: {s}' for r, s in enumerate(shapes))}); build "
                "the same model on every rank")
        held: dict[Box, list[int]] = {}
        for r, rep in enumerate(reports):
            offsets, shape, _ = rep["pieces"][name]
            box = Box(tuple(offsets), tuple(shape))
            if box.numel:  # a rank holding nothing of it (1 row over 2 ranks) writes none
                held.setdefault(box, []).append(r)
        if not tiles(shapes[0], held):
            raise UnsupportedLayoutError(
                f"{name}: the pieces the ranks hold do not tile its {shapes[0]}; build the "
                "same layout on every rank")
        out[name] = tuple((b, tuple(r)) for b, r in sorted(held.items()))
    return out


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds of `t`: its local piece when it is a DTensor."""
    return t.to_local() if is_dtensor(t) else t


def extent(boxes: Iterable[Box]) -> tuple[int, ...]:
    """The shape of the smallest tensor holding every box (the whole, when they tile it)."""
    ends = [tuple(o + n for o, n in zip(b.offsets, b.shape, strict=True)) for b in boxes]
    return tuple(max(c) for c in zip(*ends, strict=True)) if ends and ends[0] else ()


def piece_index(shapes: Iterable[tuple[str, tuple[int, ...]]]
                ) -> dict[str, list[tuple[str, Box]]]:
    """Stable key -> every stored piece of that tensor (its key and box), from the
    (key, shape) of what a checkpoint holds: a key without a suffix is the whole tensor."""
    out: dict[str, list[tuple[str, Box]]] = {}
    for key, shape in shapes:
        base, offsets = split_key(key)
        box = Box(offsets, tuple(shape)) if offsets is not None else Box.whole(shape)
        if len(box.offsets) == len(box.shape):
            out.setdefault(base, []).append((key, box))
    return out
