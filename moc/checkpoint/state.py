"""A rank's training state under stable keys: flattening it for a save, installing it on
restore, whatever model and optimizer hold it.

The checkpoint engines see a model only through an `ExpertSpec` and an optimizer only
through `OptimizerState`: which parameters' state this rank holds, that state keyed by
parameter name, and a way to put it back. moc's `ShardedAdamW` provides them directly;
torch's optimizers, ZeRO's partition and optimizers that step others (torchtitan's
`OptimizersContainer`) are adapted in `moc.checkpoint.optimizers`.

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
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
from torch import nn

from moc.checkpoint.errors import CorruptCheckpointError, IncompatibleCheckpointError
from moc.checkpoint.optimizers import (
    NAMES_KEPT,
    NoOptimizer,
    OptimizerState,
)
from moc.checkpoint.shards import (
    Box,
    Placed,
    UnsupportedLayoutError,
    agreed_placements,
    extent,
    is_dtensor,
    is_instance_of_loaded,
    local,
    refusal,
    report,
    sharding_of,
    split_key,
)
from moc.checkpoint.spec import (
    PARAM_GROUPS_KEY,
    ExpertSpec,
    buffer_key,
    dense_key,
    expert_key,
    expert_modules,
    rng_keys,
    slices,
)

log = logging.getLogger(__name__)


PARAM_GROUPS_VERSION = 1
"""Version of the JSON under `optim/param_groups`; a reader refuses a newer one."""



_NOT_JSON = object()
_warned_not_json: set[str] = set()


def _jsonable(v: Any, tensor: Callable[[torch.Tensor], Any] | None = None) -> Any:
    """`v` as a JSON value (tuples as lists, tensors as numbers or lists); _NOT_JSON when
    it has none. `tensor`: what a tensor becomes instead (its value, read now, by
    default: a device sync for a device tensor)."""
    if v is None or isinstance(v, bool | int | float | str):
        return v
    if isinstance(v, torch.Tensor):
        # A 0-dim tensor gives a number.
        return v.detach().cpu().tolist() if tensor is None else tensor(v)
    if isinstance(v, tuple | list):
        items = [_jsonable(x, tensor) for x in v]
        return _NOT_JSON if any(x is _NOT_JSON for x in items) else items
    if isinstance(v, dict) and all(isinstance(k, str) for k in v):
        d = {k: _jsonable(x, tensor) for k, x in v.items()}
        return _NOT_JSON if any(x is _NOT_JSON for x in d.values()) else d
    return _NOT_JSON


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` in host memory, taken without waiting: a device tensor's copy is
    queued on the current stream into pinned memory (its value is there once the work
    queued so far is done), a host tensor is cloned."""
    if t.device.type != "cuda":
        return t.detach().cpu().clone()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t.detach(), non_blocking=True)
    return host


_PLAIN = frozenset((str, int, float, bool, type(None)))
"""Types a list may hold for `_read_host_copies` to return it as it is."""


def _read_host_copies(v: Any) -> Any:
    """`_jsonable`'s value with the host copies `_host_copy` queued read out."""
    if isinstance(v, torch.Tensor):
        return v.tolist()
    if isinstance(v, list):
        if set(map(type, v)) <= _PLAIN:  # a group's parameter names: one C-level pass
            return v
        return [_read_host_copies(x) for x in v]
    if isinstance(v, dict):
        return {k: _read_host_copies(x) for k, x in v.items()}
    return v


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
    return _groups_json(_plain_groups(groups, spec))


