"""The write units of one checkpoint and this rank's share of them: pure functions.

Every rank derives every unit from what it can see, with no communication: the dense
parameters (the same everywhere), the shape of one expert's tensors (the same for every
expert of a layer), the layout, and the optimizer's owner map. Sizes of optimizer state
are estimated (OPTIM_BYTES_PER_PARAM_BYTE): the plan only needs to balance; what is
written is measured.

    units, unit_of = write_units(params, spec, layout, owner_of, wanted, shared)
    keys = sharded_keys(state, wanted, units, unit_of, rank, world_size, sharded_optim)

Keys that are neither a parameter's nor its optimizer state's, but the same on every rank
(`shared`: persistent buffers, the optimizer's param groups), are non-expert units like
modules are: a buffer goes with its module's parameters, anything else is a unit of its
own; each is written by exactly one rank, and at every checkpoint (`ChainState.wanted`
wants every non-expert key).

A DTensor (FSDP2, DTensor expert or tensor parallelism; `moc.checkpoint.shards`) is
written piece by piece: each distinct box of it is a unit of its own, held by the ranks
whose local tensor it is (one rank under plain FSDP2: it writes its own piece; several
when a mesh dimension replicates it: the plan picks one). Every rank enumerates every box
from the mesh and placements, so the units stay the same everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from moc.checkpoint.plan.writes import DENSE, EXPERT, FIXED, WriteUnit, plan_writes
from moc.checkpoint.shards import Box, Sharding, sharding_of
from moc.checkpoint.spec import (
    PARAM_GROUPS_KEY,
    ExpertParam,
    ExpertSpec,
    buffer_key,
    expert_key,
    param_key_of,
    rng_rank_of,
)
from moc.checkpoint.state import Placed, RankState, persistent_buffers
from moc.topology import ParallelLayout

OPTIM_BYTES_PER_PARAM_BYTE = 2
"""Planning estimate of optimizer state per byte of parameter (AdamW: two moments). It
only balances the plan; what is written is measured."""

OwnerOf = Callable[[str, int], int]
"""(parameter name, expert-parallel rank) -> the global rank owning its optimizer state
(a sharded optimizer such as `ShardedAdamW.owner_of`)."""
Wanted = Callable[[str], bool]
"""Is this key written at this checkpoint (`ChainState.wanted`)?"""


def write_units(params: Iterable[tuple[str, int]], spec: ExpertSpec, layout: ParallelLayout,
                owner_of: OwnerOf | None, wanted: Wanted,
                shared: Iterable[tuple[str, int] | tuple[str, int, tuple[int, ...]]] = (),
                shardings: dict[str, Sharding] | None = None,
                placements: dict[str, Placed] | None = None
                ) -> tuple[list[WriteUnit], dict[str, str]]:
    """The plan's units, the same on every rank, and the unit of each parameter key and
    shared key.

    `params`: (name, bytes of the whole tensor) of every parameter this rank holds, in
    `named_parameters()` order. With `owner_of` (a sharded optimizer) each rank's owned
    optimizer state is a unit of its own (one holder); without it, optimizer state is
    replicated with its parameter and travels in the parameter's unit. `shared`: (key,
    bytes) of the other keys every rank holds the same copy of: a `buffer/<module>.<name>`
    joins its module's unit, any other key is a unit of its own; (key, bytes, holders)
    for a piece of a DTensor buffer, a unit of its own held by those ranks. `shardings`: the layout
    of each non-expert parameter that is a DTensor, by name (an expert parameter's is in
    its `ExpertParam`): a unit per piece, held by the ranks `placements` names
    (`RankState.placements`; by default, those of the DTensor's own mesh).
    """
    shardings = shardings or {}
    placements = placements or {}
    world = layout.world_size
    everyone = tuple(range(world))
    replicated_optim = owner_of is None
    factor = 1 + (OPTIM_BYTES_PER_PARAM_BYTE if replicated_optim else 0)
    sizes: dict[str, int] = {}
    holders: dict[str, tuple[int, ...]] = {}
    kinds: dict[str, str] = {}
    unit_of: dict[str, str] = {}
    fixed = [0] * world

    def add(unit: str, nbytes: int, who: tuple[int, ...], kind: str) -> None:
        sizes[unit] = sizes.get(unit, 0) + nbytes
        holders[unit], kinds[unit] = who, kind

    experts = spec.by_name()
    for name, nbytes in params:
        if name in shardings:
            _dense_pieces(name, shardings[name], placements.get(name, shardings[name].pieces),
                          nbytes * factor, unit_of, add)
            continue
        if name not in experts:
            unit = f"dense:{name.rsplit('.', 1)[0]}"
            add(unit, nbytes * factor, everyone, DENSE)
            unit_of[f"param/{name}"] = unit
            if owner_of is not None:
                # A dense parameter's owner does not depend on the expert-parallel rank.
                fixed[owner_of(name, 0)] += nbytes * OPTIM_BYTES_PER_PARAM_BYTE
            continue
        ep = experts[name]
        if ep.sharding is not None:
            _expert_pieces(ep, placements.get(name, ep.sharding.pieces), nbytes, unit_of,
                           add, wanted, replicated_optim)
            continue
        per_expert = nbytes // len(ep.global_ids)
        for gid in range(spec.n_experts):  # every expert, local or not
            key = expert_key("param", ep.stem, gid)
            if key in unit_of:
                continue
            unit = unit_of[key] = f"expert:{ep.moe_layer}:{gid}"
            size = per_expert * wanted(key)
            if replicated_optim and wanted(expert_key("optim", ep.stem, gid, "exp_avg")):
                size += per_expert * OPTIM_BYTES_PER_PARAM_BYTE
            add(unit, size, tuple(layout.expert_replicas(gid)), EXPERT)
        if owner_of is not None:
            for e_rank in range(layout.ep):
                ids = layout.local_experts(e_rank)
                n = sum(wanted(expert_key("optim", ep.stem, gid, "exp_avg")) for gid in ids)
                fixed[owner_of(name, e_rank)] += n * per_expert * OPTIM_BYTES_PER_PARAM_BYTE
    for key, nbytes, *who in shared:
        if who:  # a piece: its own unit, held by its holders
            unit_of[key] = f"dense:{key}"
            add(unit_of[key], nbytes, who[0], DENSE)
            continue
        module = key[len("buffer/"):].rsplit(".", 1)[0] if key.startswith("buffer/") else key
        unit_of[key] = f"dense:{module}"
        add(unit_of[key], nbytes, everyone, DENSE)
    units = [WriteUnit(u, sizes[u], holders[u], kinds[u]) for u in sizes]
    units += [WriteUnit(f"owned:{r}", fixed[r], (r,), FIXED) for r in everyone]
    return units, unit_of


def _numel(sharding: Sharding) -> int:
    return Box.whole(sharding.global_shape).numel


def _dense_pieces(name: str, sharding: Sharding, pieces: Placed, nbytes: int,
                  unit_of: dict[str, str],
                  add: Callable[[str, int, tuple[int, ...], str], None]) -> None:
    """The units of a non-expert DTensor parameter: one per piece, held by the ranks
    that hold it (`pieces`), of its share of `nbytes` (the whole tensor's, optimizer
    state included). A scalar optimizer state (AdamW's `step`, stored whole) goes with
    the first piece."""
    for i, (box, who) in enumerate(pieces):
        key = f"param/{name}{sharding.suffix(box)}"
        unit_of[key] = f"dense:{key}"
        add(unit_of[key], nbytes * box.numel // max(1, _numel(sharding)), who, DENSE)
        if i == 0:
            unit_of[f"param/{name}"] = unit_of[key]


def _expert_pieces(ep: ExpertParam, pieces: Placed, nbytes: int, unit_of: dict[str, str],
                   add: Callable[[str, int, tuple[int, ...], str], None], wanted: Wanted,
                   replicated_optim: bool) -> None:
    """The units of a DTensor expert tensor: one per (expert, piece of it), held by the
    ranks whose box holds it (`pieces`). A scalar optimizer state (AdamW's `step`, one
    per expert) goes with the expert's first piece."""
    sharding = ep.sharding
    assert sharding is not None
    whole = sharding.global_shape
    for box, who in pieces:
        rows = (range(box.offsets[0], box.offsets[0] + box.shape[0])
                if ep.expert_dim is not None else ep.global_ids)
        inner = Box(box.offsets[1:], box.shape[1:]) if ep.expert_dim is not None else box
        outer = whole[1:] if ep.expert_dim is not None else whole
        piece = "" if inner.shape == tuple(outer) else inner.suffix()
        size = nbytes * inner.numel // max(1, Box.whole(whole).numel)
        for gid in rows:
            key = expert_key("param", ep.stem, gid) + piece
            unit = unit_of[key] = f"expert:{ep.moe_layer}:{gid}{piece}"
            unit_of.setdefault(expert_key("param", ep.stem, gid), unit)
            total = size * wanted(key)
            if replicated_optim and wanted(expert_key("optim", ep.stem, gid, "exp_avg") + piece):
                total += size * OPTIM_BYTES_PER_PARAM_BYTE
            add(unit, total, who, EXPERT)


def sharded_keys(keys: Iterable[str], wanted: Wanted, units: list[WriteUnit],
                 unit_of: dict[str, str], rank: int, world_size: int, sharded_optim: bool
                 ) -> list[str]:
    """The keys (of this rank's state, `keys`) this rank writes: the wanted ones the
    plan gives it. Nothing moves between ranks: a rank writes only what it holds.

    Its RNG is always its own; sharded optimizer state is written by its owner, i.e.
    where it is held; replicated optimizer state goes with its parameter's unit; shared
    keys (buffers, param groups) by their unit's writer, as parameters."""
    writer = plan_writes(units, world_size).writer

    def mine(key: str) -> bool:
        if rng_rank_of(key) is not None:  # every generator's of this rank: only it has them
            return True
        if key in unit_of:  # a parameter or a shared key
            return writer[unit_of[key]] == rank
        if key.startswith("optim/"):
            return sharded_optim or writer[unit_of[param_key_of(key)]] == rank
        return writer[unit_of[key]] == rank

    return [k for k in keys if wanted(k) and mine(k)]


def rank_share(state: RankState, layout: ParallelLayout, keys: Iterable[str], wanted: Wanted
               ) -> list[str]:
    """The keys among `keys` (this rank's flattened state) that this rank writes under
    the fully sharded plan. A sharded optimizer is recognised by its `owner_of`."""
    owner_of: OwnerOf | None = getattr(state.optimizer, "owner_of", None)
    params = [(n, p.numel() * p.element_size()) for n, p in state.named]
    experts = state.spec.by_name()
    shardings = {n: sh for n, p in state.named
                 if n not in experts and (sh := sharding_of(n, p)) is not None}
    shared: list[tuple[str, int] | tuple[str, int, tuple[int, ...]]] = []
    for n, b in persistent_buffers(state.model, state.spec).items():
        key, nbytes, sharding = buffer_key(n), b.numel() * b.element_size(), sharding_of(n, b)
        if sharding is None or sharding.whole:
            shared.append((key, nbytes))
            continue
        for box, who in state.placements.get(key, sharding.pieces):
            shared.append((key + sharding.suffix(box), nbytes * box.numel // _numel(sharding),
                           who))
    # The param groups' JSON is a few hundred bytes: its size does not change the plan.
    shared.append((PARAM_GROUPS_KEY, 0))
    units, unit_of = write_units(params, state.spec, layout, owner_of, wanted, shared,
                                 shardings, state.placements)
    return sharded_keys(keys, wanted, units, unit_of, state.rank, layout.world_size,
                        sharded_optim=owner_of is not None)
