"""Which parameters are experts, and the stable keys that model and optimizer state
are flattened into.

Keys do not depend on how experts were laid out or which rank held them: an expert
tensor is stored once per (MoE layer, global expert, tensor), so a checkpoint written
with one parallel layout can be read with another.

    param/layers.0.attn.qkv.weight                      non-expert parameter
    param/layers.1.ffn.experts.w1_LDF/expert=5          slice of expert 5
    optim/layers.0.attn.qkv.weight/exp_avg              optimizer state of a parameter
    optim/layers.1.ffn.experts.w1_LDF/expert=5/exp_avg  ... of one expert's slice
    buffer/layers.1.ffn.router.bias                     a persistent non-expert buffer
    optim/param_groups                                  the optimizer's hyperparameters
    rng/rank=3                                          a rank's torch CPU RNG state
    rng/rank=3/cuda=0                                   ... of its first CUDA device

`optim/param_groups` cannot be mistaken for a parameter's optimizer state: those keys
have a state name after the parameter (`optim/<name>/<state>`), and parameter names hold
dots, never slashes.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from moc.checkpoint.shards import Box, Sharding, UnsupportedLayoutError, local, sharding_of


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
    container: str | None = None
    """Name of the `nn.ModuleList` holding the expert (`name` is `<container>.<i>.<rest of
    stem>`), None for batched tensors or when unknown; export rebuilds names from it."""
    sharding: Sharding | None = None
    """The parameter's DTensor layout (`moc.checkpoint.shards`), None for a plain tensor:
    which ranks hold which experts, instead of the `ParallelGroups`' expert layout."""
    piece: str = ""
    """Key suffix of this rank's piece of each expert's tensor when the layout splits an
    expert too (tensor parallel, or FSDP2 sharding a ModuleList expert): `@<offsets>`
    into the expert's own tensor; "" when this rank holds whole experts."""

    def one(self, t: torch.Tensor) -> tuple[int, ...]:
        """The shape of one expert's part of `t` (a tensor shaped as this parameter, or
        this rank's piece of it)."""
        return tuple(t.shape[1:]) if self.expert_dim is not None else tuple(t.shape)

    def key(self, kind: str, gid: int, state: str | None = None) -> str:
        """The key of expert `gid`'s part of this tensor (its piece, as this rank holds
        it)."""
        return expert_key(kind, self.stem, gid, state) + self.piece


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
        `n_experts` defaults to a batched container's `num_experts` (torchtitan's
        `GroupedExperts`), else `model.cfg.n_experts`, else the largest id + 1.
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
                    for rel, p in child.named_parameters():
                        name = f"{prefix}{i}.{rel}"
                        sharding = sharding_of(name, p)
                        piece = sharding.suffix(sharding.mine) if sharding else ""
                        params.append(ExpertParam(name, f"{prefix}{rel}", layer, None,
                                                  (offset + i,), mod_name, sharding, piece))
                continue
            n_local = _batched_size(mod_name, container)
            declared = getattr(container, "num_experts", None)  # torchtitan's, global
            if n_experts is None and isinstance(declared, int) and declared > 0:
                n_experts = declared
            direct = list(container.named_parameters(recurse=False))
            shardings = [sharding_of(prefix + rel, p) for rel, p in direct]
            if any(shardings):
                offset, n_local = _expert_rows(mod_name, direct, shardings)
                n_experts = n_experts or direct[0][1].shape[0]
            ids = tuple(range(offset, offset + n_local))
            params += [ExpertParam(prefix + rel, prefix + rel, layer, 0, ids,
                                   sharding=sh, piece=_expert_piece(sh))
                       for (rel, _), sh in zip(direct, shardings, strict=True)]
        if n_experts is None:
            cfg = getattr(model, "cfg", None)
            n_experts = getattr(cfg, "n_experts", None) or 1 + max(
                (g for p in params for g in p.global_ids), default=-1)
        return cls(n_experts, len(modules), tuple(params))

    @classmethod
    def infer(cls, model: nn.Module, *, n_experts: int | None = None,
              expert_offset: Offset | None = None) -> ExpertSpec:
        """Find the expert containers by their structure, in the order `named_modules()`
        visits them: any module named `experts` (an `nn.ModuleList` of experts or a
        module of batched tensors), and any module that declares `expert_offset` (the
        global id of its local expert 0, as moc's own `Experts` does) or `num_experts`
        (torchtitan's `GroupedExperts`) and holds batched parameters. No model class
        is imported: a model this package has never seen is recognised the same way.
        Raises ValueError when there is none."""
        modules: list[str] = []
        for name, m in model.named_modules():
            inside = any(name.startswith(f"{outer}.") or not outer for outer in modules)
            if _is_expert_container(name, m) and not inside:
                modules.append(name)
        if not modules:
            raise ValueError(f"ExpertSpec.infer found no expert container in "
                             f"{type(model).__name__} (a module named 'experts', or one "
                             "declaring expert_offset); build the spec with "
                             "ExpertSpec.from_modules")
        return cls.from_modules(model, modules, n_experts=n_experts, expert_offset=expert_offset)

    def by_name(self) -> dict[str, ExpertParam]:
        return {p.name: p for p in self.params}

    def stems(self) -> dict[str, int]:
        """Key stem -> MoE layer, as recorded in manifests."""
        return {p.stem: p.moe_layer for p in self.params}

    def names(self) -> dict[str, dict[str, Any]]:
        """Key stem -> how the model names that tensor of its experts, as manifests record
        it (`experts.params`) so that an export rebuilds the model's own state dict from
        the files alone:

            {"dim": 0}                      batched: one parameter named <stem>, every
                                            expert of the layer stacked along dim 0
            {"container": "<module>"}       nn.ModuleList: expert g's parameter is
                                            <module>.<g>.<rest of the stem>

        A stem whose layout this process cannot tell (a hand-built spec without
        `container`) is left out; exporting it then says so."""
        out: dict[str, dict[str, Any]] = {}
        for p in self.params:
            if p.expert_dim is not None:
                out[p.stem] = {"dim": p.expert_dim}
                continue
            container = p.container if p.container is not None else _container_of(p)
            if container is not None:
                out[p.stem] = {"container": container}
        return out


