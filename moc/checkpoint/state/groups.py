"""The optimizer's param groups (lr, betas, weight_decay, `initial_lr` of an LR
scheduler, ...) as the JSON stored under `optim/param_groups`: encoded at a save (the
groups' JSON values taken at `save()`, their tensor entries copied aside without waiting),
decoded and matched to the optimizer's groups at a restore.

Each group carries the (layout-independent) names of its parameters, so a restore matches
groups by their parameters, whatever order they were built in; a checkpoint written before
param groups were saved leaves the optimizer's values as they are, with a warning.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from moc.checkpoint.errors import CorruptCheckpointError, IncompatibleCheckpointError
from moc.checkpoint.optimizers import NAMES_KEPT, OptimizerState
from moc.checkpoint.spec import PARAM_GROUPS_KEY, ExpertSpec
from moc.checkpoint.state.flat import Reader

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


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` in host memory, taken without waiting: a device tensor's copy is
    queued on the current stream into pinned memory (its value is there once the work
    queued so far is done), a host tensor is cloned."""
    if t.device.type != "cuda":
        return t.detach().cpu().clone()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t.detach(), non_blocking=True)
    return host


_PLAIN = frozenset((str, int, float, bool, type(None)))
"""Types a list may hold for `read_host_copies` to return it as it is."""


def read_host_copies(v: Any) -> Any:
    """`_jsonable`'s value with the host copies `host_copy` queued read out."""
    if isinstance(v, torch.Tensor):
        return v.tolist()
    if isinstance(v, list):
        if set(map(type, v)) <= _PLAIN:  # a group's parameter names: one C-level pass
            return v
        return [read_host_copies(x) for x in v]
    if isinstance(v, dict):
        return {k: read_host_copies(x) for k, x in v.items()}
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
    return groups_json(plain_groups(groups, spec))


def plain_groups(groups: list[dict[str, Any]], spec: ExpertSpec,
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


def groups_json(groups: list[dict[str, Any]]) -> torch.Tensor:
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


def few(names: Iterable[str], n: int = 3) -> str:
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
                f"param group {i} of the optimizer ({few(now)}) is no param group of the "
                f"checkpoint (whose groups hold: "
                f"{'; '.join(few(s) or '-' for s in saved_sets)}); build the optimizer "
                "with the param groups of the run that wrote the checkpoint")
        if j in taken:
            raise IncompatibleCheckpointError(
                f"param groups {taken[j]} and {i} of the optimizer both match param group "
                f"{j} of the checkpoint; build the optimizer with the param groups of "
                "the run that wrote the checkpoint")
        taken[j] = i
        out.append(saved[j])
    return out


def has_hyperparameters(optimizer: object) -> bool:
    return (callable(getattr(optimizer, "hyperparameters", None))
            and callable(getattr(optimizer, "load_hyperparameters", None)))


def param_groups_tensor(optimizer: OptimizerState, spec: ExpertSpec) -> torch.Tensor | None:
    """The tensor under `optim/param_groups`; None for an optimizer without the optional
    `hyperparameters()`."""
    if not has_hyperparameters(optimizer):
        return None
    return encode_param_groups(optimizer.hyperparameters(), spec)  # type: ignore[attr-defined]

def read_hyperparameters(reader: Reader, optimizer: OptimizerState, spec: ExpertSpec
                          ) -> list[dict[str, Any]] | None:
    """The checkpoint's param groups in the optimizer's group order, checked; None when
    there is nothing to install (no hooks, or a checkpoint without them)."""
    if not has_hyperparameters(optimizer):
        return None
    if PARAM_GROUPS_KEY not in reader:
        log.warning("the checkpoint has no %s (written before optimizer hyperparameters "
                    "were checkpointed?); the optimizer keeps its current lr, betas, "
                    "weight_decay, ...", PARAM_GROUPS_KEY)
        return None
    saved = decode_param_groups(reader.get(PARAM_GROUPS_KEY))
    return match_param_groups(saved, optimizer.hyperparameters(), spec)  # type: ignore[attr-defined]
