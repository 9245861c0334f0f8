"""The engines' view of an optimizer (`OptimizerState`), and the adapters that give it
for torch's optimizers: which parameters' state a rank holds, that state keyed by
parameter name, the param groups' hyperparameters, and a way to put both back.

    TorchOptimizerState    a `torch.optim.Optimizer`, or a ZeRO partition and its wrapper
    NestedOptimizerState   an optimizer that steps others (torchtitan's
                           `OptimizersContainer`): each of them, read through
    NoOptimizer            a model-only engine's

Never silent about optimizer state: an optimizer whose `state_dict()` holds tensors its
`.state` does not (a wrapper that keeps its inner optimizers where no attribute shows
them) is refused at the first save and at a restore, in one line that says what to
pass instead, since moc would otherwise save, or install, no state for it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from moc.checkpoint.shards import is_dtensor, is_instance_of_loaded

log = logging.getLogger(__name__)

IMPLEMENTATION_FLAGS = frozenset({"foreach", "fused", "capturable", "differentiable"})
"""Param group entries saved for the record but never restored: they choose how this
process computes the update (kernels for its device), not what the update is; a CUDA
run's `fused=True` restored into a CPU process would fail at its first step."""


@runtime_checkable
class OptimizerState(Protocol):
    """What the engines need of an optimizer. Two more methods are optional (looked up
    with `getattr`, so an implementation of only these three keeps working; its
    hyperparameters are then not checkpointed):

        hyperparameters() -> list[dict[str, Any]]
            Every param group, in order: its entries but "params" (lr, betas, ...) and
            "params": the names of its parameters. A sharded optimizer lists the
            parameters of every rank, so the list is the same on every rank.
        load_hyperparameters(groups: list[dict[str, Any]]) -> None
            Set group i's entries from groups[i] (its "params" and the
            IMPLEMENTATION_FLAGS excepted; `set_hyperparameters` does it).
    """

    def owned_names(self) -> list[str]:
        """Parameters whose optimizer state lives on this rank."""
        ...

    def local_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """{param name: {state name: tensor}} for owned parameters that have state."""
        ...

    def load_local_state(self, states: dict[str, dict[str, torch.Tensor]]) -> None:
        """Install `states`; owned parameters missing from it start fresh."""
        ...


