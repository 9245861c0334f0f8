"""Which parameters are experts, and the stable keys that model and optimizer state
are flattened into.

Keys do not depend on how experts were laid out or which rank held them: an expert
tensor is stored once per (MoE layer, global expert, tensor), so a checkpoint written
with one parallel layout can be read with another.

    param/layers.0.attn.qkv.weight                      non-expert parameter
    param/layers.1.ffn.experts.w1_LDF/expert=5          slice of expert 5
    optim/layers.0.attn.qkv.weight/exp_avg              optimizer state of a parameter
    optim/layers.1.ffn.experts.w1_LDF/expert=5/exp_avg  ... of one expert's slice
    rng/rank=3                                          a rank's torch RNG state
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from moc.checkpoint.errors import IncompatibleCheckpointError
from moc.model.transformer import Experts


@dataclass(frozen=True)
class ExpertParam:
    """One model parameter that holds expert weights."""

    name: str
    """Its name in `model.named_parameters()`."""
    stem: str
    """Key stem shared by this tensor of every expert of its MoE layer."""
    moe_layer: int
    """Index of its MoE layer among the model's MoE layers (0-based)."""
    expert_dim: int | None
    """Dimension along which local experts are stacked (batched layout), or None when
    the parameter belongs to a single expert (`nn.ModuleList` layout)."""
    global_ids: tuple[int, ...]
    """Global expert id of each slice along `expert_dim` (one id when expert_dim is None)."""


Offset = int | Callable[[int], int]
"""Global id of local expert 0: one int for every MoE layer, or a function of the layer."""


@dataclass(frozen=True)
class ExpertSpec:
    """The expert parameters of a model, as this process holds them.

    Build it with `ExpertSpec.infer(model)` for the common layouts, or with
    `ExpertSpec.from_modules(model, [...])` naming each MoE layer's expert container.
    """

    n_experts: int
    """Experts per MoE layer (global)."""
    n_moe_layers: int
    params: tuple[ExpertParam, ...]

    def __post_init__(self) -> None:
        for p in self.params:
            bad = [g for g in p.global_ids if not 0 <= g < self.n_experts]
            if bad:
                raise ValueError(f"ExpertSpec: {p.name} maps to global expert ids {bad}, "
                                 f"outside 0..{self.n_experts - 1}; check n_experts and "
                                 "expert_offset")

    @classmethod
    def from_modules(cls, model: nn.Module, modules: list[str], *,
                     n_experts: int | None = None, expert_offset: Offset | None = None
                     ) -> ExpertSpec:
        """One expert container per MoE layer, in layer order. A container is either an
        `nn.ModuleList` (child i is local expert i) or a module whose direct parameters
        are batched `[L, ...]` tensors (slice i along dim 0 is local expert i).

        Local expert i of layer m has global id `offset(m) + i`, where the offset is the
        container's `expert_offset` attribute if it has one (moc's own `Experts` does),
        else `expert_offset` (an int or a function of the layer), else 0.
        `n_experts` defaults to `model.cfg.n_experts`, else to the largest id + 1.
        """
        named = dict(model.named_modules())
        params: list[ExpertParam] = []
        for layer, mod_name in enumerate(modules):
            if mod_name not in named:
                raise ValueError(f"ExpertSpec: model has no module named {mod_name!r}")
            container = named[mod_name]
            offset = getattr(container, "expert_offset", None)
            if offset is None:
                offset = expert_offset(layer) if callable(expert_offset) else (expert_offset or 0)
            prefix = f"{mod_name}." if mod_name else ""
            if isinstance(container, nn.ModuleList):
                for i, child in enumerate(container):
                    for rel, _ in child.named_parameters():
                        params.append(ExpertParam(f"{prefix}{i}.{rel}", f"{prefix}{rel}", layer,
                                                  None, (offset + i,)))
                continue
            direct = list(container.named_parameters(recurse=False))
            sizes = {p.shape[0] if p.dim() else None for _, p in direct}
            if not direct or len(sizes) != 1 or None in sizes:
                raise ValueError(
                    f"ExpertSpec: {mod_name!r} is neither an nn.ModuleList of experts nor a "
                    f"module of batched [E_local, ...] parameters (leading sizes {sizes})")
            n_local = sizes.pop()
            ids = tuple(range(offset, offset + n_local))
            params += [ExpertParam(prefix + rel, prefix + rel, layer, 0, ids) for rel, _ in direct]
        if n_experts is None:
            cfg = getattr(model, "cfg", None)
            n_experts = getattr(cfg, "n_experts", None) or 1 + max(
                (g for p in params for g in p.global_ids), default=-1)
        return cls(n_experts, len(modules), tuple(params))

    @classmethod
    def infer(cls, model: nn.Module, *, n_experts: int | None = None,
              expert_offset: Offset | None = None) -> ExpertSpec:
        """Find the expert containers: moc's `Experts` modules, and any module named
        `experts` (an `nn.ModuleList` of experts or a module of batched tensors), in
        the order `named_modules()` visits them. Raises ValueError when there is none."""
        modules = [name for name, m in model.named_modules()
                   if isinstance(m, Experts) or name.rsplit(".", 1)[-1] == "experts"]
        if not modules:
            raise ValueError("ExpertSpec.infer found no expert container (a module named "
                             "'experts'); build the spec with ExpertSpec.from_modules")
        return cls.from_modules(model, modules, n_experts=n_experts, expert_offset=expert_offset)

    def by_name(self) -> dict[str, ExpertParam]:
        return {p.name: p for p in self.params}

    def stems(self) -> dict[str, int]:
        """Key stem -> MoE layer, as recorded in manifests."""
        return {p.stem: p.moe_layer for p in self.params}


def expert_key(kind: str, stem: str, expert: int, state: str | None = None) -> str:
    key = f"{kind}/{stem}/expert={expert}"
    return f"{key}/{state}" if state else key


_EXPERT_KEY = re.compile(r"^(param|optim)/(.+)/expert=(\d+)(?:/[^/]+)?$")


def parse_expert_key(key: str) -> tuple[str, str, int] | None:
    """(kind, stem, global expert) of an expert key; None for any other key."""
    m = _EXPERT_KEY.match(key)
    return (m.group(1), m.group(2), int(m.group(3))) if m else None


def dense_key(kind: str, name: str, state: str | None = None) -> str:
    return f"{kind}/{name}/{state}" if state else f"{kind}/{name}"


def rng_key(rank: int) -> str:
    return f"rng/rank={rank}"


def _slices(ep: ExpertParam, t: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    """(global id, that expert's part of `t`) for each expert `t` holds; views."""
    if ep.expert_dim is None:
        yield ep.global_ids[0], t.detach()
        return
    for i, gid in enumerate(ep.global_ids):
        yield gid, t.detach().select(ep.expert_dim, i)


def flatten_params(model: nn.Module, spec: ExpertSpec) -> dict[str, torch.Tensor]:
    """Every parameter of this process under its stable key(s); views, no copies."""
    experts = spec.by_name()
    out = {}
    for name, p in model.named_parameters():
        if name in experts:
            for gid, t in _slices(experts[name], p):
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
            for gid, piece in _slices(ep, t):
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
            for gid, dst in _slices(experts[name], p):
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
