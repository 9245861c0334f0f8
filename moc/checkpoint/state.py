"""A rank's training state under stable keys: flattening it for a save, installing it on
restore, whatever model and optimizer hold it.

The checkpoint engines see a model only through an `ExpertSpec` and an optimizer only
through `OptimizerState`: which parameters' state this rank holds, that state keyed by
parameter name, and a way to put it back. moc's `ShardedAdamW` provides them directly;
any `torch.optim.Optimizer` (or `ZeroRedundancyOptimizer`, its local partition) is
adapted here.

    local_state(...)      this rank's parameters, persistent buffers, owned optimizer
                          state, the optimizer's param groups and RNG (views but the
                          param groups)
    load_rank_state(...)  read (and check) everything first, then install it

Buffers and hyperparameters. A persistent buffer (`register_buffer(..., persistent=True)`,
such as the router bias of aux-loss-free balancing) is training state: it is stored under
`buffer/<name>`, like a non-expert parameter (identical on every rank, one rank writes
it). Non-persistent buffers stay out, as they do of `state_dict()`. The optimizer's
param groups (lr, betas, weight_decay, `initial_lr` of an LR scheduler, ...) are stored
as JSON under `optim/param_groups`, each group with the (layout-independent) names of
its parameters, so a restore matches groups by their parameters. Checkpoints written
before either existed restore as before: what they lack keeps its current value, with a
warning.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from moc.checkpoint.errors import CorruptCheckpointError, IncompatibleCheckpointError
from moc.checkpoint.spec import (
    PARAM_GROUPS_KEY,
    ExpertSpec,
    buffer_key,
    dense_key,
    expert_key,
    expert_modules,
    rng_key,
    slices,
)

log = logging.getLogger(__name__)

IMPLEMENTATION_FLAGS = frozenset({"foreach", "fused", "capturable", "differentiable"})
"""Param group entries saved for the record but never restored: they choose how this
process computes the update (kernels for its device), not what the update is; a CUDA
run's `fused=True` restored into a CPU process would fail at its first step."""

PARAM_GROUPS_VERSION = 1
"""Version of the JSON under `optim/param_groups`; a reader refuses a newer one."""


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
    ZeRO copies them into the partition at each step)."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module,
                 groups: torch.optim.Optimizer | None = None) -> None:
        self.optimizer = optimizer
        self.groups = groups if groups is not None else optimizer
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

    def hyperparameters(self) -> list[dict[str, Any]]:
        return describe_groups(self.groups.param_groups, self._name_of)

    def load_hyperparameters(self, groups: list[dict[str, Any]]) -> None:
        set_hyperparameters(self.groups.param_groups, groups)
        if self.groups is not self.optimizer:  # the partition too, not only at the next step
            set_hyperparameters(self.optimizer.param_groups, groups)


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
    """The engines' view of `optimizer`; None gives a model-only one (`NoOptimizer`)."""
    if optimizer is None:
        return NoOptimizer()
    if isinstance(optimizer, OptimizerState):
        return optimizer
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return TorchOptimizerState(optimizer.optim, model, groups=optimizer)
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


def describe_groups(param_groups: list[dict[str, Any]], name_of: dict[int, str]
                    ) -> list[dict[str, Any]]:
    """`hyperparameters()` of torch param groups: every entry but "params" as it is, and
    the names of the group's parameters (`name_of`: id of a parameter -> its name)."""
    return [{**{k: v for k, v in g.items() if k != "params"},
             "params": [name_of[id(p)] for p in g["params"]]} for g in param_groups]


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


_NOT_JSON = object()
_warned_not_json: set[str] = set()


def _jsonable(v: Any) -> Any:
    """`v` as a JSON value (tuples as lists, tensors as numbers or lists); _NOT_JSON when
    it has none."""
    if v is None or isinstance(v, bool | int | float | str):
        return v
    if isinstance(v, torch.Tensor):
        return v.detach().cpu().tolist()  # a 0-dim tensor gives a number
    if isinstance(v, tuple | list):
        items = [_jsonable(x) for x in v]
        return _NOT_JSON if any(x is _NOT_JSON for x in items) else items
    if isinstance(v, dict) and all(isinstance(k, str) for k in v):
        d = {k: _jsonable(x) for k, x in v.items()}
        return _NOT_JSON if any(x is _NOT_JSON for x in d.values()) else d
    return _NOT_JSON


def stable_names(names: Iterable[str], spec: ExpertSpec) -> list[str]:
    """Parameter names as no layout changes them: an expert tensor by its stem (the name
    of `experts.3.w1.weight` depends on how many experts a rank holds; its stem does
    not), sorted and unique."""
    experts = spec.by_name()
    return sorted({experts[n].stem if n in experts else n for n in names})