class TorchOptimizerState:
    """Adapts a plain `torch.optim.Optimizer` (every parameter's state is local), or the
    local partition of a `ZeroRedundancyOptimizer` (`optimizer`) with the wrapper whose
    param groups hold every rank's parameters and drive the hyperparameters (`groups`:
    ZeRO copies them into the partition at each step).

    Its `.state` is what is saved and restored, so it is first checked to be the whole
    state (`unread_tensors`): at each save until the optimizer has state, and after a
    restore installs some. An optimizer with torch's own `state_dict` is never called."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module,
                 groups: torch.optim.Optimizer | None = None) -> None:
        self.optimizer = optimizer
        self.groups = groups if groups is not None else optimizer
        self._name_of = {id(p): n for n, p in model.named_parameters()}
        self._names: dict[tuple[int, ...], list[str]] = {}  # `describe_groups`' cache
        self._checked = type(optimizer).state_dict is torch.optim.Optimizer.state_dict
        unknown = [p for g in optimizer.param_groups for p in g["params"]
                   if id(p) not in self._name_of]
        if unknown:
            raise ValueError(f"the optimizer holds {len(unknown)} tensors that are not "
                             "parameters of the model; pass the model it optimizes")

    def held(self) -> dict[Any, dict[str, Any]]:
        """The optimizer's own `state` mapping ({parameter: {name: value}}), checked to
        be its whole state: what a save reads (`local_state`, or the snapshot thread's
        cache, which reads it as it is)."""
        if not self._checked:
            self._check()
        return self.optimizer.state

    def _check(self) -> None:
        unread = unread_tensors(self.optimizer)
        if unread:
            raise TypeError(_unreadable(self.optimizer, unread))
        # Settled once the optimizer has state: until then both sides are empty.
        self._checked = any(self.optimizer.state.values())

    def owned_names(self) -> list[str]:
        return [self._name_of[id(p)] for g in self.optimizer.param_groups for p in g["params"]]

    def local_state(self) -> dict[str, dict[str, torch.Tensor]]:
        return {self._name_of[id(p)]: {k: v if isinstance(v, torch.Tensor) else torch.tensor(v)
                                       for k, v in state.items()}
                for p, state in self.held().items() if state}

    def load_local_state(self, states: dict[str, dict[str, torch.Tensor]]) -> None:
        load_named_state(self.optimizer, self._name_of, states)
        if self._checked or not any(states.values()):
            return
        # The state installed must be what the optimizer steps with: what its own
        # state_dict() shows, by identity (a wrapper that keeps its inner optimizers out
        # of sight shows theirs, and would step without what was installed).
        installed = {id(v) for s in self.optimizer.state.values() for v in s.values()}
        shown = [t for t in _tensors(self.optimizer.state_dict()) if id(t) in installed]
        if not shown:
            raise TypeError(_unreadable(self.optimizer, None))
        self._check()

    def hyperparameters(self) -> list[dict[str, Any]]:
        return describe_groups(self.groups.param_groups, self._name_of, self._names)

    def load_hyperparameters(self, groups: list[dict[str, Any]]) -> None:
        set_hyperparameters(self.groups.param_groups, groups)
        if self.groups is not self.optimizer:  # the partition too, not only at the next step
            set_hyperparameters(self.optimizer.param_groups, groups)


class NestedOptimizerState:
    """An optimizer that steps others and keeps no state of its own: torchtitan's
    `OptimizersContainer` (its `.state` is empty, its inner optimizers hold it), or a
    list of optimizers. Each inner optimizer is read as `TorchOptimizerState` reads
    one; their param groups are saved in order, as one optimizer's would be, so the
    keys are those of a single optimizer over the same parameters (a checkpoint of the
    container restores into a plain AdamW over the same groups, and back).

    A parameter stepped by two inner optimizers is refused at construction (its state
    would be two states under one key); the outer optimizer holding state of its own
    beside its inner ones is refused at a save (it would not be restored)."""

    def __init__(self, inners: list[torch.optim.Optimizer], model: nn.Module,
                 outer: torch.optim.Optimizer | None = None) -> None:
        self.parts = [TorchOptimizerState(o, model) for o in inners]
        self.outer = outer
        seen: dict[str, int] = {}
        for i, part in enumerate(self.parts):
            for name in part.owned_names():
                if seen.setdefault(name, i) != i:
                    raise ValueError(
                        f"parameter {name} is stepped by inner optimizers {seen[name]} and "
                        f"{i} of {_what(outer, inners)}: each parameter's state must be "
                        "held by one optimizer")
        self._counts = [len(o.param_groups) for o in inners]

    def _own_state(self) -> bool:
        """Whether the outer optimizer holds state that is not an inner one's (a
        wrapper's `state` may be its inner optimizer's own mapping)."""
        held = getattr(self.outer, "state", None)
        return bool(held) and all(held is not p.optimizer.state for p in self.parts) and any(
            held.values())

    def owned_names(self) -> list[str]:
        return [n for part in self.parts for n in part.owned_names()]

    def local_state(self) -> dict[str, dict[str, torch.Tensor]]:
        if self._own_state():
            raise TypeError(
                f"{type(self.outer).__name__} holds optimizer state of its own beside its "
                f"{len(self.parts)} inner optimizers; moc reads the inner ones only: pass "
                "an object implementing moc.checkpoint.optimizers.OptimizerState")
        out: dict[str, dict[str, torch.Tensor]] = {}
        for part in self.parts:
            out.update(part.local_state())
        return out

    def load_local_state(self, states: dict[str, dict[str, torch.Tensor]]) -> None:
        for part in self.parts:
            owned = part.owned_names()
            part.load_local_state({n: states[n] for n in owned if n in states})

    def hyperparameters(self) -> list[dict[str, Any]]:
        return [g for part in self.parts for g in part.hyperparameters()]

    def load_hyperparameters(self, groups: list[dict[str, Any]]) -> None:
        start = 0
        for part, n in zip(self.parts, self._counts, strict=True):
            part.load_hyperparameters(groups[start:start + n])
            start += n


class NoOptimizer:
    """The optimizer of a model-only engine (`optimizer=None`): it owns no parameters and
    holds no state, so a restore installs the model alone and whatever optimizer state
    the checkpoint holds is not read."""

    def owned_names(self) -> list[str]:
        return []

    def local_state(self) -> dict[str, dict[str, torch.Tensor]]:
        return {}

    def load_local_state(self, states: dict[str, dict[str, torch.Tensor]]) -> None:
        assert not states, "a model-only restore reads no optimizer state"


def as_optimizer_state(optimizer: object, model: nn.Module) -> OptimizerState:
    """The engines' view of `optimizer`: a torch optimizer, a ZeRO optimizer (its local
    partition), an optimizer that steps others (`inner_optimizers`: torchtitan's
    `OptimizersContainer`), a list of optimizers, or an `OptimizerState`; None gives a
    model-only one (`NoOptimizer`)."""
    if optimizer is None:
        return NoOptimizer()
    if isinstance(optimizer, OptimizerState):
        return optimizer
    if is_instance_of_loaded(optimizer, "torch.distributed.optim",
                             "ZeroRedundancyOptimizer"):
        return TorchOptimizerState(optimizer.optim, model, groups=optimizer)
    if isinstance(optimizer, list | tuple) and optimizer and all(
            isinstance(o, torch.optim.Optimizer) for o in optimizer):
        return NestedOptimizerState(list(optimizer), model)
    if isinstance(optimizer, torch.optim.Optimizer):
        inners = inner_optimizers(optimizer)
        if inners:
            return NestedOptimizerState(inners, model, outer=optimizer)
        return TorchOptimizerState(optimizer, model)
    raise TypeError(f"cannot checkpoint optimizer of type {type(optimizer).__name__}: expected "
                    "a torch.optim.Optimizer, a list of them, or an object with owned_names/"
                    "local_state/load_local_state (moc.checkpoint.optimizers.OptimizerState)")


def inner_optimizers(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The optimizers `optimizer` holds as attributes, directly or in a list, tuple or
    dict (torchtitan's `OptimizersContainer.optimizers`; a wrapper's `.optimizer`), in
    attribute order; [] for an optimizer that holds none. Each is looked through in
    turn, so a container of wrappers gives the optimizers that hold the state.

    An attribute is what an optimizer that steps others keeps them in; the outer one's
    own `.state` is then empty (torchtitan) or shared with its inner one (a wrapper
    whose `state` is its inner optimizer's). One whose inner optimizers are nowhere to
    be seen is refused by `unread_tensors` instead."""
    found: list[torch.optim.Optimizer] = []
    for value in vars(optimizer).values():
        items = (list(value.values()) if isinstance(value, Mapping)
                 else list(value) if isinstance(value, list | tuple) else [value])
        for item in items:
            if isinstance(item, torch.optim.Optimizer) and item is not optimizer and all(
                    item is not f for f in found):
                found.extend(inner_optimizers(item) or [item])
    return found