def expert_key(kind: str, stem: str, expert: int, state: str | None = None) -> str:
    key = f"{kind}/{stem}/expert={expert}"
    return f"{key}/{state}" if state else key


_EXPERT_KEY = re.compile(r"^(param|optim)/(.+)/expert=(\d+)(?:/[^/@]+)?(?:@\d+(?:,\d+)*)?$")


@functools.lru_cache(maxsize=1 << 16)
def parse_expert_key(key: str) -> tuple[str, str, int] | None:
    """(kind, stem, global expert) of an expert key; None for any other key. Cached: a
    checkpoint's plan parses every key of the state several times (1,500 parses on the
    `bench` preset: caching took a plan from 8.9 to 6.7 ms of CPU), and the keys of a
    run never change."""
    m = _EXPERT_KEY.match(key)
    return (m.group(1), m.group(2), int(m.group(3))) if m else None


def dense_key(kind: str, name: str, state: str | None = None) -> str:
    return f"{kind}/{name}/{state}" if state else f"{kind}/{name}"


def rng_key(rank: int, device: str | None = None, n: int = 0) -> str:
    """The key of a rank's RNG state: its CPU generator's (`device` None), or that of the
    `n`-th device of type `device` the rank uses (`rng/rank=<r>/<device>=<n>`)."""
    return f"rng/rank={rank}" if device is None else f"rng/rank={rank}/{device}={n}"


_RNG_KEY = re.compile(r"^rng/rank=(\d+)(?:/[a-z0-9_]+=\d+)?$")


def rng_rank_of(key: str) -> int | None:
    """The rank whose generator's state `key` holds; None for a key that is no RNG key."""
    m = _RNG_KEY.match(key)
    return int(m.group(1)) if m else None


