"""A rank's training state under stable keys: flattening it for a save, installing it on
restore, whatever model and optimizer hold it.

The checkpoint engines see a model only through an `ExpertSpec` and an optimizer only
through `OptimizerState`: which parameters' state this rank holds, that state keyed by
parameter name, and a way to put it back. moc's `ShardedAdamW` provides them directly;
any `torch.optim.Optimizer` (or `ZeroRedundancyOptimizer`, its local partition) is
adapted here.

    local_state(...)      this rank's parameters, owned optimizer state and RNG as views
    load_rank_state(...)  read (and check) everything first, then install it
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from moc.checkpoint.errors import IncompatibleCheckpointError
from moc.checkpoint.spec import (
    ExpertSpec,
    dense_key,
    expert_key,
    rng_key,
    slices,
)


@runtime_checkable
class OptimizerState(Protocol):
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
    """Adapts a plain `torch.optim.Optimizer` (every parameter's state is local)."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
        self.optimizer = optimizer
        self._name_of = {id(p): n for n, p in model.named_parameters()}
        unknown = [p for g in optimizer.param_groups for p in g["params"]
                   if id(p) not in self._name_of]
        if unknown:
            raise ValueError(f"the optimizer holds {len(unknown)} tensors that are not "
                             "parameters of the model; pass the model it optimizes")

    def owned_names(self) -> list[str]:
        return [self._name_of[id(p)] for g in self.optimizer.param_groups for p in g["params"]]

    def local_state(self) -> dict[str, dict[str, torch.Tensor]]:
        return {self._name_of[id(p)]: {k: v if isinstance(v, torch.Tensor) else torch.tensor(v)
                                       for k, v in state.items()}
                for p, state in self.optimizer.state.items() if state}

    def load_local_state(self, states: dict[str, dict[str, torch.Tensor]]) -> None:
        load_named_state(self.optimizer, self._name_of, states)


def as_optimizer_state(optimizer: object, model: nn.Module) -> OptimizerState:
    if isinstance(optimizer, OptimizerState):
        return optimizer
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return TorchOptimizerState(optimizer.optim, model)  # this rank's partition
    if isinstance(optimizer, torch.optim.Optimizer):
        return TorchOptimizerState(optimizer, model)
    raise TypeError(f"cannot checkpoint optimizer of type {type(optimizer).__name__}: expected "
                    "a torch.optim.Optimizer or an object with owned_names/local_state/"
                    "load_local_state (see moc.checkpoint.state.OptimizerState)")


def load_named_state(optimizer: torch.optim.Optimizer, name_of: dict[int, str],
                     states: dict[str, dict[str, torch.Tensor]]) -> None:
    """Replace the state of every parameter of `optimizer` by `states[name]` (copied to
    the parameter's device; scalars such as AdamW's `step` stay on the CPU)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            optimizer.state.pop(p, None)
            state = states.get(name_of[id(p)])
            if state:
                optimizer.state[p] = {k: v.to(p.device if v.dim() else "cpu").clone()
                                      for k, v in state.items()}


def default_model_meta(model: nn.Module, spec: ExpertSpec) -> dict[str, Any]:
    """What a checkpoint must match to be restored into `model`: expert geometry and
    the shapes of the non-expert parameters."""
    experts = spec.by_name()
    return {"n_experts": spec.n_experts, "n_moe_layers": spec.n_moe_layers,
            "dense": {n: list(p.shape) for n, p in model.named_parameters()
                      if n not in experts}}


def flatten_params(model: nn.Module, spec: ExpertSpec) -> dict[str, torch.Tensor]:
    """Every parameter of this process under its stable key(s); views, no copies."""
    experts = spec.by_name()
    out = {}
    for name, p in model.named_parameters():
        if name in experts:
            for gid, t in slices(experts[name], p):
                out[expert_key("param", experts[name].stem, gid)] = t
        else:
            out[dense_key("param", name)] = p.detach()
    return out


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
                out[dense_key("optim", name, s_name)] = t.detach()
                continue
            ep = experts[name]
            if t.dim() == 0:
                for gid in ep.global_ids:
                    out[expert_key("optim", ep.stem, gid, s_name)] = t.detach()
                continue
            for gid, piece in slices(ep, t):
                out[expert_key("optim", ep.stem, gid, s_name)] = piece
    return out


Getter = Callable[[str], torch.Tensor]


def _fetch(get: Getter, key: str, like: torch.Tensor) -> torch.Tensor:
    t = get(key)
    if tuple(t.shape) != tuple(like.shape):
        raise IncompatibleCheckpointError(
            f"{key}: checkpoint shape {tuple(t.shape)} does not fit the model's "
            f"{tuple(like.shape)}")
    return t


@torch.no_grad()
def load_params(model: nn.Module, spec: ExpertSpec, get: Getter) -> None:
    """Copy every parameter of this process from `get(key)`."""
    experts = spec.by_name()
    for name, p in model.named_parameters():
        if name in experts:
            for gid, dst in slices(experts[name], p):
                dst.copy_(_fetch(get, expert_key("param", experts[name].stem, gid), dst))
        else:
            p.copy_(_fetch(get, dense_key("param", name), p))


def optimizer_state(params: dict[str, torch.Tensor], state_names: dict[str, list[str]],
                    spec: ExpertSpec, get: Getter) -> dict[str, dict[str, torch.Tensor]]:
    """Rebuild optimizer state by parameter name for the given (owned) parameters.

    `state_names[name]` lists the state tensors to load (e.g. step, exp_avg, exp_avg_sq).
    Expert slices are stacked back along the expert dim; a scalar shared by a batched
    expert tensor (AdamW's `step`) takes the largest of its experts' values.
    """
    experts = spec.by_name()
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in params.items():
        out[name] = {}
        for s_name in state_names[name]:
            if name not in experts:
                out[name][s_name] = get(dense_key("optim", name, s_name))
                continue
            ep = experts[name]
            pieces = [get(expert_key("optim", ep.stem, gid, s_name)) for gid in ep.global_ids]
            if ep.expert_dim is None:
                out[name][s_name] = pieces[0]
            elif pieces[0].dim() == 0:
                out[name][s_name] = torch.stack(pieces).max()
            else:
                out[name][s_name] = torch.stack(pieces, dim=ep.expert_dim)
            if out[name][s_name].dim() and out[name][s_name].shape != p.shape:
                raise IncompatibleCheckpointError(
                    f"optimizer state {s_name} of {name}: checkpoint shape "
                    f"{tuple(out[name][s_name].shape)} does not fit {tuple(p.shape)}")
    return out


def local_state(model: nn.Module, optimizer: OptimizerState, spec: ExpertSpec, rank: int,
                rng: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Everything this rank holds under stable keys (views, no copies): its parameters,
    the optimizer state it owns, its RNG (`rng`: the state taken when the checkpoint was
    requested; now by default)."""
    state = flatten_params(model, spec)
    state.update(flatten_optimizer(optimizer.local_state(), spec))
    state[rng_key(rank)] = torch.get_rng_state() if rng is None else rng
    return state


class Reader(Protocol):
    """Where restored tensors come from: a checkpoint on storage, a snapshot in memory."""

    def __contains__(self, key: str) -> bool: ...

    def get(self, key: str) -> torch.Tensor: ...

    def state_names(self, prefix: str) -> list[str]:
        """Names of the optimizer state tensors stored under `prefix/`."""
        ...


def load_rank_state(reader: Reader, model: nn.Module, optimizer: OptimizerState,
                    spec: ExpertSpec, rank: int) -> None:
    """Install this rank's share of a checkpoint: its parameters, the optimizer state
    of the parameters it owns, its RNG. Everything is read (and checked) before anything
    is installed, so a corrupt key never leaves a half-loaded model."""
    params = {k: reader.get(k) for k in flatten_params(model, spec)}
    experts = spec.by_name()
    named = dict(model.named_parameters())
    owned = {n: named[n] for n in optimizer.owned_names()}
    names = {}
    for n in owned:
        if n in experts:
            prefix = expert_key("optim", experts[n].stem, experts[n].global_ids[0])
        else:
            prefix = dense_key("optim", n)
        names[n] = reader.state_names(prefix)
    with_state = {n: p for n, p in owned.items() if names[n]}
    states = optimizer_state(with_state, names, spec, reader.get)
    rng = reader.get(rng_key(rank)) if rng_key(rank) in reader else None

    load_params(model, spec, params.__getitem__)
    optimizer.load_local_state(states)
    if rng is not None:
        torch.set_rng_state(rng.clone())  # a view into a mapped file would crash it


@dataclass(frozen=True)
class RankState:
    """What one rank checkpoints and restores: its model, its optimizer's state, which
    parameters are experts, and its rank (whose RNG it is)."""

    model: nn.Module
    optimizer: OptimizerState
    spec: ExpertSpec
    rank: int

    def flatten(self, rng: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """`local_state`: everything this rank holds under stable keys, as views."""
        return local_state(self.model, self.optimizer, self.spec, self.rank, rng)

    def load(self, reader: Reader) -> None:
        """`load_rank_state`: read and check everything this rank holds, then install it."""
        load_rank_state(reader, self.model, self.optimizer, self.spec, self.rank)
