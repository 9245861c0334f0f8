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
    expert_dim: int
    """Dimension along which local experts are stacked."""
    global_ids: tuple[int, ...]
    """Global expert id of each slice along `expert_dim`."""


@dataclass(frozen=True)
class ExpertSpec:
    """The expert parameters of a model, as this process holds them."""

    n_experts: int
    """Experts per MoE layer (global)."""
    n_moe_layers: int
    params: tuple[ExpertParam, ...]

    @classmethod
    def from_model(cls, model: nn.Module, n_experts: int | None = None) -> ExpertSpec:
        """For models built from `moc.model.Experts` (batched [L, ...] tensors).
        `n_experts` defaults to `model.cfg.n_experts` (the reference model)."""
        found = [(n, m) for n, m in model.named_modules() if isinstance(m, Experts)]
        params = []
        for layer, (mod_name, module) in enumerate(found):
            prefix = f"{mod_name}." if mod_name else ""
            ids = tuple(range(module.expert_offset, module.expert_offset + module.n_local))
            for p_name, _ in module.named_parameters(recurse=False):
                params.append(ExpertParam(prefix + p_name, prefix + p_name, layer, 0, ids))
        if n_experts is None:
            n_experts = model.cfg.n_experts
        return cls(n_experts, len(found), tuple(params))

    def by_name(self) -> dict[str, ExpertParam]:
        return {p.name: p for p in self.params}


def expert_key(kind: str, stem: str, expert: int, state: str | None = None) -> str:
    key = f"{kind}/{stem}/expert={expert}"
    return f"{key}/{state}" if state else key


def dense_key(kind: str, name: str, state: str | None = None) -> str:
    return f"{kind}/{name}/{state}" if state else f"{kind}/{name}"


def rng_key(rank: int) -> str:
    return f"rng/rank={rank}"


def _slices(ep: ExpertParam, t: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
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
            for i, gid in enumerate(ep.global_ids):
                piece = t.detach() if t.dim() == 0 else t.detach().select(ep.expert_dim, i)
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
            if pieces[0].dim() == 0:
                out[name][s_name] = torch.stack(pieces).max()
            else:
                out[name][s_name] = torch.stack(pieces, dim=ep.expert_dim)
            if out[name][s_name].dim() and out[name][s_name].shape != p.shape:
                raise IncompatibleCheckpointError(
                    f"optimizer state {s_name} of {name}: checkpoint shape "
                    f"{tuple(out[name][s_name].shape)} does not fit {tuple(p.shape)}")
    return out