def unread_tensors(optimizer: torch.optim.Optimizer) -> int:
    """How many tensors `optimizer.state_dict()` holds beyond those in its `.state`
    (its param groups' aside: a capturable optimizer's tensor lr): 0 for an optimizer
    with torch's own `state_dict`, which packs `.state` as it is, without calling it.

    More than 0 is state moc would neither save nor restore: a wrapper whose inner
    optimizers hold it where no attribute shows them. Counted, not matched by identity,
    so a `state_dict` that copies `.state` (to the host, say) is not mistaken for one."""
    if type(optimizer).state_dict is torch.optim.Optimizer.state_dict:
        return 0
    held = sum(1 for s in optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))
    sd = optimizer.state_dict()
    if isinstance(sd, Mapping):
        sd = {k: v for k, v in sd.items() if k != "param_groups"}
    return max(0, sum(1 for _ in _tensors(sd)) - held)


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _tensors(v)


def _unreadable(optimizer: torch.optim.Optimizer, unread: int | None) -> str:
    what = (f"its state_dict() holds {unread} tensors that its .state does not" if unread
            else "its state_dict() shows none of the state restored into its .state")
    return (f"moc cannot read the state of {type(optimizer).__name__}: {what} (inner "
            "optimizers kept where no attribute shows them), so it would be neither saved "
            "nor restored; pass "
            "the inner optimizers (a list of torch optimizers), or an object implementing "
            "moc.checkpoint.optimizers.OptimizerState")


def _what(outer: torch.optim.Optimizer | None, inners: list[torch.optim.Optimizer]) -> str:
    return type(outer).__name__ if outer is not None else f"the list of {len(inners)}"


