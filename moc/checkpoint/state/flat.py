"""A rank's parameters, persistent buffers and optimizer state under stable keys, and
back: flattened for a save (views, no copies; an expert tensor once per expert, a DTensor
as this rank's piece), and read back into the shapes this rank holds from the pieces a
checkpoint holds, whatever layout wrote them.

The one module of the package that reads the checkpoint's tensors themselves: `Reader`,
where they come from (a checkpoint on storage, a snapshot in memory), is defined here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from moc.checkpoint.errors import CorruptCheckpointError, IncompatibleCheckpointError
from moc.checkpoint.shards import Box, extent, is_dtensor, local, sharding_of, split_key
from moc.checkpoint.spec import (
    ExpertSpec,
    dense_key,
    expert_key,
    expert_modules,
    slices,
)


def persistent_buffers(model: nn.Module, spec: ExpertSpec) -> dict[str, torch.Tensor]:
    """The buffers `state_dict()` would save (persistent, not None), by their name in
    `named_buffers()`. Raises ValueError for one inside an expert module: its value
    differs between expert-parallel ranks, so it has no single dense key, and moc keys
    expert state by expert parameter only."""
    inside = expert_modules(spec)
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for mod_name, mod in model.named_modules():
        for b_name, b in mod._buffers.items():  # private, as state_dict() reads it
            if b is None or b_name in mod._non_persistent_buffers_set or id(b) in seen:
                continue
            seen.add(id(b))
            name = f"{mod_name}.{b_name}" if mod_name else b_name
            owner = next((m for m in inside if not m or mod_name == m
                          or mod_name.startswith(m + ".")), None)
            if owner is not None:
                raise ValueError(
                    f"persistent buffer {name!r} is inside the expert module {owner!r}: "
                    "moc checkpoints expert state per expert parameter, and a buffer of "
                    "an expert module has no key of its own. Keep it outside the expert "
                    "modules (a router's bias belongs to the router), or register it "
                    "with persistent=False and carry it in extra_state")
            out[name] = b
    return out


def default_model_meta(model: nn.Module, spec: ExpertSpec) -> dict[str, Any]:
    """What a checkpoint must match to be restored into `model`: expert geometry and
    the shapes of the non-expert parameters.

    Persistent buffers are not in it, on purpose: every checkpoint written before
    buffers were saved would then be refused. Each buffer is checked by its own key
    instead (a shape that does not fit is IncompatibleCheckpointError; a key the
    checkpoint lacks keeps the buffer's value, with a warning)."""
    experts = spec.by_name()
    return {"n_experts": spec.n_experts, "n_moe_layers": spec.n_moe_layers,
            "dense": {n: list(p.shape) for n, p in model.named_parameters()
                      if n not in experts}}


def piece_key(key: str, name: str, t: torch.Tensor) -> str:
    """`key` of the non-expert tensor `t` (named `name`) as this rank holds it: with the
    suffix of its piece when `t` is a DTensor that this rank holds part of."""
    sharding = sharding_of(name, t)
    return key + sharding.suffix(sharding.mine) if sharding is not None else key

Named = Sequence[tuple[str, torch.Tensor]]
"""A model's parameters by name (`RankState.named`, as the model held them when the
engine was built)."""


def flatten_params(named: Named, spec: ExpertSpec) -> dict[str, torch.Tensor]:
    """Every parameter of this process under its stable key(s) (of a DTensor, this rank's
    piece); views, no copies."""
    experts = spec.by_name()
    out = {}
    for name, p in named:
        if name in experts:
            for gid, t in slices(experts[name], p):
                if not _nothing(p, t):
                    out[experts[name].key("param", gid)] = t
        elif not _nothing(p, local(p)):
            out[piece_key(dense_key("param", name), name, p)] = local(p).detach()
    return out


def _nothing(t: torch.Tensor, held: torch.Tensor) -> bool:
    """Whether this rank holds nothing of the DTensor `t` (`held`: its piece, empty where
    the tensor does not divide among the ranks: 4 rows over 3 ranks are 2, 2 and 0).
    An empty piece is neither saved nor read."""
    return is_dtensor(t) and held.numel() == 0


def flatten_optimizer(states: dict[str, dict[str, torch.Tensor]], spec: ExpertSpec
                      ) -> dict[str, torch.Tensor]:
    """Optimizer state by parameter name -> stable keys. A scalar state of an expert
    tensor (AdamW's `step`) is stored once per expert, so each expert stands alone."""
    experts = spec.by_name()
    out = {}
    for name, state in states.items():
        for s_name, t in state.items():
            if not isinstance(t, torch.Tensor):
                t = torch.tensor(t)
            if name not in experts:
                key = dense_key("optim", name, s_name)
                if not _nothing(t, local(t)):
                    out[piece_key(key, name, t)] = local(t).detach()
                continue
            ep = experts[name]
            if t.dim() == 0:
                for gid in ep.global_ids:
                    out[expert_key("optim", ep.stem, gid, s_name)] = local(t).detach()
                continue
            for gid, piece in slices(ep, t):
                if not _nothing(t, piece):
                    out[ep.key("optim", gid, s_name)] = piece
    return out

class Reader(Protocol):
    """Where restored tensors come from: a checkpoint on storage, a snapshot in memory."""

    one_rank: bool
    """True when the reader holds one rank's pieces only (its snapshot in memory, or a
    peer's replica of it), not every rank's: the pieces it holds of a tensor then need
    not reach its whole shape, only fit inside it. A checkpoint on storage holds every
    rank's pieces, so there the pieces must span the whole shape exactly."""

    def __contains__(self, key: str) -> bool: ...

    def get(self, key: str) -> torch.Tensor: ...

    def state_names(self, prefix: str) -> list[str]:
        """Names of the optimizer state tensors stored under `prefix/` (a piece's name
        with its `@offsets` suffix)."""
        ...

    def pieces(self, key: str) -> list[tuple[str, Box]]:
        """Every stored piece of the tensor whose stable key is `key` (no suffix): its
        key and its box (the whole tensor for a key without a suffix)."""
        ...

Getter = Callable[[str], torch.Tensor]


def _fetch(get: Getter, key: str, like: torch.Tensor) -> torch.Tensor:
    t = get(key)
    if tuple(t.shape) != tuple(like.shape):
        raise IncompatibleCheckpointError(
            f"{key}: checkpoint shape {tuple(t.shape)} does not fit the model's "
            f"{tuple(like.shape)}")
    return t


def read_piece(reader: Reader, key: str, shape: tuple[int, ...],
               whole: tuple[int, ...] | None = None) -> torch.Tensor:
    """The tensor under `key` as this rank holds it, `shape` elements of a tensor of
    `whole` elements (default: `shape` for a key without a box): the stored tensor itself
    when the checkpoint holds that very key (the layout it was written with); otherwise
    the slice `key`'s box (its `@offsets` suffix; none: the whole tensor) cuts from the
    pieces the checkpoint holds of the same tensor, whatever layout wrote them
    (docs/FORMAT.md, "Pieces"). Only the pieces that meet the box are read.

    Raises IncompatibleCheckpointError when the stored tensor's shape is not `whole`
    (or the box does not fit it), CorruptCheckpointError when the pieces that meet the
    box do not cover it."""
    shape = tuple(shape)
    logical, offsets = split_key(key)
    if whole is None and offsets is None:
        whole = shape
    if offsets is None and key in reader:  # a whole tensor, stored whole
        t = reader.get(key)
        if tuple(t.shape) != shape:
            raise IncompatibleCheckpointError(
                f"{key}: checkpoint shape {tuple(t.shape)} does not fit the model's {shape}")
        return t
    want = Box(offsets if offsets is not None else (0,) * len(shape), shape)
    stored = reader.pieces(logical)
    if not stored:
        raise CorruptCheckpointError(f"the checkpoint has no key {logical!r}")
    have = extent(b for _, b in stored)
    if reader.one_rank and whole is not None:
        # One rank's pieces: what it holds must fit the whole tensor; the box it wants
        # is checked against the whole, and its coverage below.
        fits = len(have) == len(whole) and all(
            h <= w for h, w in zip(have, whole, strict=True))
        have = tuple(whole) if fits else have
    fits = len(have) == len(shape) and all(
        o + n <= h for o, n, h in zip(want.offsets, shape, have, strict=True))
    if not fits or (whole is not None and have != tuple(whole)):
        raise IncompatibleCheckpointError(
            f"{logical}: checkpoint shape {have} does not fit the model's "
            f"{tuple(whole) if whole is not None else shape}")
    out: torch.Tensor | None = None
    parts: list[Box] = []
    for k, box in stored:
        part = want.intersect(box)
        if part is None:
            continue
        if any(p.intersect(part) is not None for p in parts):
            raise CorruptCheckpointError(f"{logical}: the checkpoint's pieces overlap at "
                                         f"{part.offsets} ({k})")
        src = reader.get(k)
        if out is None:
            out = torch.empty(shape, dtype=src.dtype)
        out[part.within(want)] = src[part.within(box)]
        parts.append(part)
    covered = sum(p.numel for p in parts)
    if out is None or covered != want.numel:
        raise CorruptCheckpointError(
            f"{logical}: the checkpoint's pieces cover {covered} of the {want.numel} "
            f"elements at {want.offsets} of shape {shape}")
    return out


def whole_shapes(named: Named, spec: ExpertSpec) -> dict[str, tuple[int, ...]]:
    """The shape of the whole tensor each key of `flatten_params` is a piece of: a
    parameter's global shape, one expert's slice of it for an expert key."""
    experts = spec.by_name()
    out = {}
    for name, p in named:
        if name in experts:
            ep = experts[name]
            for gid in ep.global_ids:
                out[ep.key("param", gid)] = ep.one(p)
        else:
            out[piece_key(dense_key("param", name), name, p)] = tuple(p.shape)
    return out


@torch.no_grad()
def load_params(named: Named, spec: ExpertSpec, get: Getter) -> None:
    """Copy every parameter of this process (of a DTensor, this rank's piece) from
    `get(key)`."""
    experts = spec.by_name()
    for name, p in named:
        if name in experts:
            for gid, dst in slices(experts[name], p):
                if not _nothing(p, dst):
                    dst.copy_(_fetch(get, experts[name].key("param", gid), dst))
        elif not _nothing(p, local(p)):
            dst = local(p)
            dst.copy_(_fetch(get, piece_key(dense_key("param", name), name, p), dst))


StateGetter = Callable[[str, "str | None", tuple[int, ...], tuple[int, ...]], torch.Tensor]
"""(the state's whole key, the key of this rank's piece of it or None for a scalar, the
piece's shape, the whole tensor's shape) -> the tensor."""


def optimizer_state(params: dict[str, torch.Tensor],
                    state_names: dict[str, list[tuple[str, bool]]],
                    spec: ExpertSpec, get: StateGetter) -> dict[str, dict[str, torch.Tensor]]:
    """Rebuild optimizer state by parameter name for the given (owned) parameters (of a
    DTensor parameter, this rank's piece of the state).

    `state_names[name]` lists the state tensors to load (e.g. step, exp_avg, exp_avg_sq)
    and whether each is a scalar. Expert slices are stacked back along the expert dim; a
    scalar shared by a batched expert tensor (AdamW's `step`) takes the largest of its
    experts' values.
    """
    experts = spec.by_name()
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in params.items():
        out[name] = {}
        held = local(p)
        for s_name, scalar in state_names[name]:
            if not scalar and _nothing(p, held):
                out[name][s_name] = torch.empty_like(held)  # nothing held, nothing read
                continue
            if name not in experts:
                key = dense_key("optim", name, s_name)
                out[name][s_name] = get(key, None if scalar else piece_key(key, name, p),
                                        tuple(held.shape), tuple(p.shape))
                continue
            ep = experts[name]
            pieces = [get(expert_key("optim", ep.stem, gid, s_name),
                          None if scalar else ep.key("optim", gid, s_name), ep.one(held),
                          ep.one(p))
                      for gid in ep.global_ids or (0,)]  # none held: expert 0's scalar
            if ep.expert_dim is None:
                out[name][s_name] = pieces[0]
            elif pieces[0].dim() == 0:
                out[name][s_name] = torch.stack(pieces).max()
            else:
                out[name][s_name] = torch.stack(pieces, dim=ep.expert_dim)
            if out[name][s_name].dim() and out[name][s_name].shape != held.shape:
                raise IncompatibleCheckpointError(
                    f"optimizer state {s_name} of {name}: checkpoint shape "
                    f"{tuple(out[name][s_name].shape)} does not fit {tuple(held.shape)}")
    return out