def encode_param_groups(groups: list[dict[str, Any]], spec: ExpertSpec) -> torch.Tensor:
    """`hyperparameters()` as the uint8 tensor stored under `optim/param_groups`:
    canonical JSON (sorted keys, no spaces), so every rank's copy is the same bytes.

    An entry with no JSON value (an object a custom optimizer keeps in its groups) is left
    out with a warning: it is not restored, but the checkpoint is not lost for it."""
    out = []
    for i, g in enumerate(groups):
        entry: dict[str, Any] = {}
        for k, v in g.items():
            if k == "params":
                continue
            value = _jsonable(v)
            if value is _NOT_JSON:
                if k not in _warned_not_json:
                    _warned_not_json.add(k)
                    log.warning("optimizer param group %d: %r holds a %s, which has no "
                                "JSON form; it is not checkpointed", i, k, type(v).__name__)
                continue
            entry[k] = value
        entry["params"] = stable_names(g.get("params", []), spec)
        out.append(entry)
    data = json.dumps({"version": PARAM_GROUPS_VERSION, "param_groups": out},
                      sort_keys=True, separators=(",", ":")).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def decode_param_groups(t: torch.Tensor) -> list[dict[str, Any]]:
    """The param groups stored under `optim/param_groups`."""
    try:
        doc = json.loads(t.detach().cpu().numpy().tobytes())
        version, groups = doc["version"], doc["param_groups"]
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpointError(f"{PARAM_GROUPS_KEY} is not the JSON of param "
                                     f"groups: {e}") from None
    if version > PARAM_GROUPS_VERSION:
        raise IncompatibleCheckpointError(
            f"{PARAM_GROUPS_KEY} has version {version}, this moc reads up to "
            f"{PARAM_GROUPS_VERSION}; restore with the moc version that wrote it")
    return groups


def _few(names: Iterable[str], n: int = 3) -> str:
    names = sorted(names)
    more = f", ... ({len(names)} in all)" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def match_param_groups(saved: list[dict[str, Any]], current: list[dict[str, Any]],
                       spec: ExpertSpec) -> list[dict[str, Any]]:
    """The saved group for each of the optimizer's groups (`current`: its
    `hyperparameters()`), in the optimizer's order.

    A group matches the saved group that holds all its parameters (by stable name), so
    groups built in another order still find theirs; a group with no parameters (a ZeRO
    partition may have none of a group) or a checkpoint that names none matches by
    position. Raises IncompatibleCheckpointError when the counts differ or a group has
    no match: its hyperparameters would be guessed."""
    if len(saved) != len(current):
        raise IncompatibleCheckpointError(
            f"the checkpoint's optimizer has {len(saved)} param groups, this optimizer "
            f"{len(current)}; build the optimizer with the param groups of the run that "
            "wrote the checkpoint")
    saved_sets = [set(g.get("params", [])) for g in saved]
    taken: dict[int, int] = {}
    out = []
    for i, group in enumerate(current):
        now = set(stable_names(group.get("params", []), spec))
        if not now or not any(saved_sets):
            j: int | None = i
        else:
            j = next((j for j, names in enumerate(saved_sets) if now <= names), None)
        if j is None:
            raise IncompatibleCheckpointError(
                f"param group {i} of the optimizer ({_few(now)}) is no param group of the "
                f"checkpoint (whose groups hold: "
                f"{'; '.join(_few(s) or '-' for s in saved_sets)}); build the optimizer "
                "with the param groups of the run that wrote the checkpoint")
        if j in taken:
            raise IncompatibleCheckpointError(
                f"param groups {taken[j]} and {i} of the optimizer both match param group "
                f"{j} of the checkpoint; build the optimizer with the param groups of "
                "the run that wrote the checkpoint")
        taken[j] = i
        out.append(saved[j])
    return out


def _has_hyperparameters(optimizer: object) -> bool:
    return (callable(getattr(optimizer, "hyperparameters", None))
            and callable(getattr(optimizer, "load_hyperparameters", None)))


def param_groups_tensor(optimizer: OptimizerState, spec: ExpertSpec) -> torch.Tensor | None:
    """The tensor under `optim/param_groups`; None for an optimizer without the optional
    `hyperparameters()`."""
    if not _has_hyperparameters(optimizer):
        return None
    return encode_param_groups(optimizer.hyperparameters(), spec)  # type: ignore[attr-defined]


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


def _shared(model: nn.Module, optimizer: OptimizerState, spec: ExpertSpec,
            clone: bool = False) -> dict[str, torch.Tensor]:
    state = {buffer_key(n): b.detach().clone() if clone else b.detach()
             for n, b in persistent_buffers(model, spec).items()}
    groups = param_groups_tensor(optimizer, spec)
    if groups is not None:
        state[PARAM_GROUPS_KEY] = groups
    return state


