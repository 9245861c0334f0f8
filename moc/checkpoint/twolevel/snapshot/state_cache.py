"""One rank's flattened state, kept between snapshots and checked at each.

    cache = FlatState(rank_state)                # the planner's; the snapshot thread's
    flat = cache.take(rng, captured)             # per snapshot: the layout + the tail
    picked = flat.layout.remember(key, lambda: flat.layout.pick(index))

`RankState.flatten` walks every parameter and every optimizer state tensor in Python and
builds a key string for each (about a thousand at the gpu-400m preset), and what a
snapshot derives from them (which it copies, where in a slot, their header entries,
this rank's share of a persist) walks them again: tens of thousands of Python calls per
snapshot on the snapshot thread, each a chance for the training thread to wait for the
GIL before launching its next kernel. None of it changes while the state keeps its
tensors, so it is made once (`StateLayout`) and each snapshot first checks, in a few
C-level passes over the optimizer's state dicts and the parameters, that it still holds
(`Sources.current`). What is made anew per snapshot is the tail: what `save()` took
(the buffers, the param groups' JSON) and the RNG states.

Design note: what the check compares, and why it suffices. The flatten's keys and views
follow from the parameters (`RankState.named`, fixed), the optimizer's state dicts (which
parameters have state, under which names, which tensor objects) and, for a DTensor, its
local piece. So the check holds on to those objects and compares identities, plus each
tensor's data pointer and shape (which catch `p.data = ...` and `set_()`, under which a
tensor keeps its identity but not its memory). That catches every way the state is
replaced: torch's `load_state_dict` (a new `state` mapping), moc's restore (new tensors
per parameter), the first step creating the state lazily, a group added with
`add_param_group` (new parameters with state), an entry reassigned, FSDP2 swapping a
DTensor's local piece. Values that are not tensors (a Python float `step`) are turned
into a new tensor at each flatten: a state holding one is never cached. Because the
layout holds the tensors it checks, their memory is never reused under it; the other
side of that is that a replaced state stays alive until the next snapshot checks, or
until `forget()`.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch

from moc.checkpoint.optimizers import TorchOptimizerState
from moc.checkpoint.shards import is_dtensor
from moc.checkpoint.state import RankState, TakenAtSave
from moc.checkpoint.twolevel.memory.places import SlotLayout
from moc.checkpoint.twolevel.snapshot.tensors import Picked, SnapshotTensors, TensorList

_LOCAL = operator.attrgetter("_local_tensor")  # a DTensor's piece, as torch keeps it
_SHAPE = operator.attrgetter("shape")
_PTR = torch.Tensor.data_ptr

MISSES_BEFORE_GIVING_UP = 4
"""Consecutive snapshots whose check fails before the cache stops checking (each then
flattens as before, without the check's cost): a state whose tensors change identity at
every step (an optimizer that assigns new tensors rather than updating them in place)
gains nothing from it. A restore or the first step's lazy state miss once or twice."""


MEMO_SIZE = 32
"""What a layout keeps of what is derived from it (the tensors a selection of experts
copies, a persist's share): sequential selection cycles through N/K selections, well
under it; each costs a list of a thousand references or so."""


def _same(a: list[Any], b: list[Any]) -> bool:
    """Whether two lists hold the same objects (identity, in one C-level pass)."""
    return len(a) == len(b) and all(map(operator.is_, a, b))


def _optimizer_states(state: RankState) -> tuple[object | None, dict[Any, dict[str, Any]]]:
    """(the torch optimizer's own `state` mapping, or None), and {owner: {name: value}}
    as the flatten reads it: a torch optimizer's state is read as it is, without the
    per-parameter dicts `local_state()` builds; another `OptimizerState` through
    `local_state()`."""
    opt = state.optimizer
    if isinstance(opt, TorchOptimizerState):
        held = opt.held()
        return held, held
    return None, opt.local_state()


@dataclass(frozen=True, eq=False)
class Sources:
    """What one flatten was made of, held to tell whether a later one would be the same
    (see the module's design note)."""

    holder: object | None
    """The torch optimizer's `state` mapping (None: an `OptimizerState` of another
    kind, read through `local_state()`)."""
    owners: list[Any]
    """The keys of the optimizer's state: parameters (torch) or their names."""
    names: list[str]
    values: list[torch.Tensor]
    dtensors: list[torch.Tensor]
    pieces: list[torch.Tensor]
    """The local piece of each of `dtensors`."""
    plain: list[torch.Tensor]
    """Every tensor whose memory the flatten views (a DTensor's: its piece's)."""
    ptrs: list[int]
    shapes: list[torch.Size]

    @classmethod
    def of(cls, state: RankState) -> Sources | None:
        """None when the state cannot be checked cheaply (a value that is no tensor)."""
        holder, states = _optimizer_states(state)
        read = _read(states)
        if read is None:
            return None
        owners, names, values = read
        tensors = [p for _, p in state.named] + values
        dtensors = [t for t in tensors if is_dtensor(t)]
        try:
            pieces = list(map(_LOCAL, dtensors))
        except AttributeError:  # a torch that keeps the piece elsewhere: flatten each time
            return None
        plain = [t for t in tensors if not is_dtensor(t)] + pieces
        return cls(holder, owners, names, values, dtensors, pieces, plain,
                   list(map(_PTR, plain)), list(map(_SHAPE, plain)))

    def current(self, state: RankState) -> bool:
        """Whether `state` still flattens to what these sources made: a few C-level
        passes over the optimizer's state dicts and the tensors, no Python call per
        tensor (a torch optimizer; another kind's `local_state()` is called once)."""
        holder, states = _optimizer_states(state)
        if holder is not self.holder:
            return False
        owners = list(states)
        if not (_same(owners, self.owners) if holder is not None else owners == self.owners):
            return False
        read = _read(states)
        if read is None or read[1] != self.names or not _same(read[2], self.values):
            return False
        return (_same(list(map(_LOCAL, self.dtensors)), self.pieces)
                and list(map(_PTR, self.plain)) == self.ptrs
                and list(map(_SHAPE, self.plain)) == self.shapes)


def _read(states: dict[Any, dict[str, Any]]
          ) -> tuple[list[Any], list[str], list[torch.Tensor]] | None:
    """(owners, every entry's name, every entry's value) of an optimizer's state, in
    order, in C-level passes; None when a value is not a tensor or a state not a dict."""
    per = list(states.values())
    try:
        names = list(chain.from_iterable(per))
        values = list(chain.from_iterable(map(dict.values, per)))
    except TypeError:  # a state that is not a dict
        return None
    if not all(map(isinstance, values, [torch.Tensor] * len(values))):
        return None
    return list(states), names, values


@dataclass(eq=False)
class StateLayout:
    """A flattened state but its tail, made once: its keys, its tensors (views), their
    slot layout, and what snapshots derive from them by the experts they hold and the
    keys they persist (`remember`). Owner: the snapshot thread (the planner's plan, under
    its lock)."""

    sources: Sources | None
    """What it was made of (None: it cannot be checked, and is used for one snapshot)."""
    slots: SlotLayout
    tensors: TensorList
    _memo: dict[Hashable, Any] = field(default_factory=dict)

    @property
    def keys(self) -> list[str]:
        return self.slots.keys

    @functools.cached_property
    def keyset(self) -> frozenset[str]:
        return frozenset(self.slots.keys)

    def remember(self, key: Hashable | None, make: Callable[[], Any]) -> Any:
        """`make()`, once per `key` for this layout (None: not to be kept). The memo
        goes with the layout (a state replaced makes a new layout, with none of it) and
        keeps the MEMO_SIZE latest: a policy that selects by token counts may select
        anew at every checkpoint."""
        if key is None:
            return make()
        if key not in self._memo:
            if len(self._memo) >= MEMO_SIZE:
                del self._memo[next(iter(self._memo))]
            self._memo[key] = make()
        return self._memo[key]

    def pick(self, index: list[int] | None) -> Picked:
        """The tensors at `index` (None: all) as a snapshot copies them."""
        if index is None or len(index) == len(self.tensors):
            return self.remember("all", lambda: Picked.of(self.slots, self.tensors))
        return Picked.of(self.slots.pick(index), map(self.tensors.__getitem__, index))


@dataclass(frozen=True, eq=False)
class Flat:
    """One snapshot's flattened state: the cached layout, and the tail made for it
    (laid out after the layout, in the order `RankState.flatten` gives it)."""

    layout: StateLayout
    tail: dict[str, torch.Tensor]

    @property
    def keys(self) -> list[str]:
        """Every key, as `RankState.flatten` has them."""
        return self.layout.keys + list(self.tail)

    def snapshot(self, picked: Picked) -> SnapshotTensors:
        return SnapshotTensors(picked, self.tail)

    def as_dict(self) -> dict[str, torch.Tensor]:
        """Every key and tensor, as `RankState.flatten` gives them."""
        return {**dict(zip(self.layout.keys, self.layout.tensors, strict=True)), **self.tail}


class FlatState:
    """`RankState.flatten` for the snapshots of one engine, made once and checked at
    each snapshot (`take`). Owner: the snapshot thread (the planner's plan, under its
    lock); `forget` is for the caller's thread when no plan runs."""

    def __init__(self, state: RankState) -> None:
        self.state = state
        self._layout: StateLayout | None = None
        self._misses = 0  # consecutive checks that failed
        self.builds = 0
        """Layouts made (a miss of the check, or none kept): for tests and reports."""

    def forget(self) -> None:
        """Drop the layout (and with it the tensors it holds): after a restore, so that
        the state it replaced is not kept alive until the next snapshot."""
        self._layout = None

    def take(self, rng: dict[str, torch.Tensor] | None, captured: TakenAtSave | None
             ) -> Flat:
        """This snapshot's flattened state (`RankState.flatten(rng, captured)`): the
        layout kept since the last snapshot when its sources are current, else a new
        one. `rng`: the generators' states taken at `save()` (`RankState.rng`)."""
        layout = self._layout
        if captured is None or rng is None or layout is None or layout.sources is None:
            return self._build(rng, captured)
        if not layout.sources.current(self.state):
            self._misses += 1
            return self._build(rng, captured)
        self._misses = 0
        return Flat(layout, {**captured.tensors(), **rng})

    def _build(self, rng: dict[str, torch.Tensor] | None, captured: TakenAtSave | None
               ) -> Flat:
        """Flatten, and keep the layout unless it cannot be checked or kept."""
        self.builds += 1
        cacheable = (captured is not None and rng is not None
                     and self._misses < MISSES_BEFORE_GIVING_UP)
        sources = Sources.of(self.state) if cacheable else None  # before the flatten reads
        full = self.state.flatten(rng, captured)
        tail_keys = set(captured.tensors()) if captured is not None else set()
        tail_keys |= set(rng or ())
        tail = {key: t for key, t in full.items() if key in tail_keys}
        static = {key: t for key, t in full.items() if key not in tail_keys}
        if len(tail) != len(tail_keys):  # the flatten is made otherwise than assumed
            sources = None
        layout = StateLayout(sources, SlotLayout.of(static), TensorList(static.values()))
        self._layout = layout if sources is not None else None
        return Flat(layout, tail)