def rng_keys(rank: int, devices: Iterable[torch.device]) -> dict[str, torch.device]:
    """The RNG keys of a rank whose parameters live on `devices`, each with the device
    whose generator it holds: the CPU generator's (always), and one per accelerator
    (cpu and meta are none: meta has no generator).

    An accelerator is keyed by its rank among the rank's devices of its type, not by
    its index: a rank that used cuda:3 and resumes on cuda:0 (another node, another
    CUDA_VISIBLE_DEVICES) finds its state under `rng/rank=<r>/cuda=0` either way."""
    out = {rng_key(rank): torch.device("cpu")}
    accelerators = sorted({d for d in devices if d.type not in ("cpu", "meta")},
                          key=lambda d: (d.type, -1 if d.index is None else d.index))
    seen: dict[str, int] = {}
    for d in accelerators:
        n = seen[d.type] = seen.get(d.type, -1) + 1
        out[rng_key(rank, d.type, n)] = d
    return out


PARAM_GROUPS_KEY = "optim/param_groups"
"""The optimizer's param groups (hyperparameters and the parameters of each group), as
the canonical JSON bytes of a uint8 tensor: a tensor under a stable dense key travels
through every engine, snapshot and persist as parameters do, with no format change."""


def buffer_key(name: str) -> str:
    """The key of the persistent buffer `name` (as in `model.named_buffers()`)."""
    return dense_key("buffer", name)


def expert_modules(spec: ExpertSpec) -> set[str]:
    """Names of the modules that hold expert tensors: each expert's module in the
    `nn.ModuleList` layout, the container of batched experts. A buffer inside one of
    them differs between expert-parallel ranks, so it cannot be a dense key."""
    out = set()
    for p in spec.params:
        if p.expert_dim is not None:
            out.add(p.name.rpartition(".")[0])
            continue
        parts = p.name.split(".")  # name = <container>.<i>.<rel>, stem = <container>.<rel>
        for j, part in enumerate(parts):
            if part.isdigit() and ".".join(parts[:j] + parts[j + 1:]) == p.stem:
                out.add(".".join(parts[:j + 1]))
                break
    return out


def param_key_of(optim_key: str) -> str:
    """The parameter key (`param/<name>` or `param/<stem>/expert=<g>`) whose optimizer
    state `optim_key` is."""
    base, _, piece = optim_key.partition("@")
    piece = f"@{piece}" if piece else ""
    parsed = parse_expert_key(base)
    if parsed is not None:
        return expert_key("param", parsed[1], parsed[2]) + piece
    return "param/" + base[len("optim/"):].rsplit("/", 1)[0] + piece