def local_state(model: nn.Module, optimizer: OptimizerState, spec: ExpertSpec, rank: int,
                rng: torch.Tensor | None = None,
                captured: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Everything this rank holds under stable keys (views, no copies, but the param
    groups' JSON): its parameters and persistent buffers, the optimizer state it owns,
    the optimizer's param groups, its RNG (`rng`: the state taken when the checkpoint was
    requested; now by default). `captured`: the buffers and param groups taken then
    (`RankState.capture`), in place of their values now."""
    state = flatten_params(model, spec)
    state.update(flatten_optimizer(optimizer.local_state(), spec))
    state.update(_shared(model, optimizer, spec) if captured is None else captured)
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
    """Install this rank's share of a checkpoint: its parameters and persistent buffers,
    the optimizer state of the parameters it owns, the optimizer's hyperparameters, its
    RNG. Everything is read (and checked) before anything is installed, so a corrupt key
    never leaves a half-loaded model.

    A checkpoint written before buffers and param groups were saved lacks their keys:
    those keep their current values, with a warning."""
    params = {k: reader.get(k) for k in flatten_params(model, spec)}
    buffers = persistent_buffers(model, spec)
    missing = sorted(n for n in buffers if buffer_key(n) not in reader)
    buffer_values = {n: _fetch(reader.get, buffer_key(n), b)
                     for n, b in buffers.items() if n not in missing}
    hyper = _read_hyperparameters(reader, optimizer, spec)
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
    # A model-only restore (inference) leaves the process's RNG alone: it resumes no run.
    model_only = isinstance(optimizer, NoOptimizer)
    rng = reader.get(rng_key(rank)) if rng_key(rank) in reader and not model_only else None

    load_params(model, spec, params.__getitem__)
    with torch.no_grad():
        for n, t in buffer_values.items():
            buffers[n].copy_(t)
    optimizer.load_local_state(states)
    if hyper is not None:
        optimizer.load_hyperparameters(hyper)  # type: ignore[attr-defined]
    if missing:
        log.warning("the checkpoint has no key for the persistent buffers %s (written "
                    "before buffers were checkpointed?); they keep their current values",
                    _few(missing))
    if rng is not None:
        torch.set_rng_state(rng.clone())  # a view into a mapped file would crash it


def _read_hyperparameters(reader: Reader, optimizer: OptimizerState, spec: ExpertSpec
                          ) -> list[dict[str, Any]] | None:
    """The checkpoint's param groups in the optimizer's group order, checked; None when
    there is nothing to install (no hooks, or a checkpoint without them)."""
    if not _has_hyperparameters(optimizer):
        return None
    if PARAM_GROUPS_KEY not in reader:
        log.warning("the checkpoint has no %s (written before optimizer hyperparameters "
                    "were checkpointed?); the optimizer keeps its current lr, betas, "
                    "weight_decay, ...", PARAM_GROUPS_KEY)
        return None
    saved = decode_param_groups(reader.get(PARAM_GROUPS_KEY))
    return match_param_groups(saved, optimizer.hyperparameters(), spec)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class RankState:
    """What one rank checkpoints and restores: its model, its optimizer's state, which
    parameters are experts, and its rank (whose RNG it is)."""

    model: nn.Module
    optimizer: OptimizerState
    spec: ExpertSpec
    rank: int

    def __post_init__(self) -> None:
        persistent_buffers(self.model, self.spec)  # an expert buffer: refused at construction

    def flatten(self, rng: torch.Tensor | None = None,
                captured: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """`local_state`: everything this rank holds under stable keys, as views."""
        return local_state(self.model, self.optimizer, self.spec, self.rank, rng, captured)

    def capture(self) -> dict[str, torch.Tensor]:
        """What an asynchronous snapshot takes when the checkpoint is requested, not
        when it is copied: the persistent buffers (cloned) and the param groups' JSON.

        The copy runs behind the next forward pass, which may update buffers in place
        (running statistics, step counters), and a loop may set the learning rate
        between `save()` and the next optimizer step (at the top of an iteration, as
        nanoGPT does, or with a scheduler stepped after the save). Taken later, the
        snapshot of step t would hold some of step t+1: a recovery that is not exact,
        and differently so from run to run. Both are small (tens of microseconds on
        the `bench` model); parameters and optimizer state change only in the optimizer
        step, which waits for the copy."""
        return _shared(self.model, self.optimizer, self.spec, clone=True)

    def load(self, reader: Reader) -> None:
        """`load_rank_state`: read and check everything this rank holds, then install it."""
        load_rank_state(reader, self.model, self.optimizer, self.spec, self.rank)


def shared_state(state: RankState) -> dict[str, torch.Tensor]:
    """The keys of `state.flatten()` that are neither parameters nor their optimizer
    state and are the same on every rank: persistent buffers, the param groups. (For
    placements that pick what each rank writes by kind, as the baselines do.)"""
    return _shared(state.model, state.optimizer, state.spec)