def load_named_state(optimizer: torch.optim.Optimizer, name_of: dict[int, str],
                     states: dict[str, dict[str, torch.Tensor]]) -> None:
    """Replace the state of every parameter of `optimizer` by `states[name]`, each entry
    copied to where torch's own `load_state_dict` puts it (`placed_like_torch`)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            optimizer.state.pop(p, None)
            state = states.get(name_of[id(p)])
            if state:
                optimizer.state[p] = {k: placed_like_torch(k, v, p, group)
                                      for k, v in state.items()}


def placed_like_torch(key: str, v: torch.Tensor, p: torch.Tensor, group: dict[str, Any]
                      ) -> torch.Tensor:
    """Optimizer state entry `key` of `p` (`v`: this rank's piece, as read) on the device
    and in the dtype torch's `Optimizer.load_state_dict` gives it
    (`Optimizer._process_value_according_to_param_policy`), always a copy.

    Design note. torch's rule, mirrored: `step` in float32 on the parameter's device when
    its group is `fused` or `capturable` (their kernels read it there: a capturable
    AdamW asserts at its first step when it is on the host), else as stored (on the
    host); any other entry on the parameter's device, in the parameter's dtype when that
    is floating point (a bf16 model's moments are bf16, whatever run wrote them). torch
    reads the flags of the groups it loads; moc keeps the restoring process's own
    (IMPLEMENTATION_FLAGS are never restored), so those choose here: they decide which
    kernels will read the state. A DTensor parameter's non-scalar state is a DTensor laid
    out as the parameter (torch's optimizers compute with both together); a scalar is a
    plain tensor on its local device, as torch's optimizers create `step` for a DTensor
    (`torch.zeros((), device=p.device)`). The copy is not optional: `.to()` returns its
    input when nothing changes, and a view into a mapped file (a snapshot, a checkpoint
    read with mmap) must never become state the optimizer updates in place."""
    if key == "step":
        if group.get("fused") or group.get("capturable"):
            return v.to(dtype=torch.float32, device=p.device, copy=True)
        return v.clone()
    v = v.to(device=p.device, dtype=p.dtype if p.is_floating_point() else None, copy=True)
    if is_dtensor(p) and v.dim():
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(v, p.device_mesh, p.placements, run_check=False,
                                  shape=p.shape, stride=p.stride())
    return v


NAMES_KEPT = 16
"""Parameter lists whose names a cache of `describe_groups` or `plain_groups` keeps (a
few groups, remade when a group's parameters change)."""


def describe_groups(param_groups: list[dict[str, Any]], name_of: dict[int, str],
                    cache: dict[tuple[int, ...], list[str]] | None = None
                    ) -> list[dict[str, Any]]:
    """`hyperparameters()` of torch param groups: every entry but "params" as it is, and
    the names of the group's parameters (`name_of`: id of a parameter -> its name).

    `cache`: the names of each list of parameters (by their ids, a C-level pass) kept
    between calls, which run at every save on the training thread: a group's names are
    then looked up, not made again one parameter at a time. The lists it returns are the
    cache's: read them, never change them."""
    out = []
    for g in param_groups:
        ids = tuple(map(id, g["params"]))
        names = None if cache is None else cache.get(ids)
        if names is None:
            names = list(map(name_of.__getitem__, ids))
            if cache is not None:
                if len(cache) >= NAMES_KEPT:
                    cache.clear()
                cache[ids] = names
        out.append({**{k: v for k, v in g.items() if k != "params"}, "params": names})
    return out


def set_hyperparameters(param_groups: list[dict[str, Any]], groups: list[dict[str, Any]]
                        ) -> None:
    """`load_hyperparameters()` of torch param groups: set each entry of `groups[i]` but
    "params" and the IMPLEMENTATION_FLAGS in `param_groups[i]`, in the type it has now (a
    tuple stays a tuple; a tensor, as capturable optimizers hold lr, is filled in place on
    its device)."""
    assert len(param_groups) == len(groups), "groups are matched before they are loaded"
    for group, saved in zip(param_groups, groups, strict=True):
        for k, v in saved.items():
            if k == "params" or k in IMPLEMENTATION_FLAGS:
                continue
            now = group.get(k)
            if isinstance(now, torch.Tensor):
                now.copy_(torch.as_tensor(v, dtype=now.dtype))
            elif isinstance(now, tuple) and isinstance(v, list):
                group[k] = tuple(v)
            else:
                group[k] = v