def _plain_groups(groups: list[dict[str, Any]], spec: ExpertSpec,
                  tensor: Callable[[torch.Tensor], Any] | None = None,
                  cache: dict[tuple[str, ...], list[str]] | None = None
                  ) -> list[dict[str, Any]]:
    """`encode_param_groups`' groups as JSON values (`tensor`: as `_jsonable`'s).
    `cache`: each group's stable names, by its names (as `describe_groups`' cache)."""
    out = []
    for i, g in enumerate(groups):
        entry: dict[str, Any] = {}
        for k, v in g.items():
            if k == "params":
                continue
            value = _jsonable(v, tensor)
            if value is _NOT_JSON:
                if k not in _warned_not_json:
                    _warned_not_json.add(k)
                    log.warning("optimizer param group %d: %r holds a %s, which has no "
                                "JSON form; it is not checkpointed", i, k, type(v).__name__)
                continue
            entry[k] = value
        names = tuple(g.get("params", ()))
        stable = None if cache is None else cache.get(names)
        if stable is None:
            stable = stable_names(names, spec)
            if cache is not None:
                if len(cache) >= NAMES_KEPT:
                    cache.clear()
                cache[names] = stable
        entry["params"] = stable
        out.append(entry)
    return out


def _groups_json(groups: list[dict[str, Any]]) -> torch.Tensor:
    data = json.dumps({"version": PARAM_GROUPS_VERSION, "param_groups": groups},
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


def _shared(model: nn.Module, optimizer: OptimizerState, spec: ExpertSpec
            ) -> dict[str, torch.Tensor]:
    state = _buffers(model, spec)
    groups = param_groups_tensor(optimizer, spec)
    if groups is not None:
        state[PARAM_GROUPS_KEY] = groups
    return state


def _buffers(model: nn.Module, spec: ExpertSpec, clone: bool = False
             ) -> dict[str, torch.Tensor]:
    return {piece_key(buffer_key(n), n, b): local(b).detach().clone() if clone
            else local(b).detach() for n, b in persistent_buffers(model, spec).items()}


@dataclass(frozen=True)
class TakenAtSave:
    """What an asynchronous snapshot takes when the checkpoint is requested, not when it
    is copied (`RankState.capture`): the persistent buffers, cloned, and the param groups
    as JSON values, their tensor entries (a capturable optimizer's `lr`) as host copies
    queued without waiting. Nothing here waits for a device.

    On a device, `tensors()` may be called only once the work queued before the
    checkpoint's `ready` event is done (the snapshot thread waits for it): the host
    copies land then."""

    buffers: dict[str, torch.Tensor]
    groups: list[dict[str, Any]] | None

    def tensors(self) -> dict[str, torch.Tensor]:
        """The buffers, and the param groups' JSON under PARAM_GROUPS_KEY."""
        out = dict(self.buffers)
        if self.groups is not None:
            out[PARAM_GROUPS_KEY] = _groups_json(_read_host_copies(self.groups))
        return out


def local_state(model: nn.Module, optimizer: OptimizerState, spec: ExpertSpec, rank: int,
                rng: dict[str, torch.Tensor] | None = None,
                captured: TakenAtSave | None = None,
                named: Named | None = None) -> dict[str, torch.Tensor]:
    """Everything this rank holds under stable keys (views, no copies, but the param
    groups' JSON): its parameters and persistent buffers, the optimizer state it owns,
    the optimizer's param groups, its generators' RNG states (`rng`: `take_rng`'s, taken
    when the checkpoint was requested; now by default). `captured`: the buffers and param
    groups taken then (`RankState.capture`), in place of their values now."""
    named = named if named is not None else list(model.named_parameters())
    state = flatten_params(named, spec)
    state.update(flatten_optimizer(optimizer.local_state(), spec))
    state.update(_shared(model, optimizer, spec) if captured is None else captured.tensors())
    state.update(take_rng(rank_generators(rank, named)) if rng is None else rng)
    return state


_warned_no_rng: set[str] = set()


def _rng_module(device_type: str) -> Any | None:
    """The torch module of a device type with `get_rng_state`/`set_rng_state` (torch for
    the CPU); None, with a warning once, for one without (its generator is then neither
    saved nor restored)."""
    if device_type == "cpu":
        return torch
    try:
        module = torch.get_device_module(device_type)
    except RuntimeError:
        module = None
    if callable(getattr(module, "get_rng_state", None)) and callable(
            getattr(module, "set_rng_state", None)):
        return module
    if device_type not in _warned_no_rng:
        _warned_no_rng.add(device_type)
        log.warning("torch.%s has no get_rng_state/set_rng_state: the RNG of the %s "
                    "devices is not checkpointed, and a resumed run's random draws there "
                    "differ from an uninterrupted one's", device_type, device_type)
    return None


def rank_generators(rank: int, named: Named) -> dict[str, torch.device]:
    """This rank's RNG keys, each with the device whose generator it holds (`rng_keys`):
    the CPU generator and that of every accelerator the rank's parameters live on."""
    devices = {local(p).device for _, p in named}
    return rng_keys(rank, [d for d in devices if _rng_module(d.type) is not None])


# The generators' states are host data: torch.cuda.get_rng_state/set_rng_state read and
# write a CUDAGeneratorImpl's seed and Philox offset, which it keeps in host memory
# (aten/src/ATen/cuda/CUDAGeneratorImpl.cpp: get_state memcpys them into a new CPU byte
# tensor, set_state copies them back), so neither waits for the device nor queues work
# on it (tests/gpu/test_cuda_path.py saves under set_sync_debug_mode("error")).
def take_rng(generators: dict[str, torch.device]) -> dict[str, torch.Tensor]:
    """The state of each generator of `generators` (`rank_generators`) now, by key: CPU
    uint8 tensors, taken without waiting for any device."""
    out = {}
    for key, device in generators.items():
        module = _rng_module(device.type)
        assert module is not None, "rank_generators keeps devices with a generator"
        out[key] = module.get_rng_state() if device.type == "cpu" else module.get_rng_state(
            device)
    return out


def read_rng(reader: Reader, generators: dict[str, torch.device]
             ) -> dict[torch.device, torch.Tensor]:
    """The checkpoint's state of each generator of `generators` it holds (copies: a view
    into a mapped file must not reach a generator), checked against the size of the
    generator's state now. A key the checkpoint lacks (a restart on more ranks, a CPU
    run resumed on CUDA) leaves its generator as it is; a key for a device this rank no
    longer uses is not read. Raises IncompatibleCheckpointError for a state of another
    size (another device type's or torch build's generator), before anything is
    installed."""
    out = {}
    for key, device in generators.items():
        if key not in reader:
            continue
        saved = reader.get(key)
        now = take_rng({key: device})[key]
        if saved.dtype != now.dtype or tuple(saved.shape) != tuple(now.shape):
            raise IncompatibleCheckpointError(
                f"{key}: the checkpoint's RNG state is {saved.dtype} of shape "
                f"{tuple(saved.shape)}, this process's {device} generator takes {now.dtype} "
                f"of shape {tuple(now.shape)}; restore on the device type and torch build "
                "the run was saved with")
        out[device] = saved.clone()
    return out


def install_rng(states: dict[torch.device, torch.Tensor]) -> None:
    """Set each device's generator to its state (`read_rng`'s); host-side (see above)."""
    for device, state in states.items():
        module = _rng_module(device.type)
        assert module is not None, "rank_generators keeps devices with a generator"
        if device.type == "cpu":
            module.set_rng_state(state)
        else:
            module.set_rng_state(state, device)


class Reader(Protocol):
    """Where restored tensors come from: a checkpoint on storage, a snapshot in memory."""

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


def load_rank_state(reader: Reader, model: nn.Module, optimizer: OptimizerState,
                    spec: ExpertSpec, rank: int, named: Named | None = None,
                    generators: dict[str, torch.device] | None = None) -> None:
    """Install this rank's share of a checkpoint: its parameters and persistent buffers,
    the optimizer state of the parameters it owns, the optimizer's hyperparameters, its
    generators' RNG states (`generators`: `rank_generators`' by default). Everything is
    read (and checked) before anything is installed, so a corrupt key never leaves a
    half-loaded model.

    A checkpoint written before buffers and param groups were saved lacks their keys:
    those keep their current values, with a warning."""
    named = named if named is not None else list(model.named_parameters())
    wholes = whole_shapes(named, spec)
    params = {k: read_piece(reader, k, tuple(t.shape), wholes[k])
              for k, t in flatten_params(named, spec).items()}
    buffers = persistent_buffers(model, spec)
    missing = sorted(n for n in buffers if not reader.pieces(buffer_key(n)))
    buffer_values = {n: read_piece(reader, piece_key(buffer_key(n), n, b),
                                   tuple(local(b).shape), tuple(b.shape))
                     for n, b in buffers.items() if n not in missing}
    hyper = _read_hyperparameters(reader, optimizer, spec)
    experts = spec.by_name()
    by_name = dict(named)
    owned = {n: by_name[n] for n in optimizer.owned_names()}
    names = {}
    for n in owned:
        if n in experts:
            # A rank holding none of the experts (an empty piece) still keeps their state's
            # structure (the optimizer's is the same on every rank): expert 0's names.
            prefix = expert_key("optim", experts[n].stem, (*experts[n].global_ids, 0)[0])
        else:
            prefix = dense_key("optim", n)
        names[n] = _state_kinds(reader, prefix)
    with_state = {n: p for n, p in owned.items() if names[n]}

    def get(key: str, piece: str | None, shape: tuple[int, ...], whole: tuple[int, ...]
            ) -> torch.Tensor:
        return reader.get(key) if piece is None else read_piece(reader, piece, shape, whole)

    _check_state_agrees(optimizer, owned, with_state)
    states = optimizer_state(with_state, names, spec, get)
    # A model-only restore (inference) leaves the process's RNG alone: it resumes no run.
    model_only = isinstance(optimizer, NoOptimizer)
    if generators is None:
        generators = rank_generators(rank, named)
    rng = {} if model_only else read_rng(reader, generators)

    load_params(named, spec, params.__getitem__)
    with torch.no_grad():
        for n, t in buffer_values.items():
            local(buffers[n]).copy_(t)
    optimizer.load_local_state(states)
    if hyper is not None:
        optimizer.load_hyperparameters(hyper)  # type: ignore[attr-defined]
    if missing:
        log.warning("the checkpoint has no key for the persistent buffers %s (written "
                    "before buffers were checkpointed?); they keep their current values",
                    _few(missing))
    install_rng(rng)


def _check_state_agrees(optimizer: OptimizerState, owned: dict[str, torch.Tensor],
                        with_state: dict[str, torch.Tensor]) -> None:
    """Refuse a restore that would drop optimizer state without a word: the optimizer
    holds state now for parameters the checkpoint has none for, while it has state for
    others (a checkpoint with no optimizer state at all is one taken before the first
    step, and a rollback to it starts every parameter fresh, as that run did)."""
    if not with_state:
        return
    dropped = sorted(n for n, s in optimizer.local_state().items()
                     if s and n in owned and n not in with_state)
    if dropped:
        raise IncompatibleCheckpointError(
            f"the checkpoint holds no optimizer state for {len(dropped)} parameters the "
            f"optimizer holds state for ({_few(dropped)}), while it holds state for "
            f"{len(with_state)} others: restoring it would drop that state silently; "
            "restore with the optimizer of the run that wrote it")


def _state_kinds(reader: Reader, prefix: str) -> list[tuple[str, bool]]:
    """(name, is a scalar) of each optimizer state tensor stored under `prefix/`: a
    scalar (AdamW's `step`) is stored whole under its own key on every layout, a tensor
    as the pieces its layout held."""
    out: dict[str, bool] = {}
    for name in reader.state_names(prefix):
        base, offsets = split_key(name)
        if offsets is not None:
            out[base] = False
            continue
        pieces = reader.pieces(f"{prefix}/{base}")
        out.setdefault(base, not pieces or pieces[0][1].shape == ())
    return sorted(out.items())


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
    pieces: int = field(default=0, init=False)
    """A checksum of the boxes this model's DTensors are cut into (0: no DTensor sharded
    over the ranks): the same on every rank of a job, different for another layout."""
    placements: dict[str, Placed] = field(default_factory=dict)
    """Every piece of each DTensor parameter (by name) and persistent buffer (by its key,
    `buffer/<name>`) this rank holds part of, with the ranks that hold it, as every rank
    of the job reported it (`placed`); empty until then, and the units of a plan fall
    back to what this rank's mesh says."""
    generators: dict[str, torch.device] = field(default_factory=dict, init=False)
    """This rank's RNG keys, each with the device whose generator it holds
    (`rank_generators`): the CPU's and that of each accelerator its parameters live on,
    as the engine found them when it was built."""
    names: dict[tuple[str, ...], list[str]] = field(default_factory=dict, init=False,
                                                    repr=False, compare=False)
    """The param groups' stable names by their names, kept between saves
    (`_plain_groups`: made once, not at every save on the training thread)."""
    named: Named = field(default=(), init=False)
    """The model's parameters by name, as it held them when the engine was built. Kept,
    not looked up at each save: FSDP2 swaps a module's sharded parameters for unsharded
    ones during forward and backward, while a two-level snapshot copies behind the
    forward; the sharded ones are the optimizer's, and the state."""

    def __post_init__(self) -> None:
        # An expert buffer, or a DTensor whose layout moc cannot save: refused at
        # construction, never from inside a save.
        for name, b in persistent_buffers(self.model, self.spec).items():
            sharding_of(name, b)
        named = tuple(self.model.named_parameters())
        _check_sharded(self.model)
        object.__setattr__(self, "named", named)
        object.__setattr__(self, "generators", rank_generators(self.rank, named))
        pieces = []
        for name, p in named:
            sharding = sharding_of(name, p)
            if sharding is not None and not sharding.whole:
                pieces.append(f"{name}:{[b for b, _ in sharding.pieces]}")
        # The layout's boxes, as a number manifests and snapshots record (0: none).
        object.__setattr__(self, "pieces",
                           zlib.crc32("|".join(pieces).encode()) if pieces else 0)

    @classmethod
    def agreed(cls, model: nn.Module, optimizer: OptimizerState, spec: ExpertSpec | None,
               rank: int, all_gather: Callable[[Any], list[Any]], *,
               refused: ValueError | None = None) -> RankState:
        """`RankState(...).placed(all_gather)` on every rank, or the same refusal raised
        on every rank (collective). A rank whose construction refuses the model (an
        UnsupportedLayoutError, a ValueError; or `refused`, its experts' refusal found
        before: `spec` is then None) still enters the one all-gather, carrying its
        refusal in place of its pieces: raising before it would leave its peers in a
        collective it never enters (gloo's "Connection closed by peer"), each with a
        different story."""
        try:
            if refused is not None:
                raise refused
            assert spec is not None
            state = cls(model, optimizer, spec, rank)
        except ValueError as e:  # UnsupportedLayoutError is one
            agreed_placements(all_gather(refusal(e)))  # raises: this rank refused
            raise AssertionError("a rank's refusal is raised by every rank") from e
        return state.placed(all_gather)

    def placed(self, all_gather: Callable[[Any], list[Any]]) -> RankState:
        """This state with `placements`: which ranks hold each piece, from every rank's
        own piece (one all-gather, collective, entered whatever the layout). A DTensor's
        mesh may be a slice of a larger one (FSDP2 over dp_shard of a dp_shard x ep
        mesh): its own mesh then names only some of the ranks that hold the same piece,
        and two ranks that each think they alone hold it would both write it. Raises the
        same UnsupportedLayoutError on every rank when the ranks' pieces do not tile a
        tensor (`shards.agreed_placements`)."""
        tensors = [*self.named, *((buffer_key(n), b) for n, b in
                                  persistent_buffers(self.model, self.spec).items())]
        return replace(self, placements=agreed_placements(all_gather(report(tensors))))

    @property
    def device(self) -> torch.device | None:
        """The CUDA device this rank's parameters live on; None when they live on the
        host (or on another accelerator, whose tensors are copied through the host)."""
        return next((p.device for _, p in self.named if p.is_cuda), None)

    def flatten(self, rng: dict[str, torch.Tensor] | None = None,
                captured: TakenAtSave | None = None) -> dict[str, torch.Tensor]:
        """`local_state`: everything this rank holds under stable keys, as views (`rng`:
        `rng()` as taken when the checkpoint was requested; now by default)."""
        return local_state(self.model, self.optimizer, self.spec, self.rank,
                           self.rng() if rng is None else rng, captured, self.named)

    def rng(self) -> dict[str, torch.Tensor]:
        """The state of every generator this rank uses, by key: the CPU's under
        `rng/rank=<r>`, each accelerator's under `rng/rank=<r>/<type>=<n>`. The one place
        a save takes the RNG: at `save()`, on the caller's thread, since the next forward
        draws from it (dropout). Host-side: no device sync (see `take_rng`)."""
        return take_rng(self.generators)

    def capture(self) -> TakenAtSave:
        """What an asynchronous snapshot takes when the checkpoint is requested, not
        when it is copied: the persistent buffers (cloned) and the param groups.

        The copy runs behind the next forward pass, which may update buffers in place
        (running statistics, step counters), and a loop may set the learning rate
        between `save()` and the next optimizer step (at the top of an iteration, as
        nanoGPT does, or with a scheduler stepped after the save). Taken later, the
        snapshot of step t would hold some of step t+1: a recovery that is not exact,
        and differently so from run to run. Both are small (tens of microseconds on
        the `bench` model); parameters and optimizer state change only in the optimizer
        step, which waits for the copy. Nothing here waits for a device: a device
        tensor is cloned, or copied to pinned host memory, by work queued on the
        current stream (`TakenAtSave`)."""
        groups = None
        if _has_hyperparameters(self.optimizer):
            groups = _plain_groups(self.optimizer.hyperparameters(),  # type: ignore[attr-defined]
                                   self.spec, tensor=_host_copy, cache=self.names)
        return TakenAtSave(_buffers(self.model, self.spec, clone=True), groups)

    def sizing(self) -> dict[str, torch.Tensor]:
        """`flatten()`'s tensors as a slot lays them out, reading no value (no device
        sync): what the snapshot slots are prepared for. The param groups' JSON is
        sized with tensor entries as 0 (a few bytes off: slots are reserved with slack)."""
        groups = None
        if _has_hyperparameters(self.optimizer):
            groups = _plain_groups(self.optimizer.hyperparameters(),  # type: ignore[attr-defined]
                                   self.spec, tensor=lambda t: 0)
        return self.flatten(None, TakenAtSave(_buffers(self.model, self.spec), groups))

    def load(self, reader: Reader) -> None:
        """`load_rank_state`: read and check everything this rank holds, then install it."""
        load_rank_state(reader, self.model, self.optimizer, self.spec, self.rank, self.named,
                        self.generators)


def _check_sharded(model: nn.Module) -> None:
    """UnsupportedLayoutError for an FSDP2 module whose parameters are unsharded now
    (built between a forward and its backward, or under `unshard()`): the engine keeps
    the parameters it sees when it is built, and those would not be the optimizer's."""
    for name, module in model.named_modules():
        if is_instance_of_loaded(module, "torch.distributed.fsdp", "FSDPModule") and any(
                not is_dtensor(p) for p in module.parameters(recurse=False)):
            raise UnsupportedLayoutError(
                f"the FSDP2 module {name or type(model).__name__!r} holds unsharded "
                "parameters now; build the checkpointer when the model is sharded: after "
                "fully_shard, before the first forward or after a backward")


def shared_state(state: RankState) -> dict[str, torch.Tensor]:
    """The keys of `state.flatten()` that are neither parameters nor their optimizer
    state and are the same on every rank: persistent buffers, the param groups. (For
    placements that pick what each rank writes by kind, as the baselines do.)"""
    return _shared(state.model, state.optimizer, state.spec)