def slices(ep: ExpertParam, t: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    """(global id, that expert's part of `t`) for each expert `t` holds (of a DTensor,
    this rank's piece); views."""
    t = local(t).detach()
    if ep.expert_dim is None:
        yield ep.global_ids[0], t
        return
    for i, gid in enumerate(ep.global_ids):
        yield gid, t.select(ep.expert_dim, i)


def _container_of(p: ExpertParam) -> str | None:
    """The ModuleList of a per-expert parameter, from its name and stem: the name has one
    more component, the expert's index (None when that cannot be told)."""
    parts = p.name.split(".")  # name = <container>.<i>.<rel>, stem = <container>.<rel>
    found = [j for j, part in enumerate(parts)
             if part.isdigit() and ".".join(parts[:j] + parts[j + 1:]) == p.stem]
    return ".".join(parts[:found[0]]) if len(found) == 1 else None


_BY_HAND = ("build the ExpertSpec by hand, ExpertSpec(n_experts, n_moe_layers, "
            "params=(ExpertParam(...), ...)), one ExpertParam per expert tensor")


def _batched_size(name: str, container: nn.Module) -> int:
    """The number of local experts of a container of batched [E_local, ...] parameters:
    its own parameters, each at least 2-D, share the leading size (a submodule's
    parameters, a norm inside it, stay dense). Otherwise slicing dim 0 would not give one
    expert's weights and the spec would be silently wrong: JetMoE's attention `experts`
    holds one bias vector of its own (its experts are in two children) and was taken for
    32 experts of a bias. Raises ValueError saying what the container holds and what to
    do."""
    what = f"ExpertSpec: {name!r} ({type(container).__name__})"
    if isinstance(container, nn.ModuleDict):
        raise ValueError(f"{what} is an nn.ModuleDict of experts; moc reads an nn.ModuleList "
                         f"(child i is local expert i) or batched [E_local, ...] tensors: "
                         f"{_BY_HAND}")
    direct = list(container.named_parameters(recurse=False))
    inner = sorted({n.rpartition(".")[0] for n, _ in container.named_parameters() if "." in n})
    sizes = {p.shape[0] for _, p in direct if p.dim() >= 2}
    if direct and len(sizes) == 1 and all(p.dim() >= 2 for _, p in direct):
        return sizes.pop()
    found = ", ".join(f"{n} {tuple(p.shape)}" for n, p in direct) or "no parameters of its own"
    if inner:
        found += f" (and its submodules {', '.join(inner)} hold more)"
    raise ValueError(
        f"{what} is neither an nn.ModuleList of experts nor a module of batched [E_local, "
        f"...] parameters (at least 2-D, one leading size): it holds {found}; {_BY_HAND}")


def _expert_rows(name: str, direct: list[tuple[str, torch.Tensor]],
                 shardings: list[Sharding | None]) -> tuple[int, int]:
    """(global id of the first expert this rank holds, how many) of a container of
    batched DTensor experts: each tensor's rows of dim 0, which must be the same rows
    for every tensor of the container. Raises UnsupportedLayoutError naming the tensor
    otherwise (an expert's tensors on different ranks)."""
    rows = {(sh.mine.offsets[0], sh.mine.shape[0]) if sh else (0, p.shape[0])
            for (_, p), sh in zip(direct, shardings, strict=True)}
    if len(rows) != 1:
        found = ", ".join(f"{rel}: experts {sh.mine.offsets[0]}.."
                          f"{sh.mine.offsets[0] + sh.mine.shape[0] - 1}" if sh else
                          f"{rel}: all" for (rel, _), sh in zip(direct, shardings, strict=True))
        raise UnsupportedLayoutError(
            f"ExpertSpec: the batched experts of {name!r} are sharded differently along "
            f"dim 0 ({found}); every tensor of an expert must be held by the same ranks")
    return rows.pop()


def _expert_piece(sharding: Sharding | None) -> str:
    """The key suffix of each expert's piece of a batched DTensor (dims after the expert
    dim); "" when this rank holds whole experts."""
    if sharding is None or sharding.mine.shape[1:] == sharding.global_shape[1:]:
        return ""
    return Box(sharding.mine.offsets[1:], sharding.mine.shape[1:]).suffix()


def _is_expert_container(name: str, module: nn.Module) -> bool:
    """Named `experts`; or a leaf module (no submodules: a block that holds its gate and
    its experts is not one) that holds batched parameters only and says it holds
    experts: it declares `expert_offset` (moc's `Experts`), or `num_experts`, the
    leading size of each of its parameters (of a DTensor, the global size).

    `num_experts` is how grouped experts say so where their name does not: torchtitan
    0.3.0's `GroupedExperts` is `moe.routed_experts.inner_experts` (`w1_EFD`,
    `w2_EDF`, `w3_EFD`, experts first), 0.2.x's was `moe.experts`. An expert's weights
    are matrices, so one parameter at least is 3-D: a router that declares
    `num_experts` beside its [E, D] weight (transformers v5's `MixtralTopKRouter`) is
    no expert container, nor is torchtitan's, which holds its gate."""
    if name.rsplit(".", 1)[-1] == "experts":
        return True
    if next(module.children(), None) is not None:
        return False
    direct = list(module.parameters(recurse=False))
    if not direct:
        return False
    if getattr(module, "expert_offset", None) is not None:
        return all(p.dim() >= 1 for p in direct)
    n = getattr(module, "num_experts", None)
    return (isinstance(n, int) and not isinstance(n, bool) and n > 0
            and all(p.dim() >= 2 and p.shape[0] == n for p in direct)
            and any(p.dim() >= 3 for p in direct))


