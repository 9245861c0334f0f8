"""`RoutingRecorder`: the tokens routed to each expert, counted by forward hooks.

PLT and Dynamic-K (`policy/tokens.py`) need, every step, the assignments this rank routed
to each (MoE layer, global expert). Instead of the loop computing them and calling
`record_routing`, a recorder hooks each MoE layer's router and adds them to the engine's
token ledger as the forward runs:

    ckpt = moc.Checkpointer(model, optimizer, "ckpt/", policy=moc.PECPolicy(k=1))
    ckpt.watch_routing(model)             # once, before the loop; no record_routing

What is hooked (`find_routers`): for each MoE layer of the `ExpertSpec`, the block that
holds the layer's expert container (matched through the spec, never by position in the
model) and its router, the block's child `gate` or `router` (the block: the experts'
nearest ancestor with one, as torchtitan 0.3.0's `moe` holds `router` beside
`routed_experts.inner_experts`). What a forward counted is told by what the outputs
are, not by names or classes:

    the block returns an (E,) integer   the assignments it kept per global expert: moc's
    tensor last                         MoE, (y, aux, counts_E), after capacity dropping
    else the router's output holds      the global expert ids it chose: transformers v5
    exactly one integer tensor (an      `*TopKRouter`s return (logits, scores, ids), some
    (E,) one beside it: its counts)     with a fourth member (Zaya, Inkling); torchtitan's
                                        (scores, ids, scores) and 0.2.x's (scores, ids,
                                        counts)
    else router logits: a float         top-k of their float32 softmax, k = the router's
    tensor, or a tuple's last float     or the block's `top_k`: transformers v4's `gate`
    tensor with E columns               (an nn.Linear), Llama 4's (scores, logits)
    anything else                       `routers={layer: module}` and `indices=fn(module,
                                        inputs, output)` returning the global expert ids
                                        chosen; or `observe(layer, ids)`

A block with no router child is refused when the recorder is built. Every MoE family of
transformers 5.24 that builds on the CPU is tested (tests/checkpoint/test_routing_zoo.py)
against the ids its experts were called with.

Which forwards count: those of a module in training mode with grad enabled (eval and
`torch.no_grad()` forwards are not counted). With expert parallelism a router sees this
rank's tokens and picks global expert ids, so a rank's counts are over global experts,
as `record_routing` expects; they are summed over ranks at a checkpoint. Gradient
accumulation: every micro-batch counts (each one's update of an expert is lost with it).

Activation recomputation (`torch.utils.checkpoint`) runs a checkpointed forward again
inside backward, recognised by running inside an autograd graph task. Each layer's
tokens count once: non-reentrant checkpointing's first forward counts and its recompute
is skipped; reentrant checkpointing's first forward runs without grad (not counted), so
its recompute counts. A hook tells them apart by a per-layer tally of counted forwards
not yet recomputed (see docs/DECISIONS.md, "Issue 13: routing recorded for you").

Hot path: per MoE layer per forward, two hooks (the router's keeps a reference to its
output for the block's, which reads it), one scatter-add of the ids into an (E,) count
(or the layer's own counts) and one add into the ledger, on the tensors' own device: no
host sync, no communication. The hooks return None, so the model's outputs and loss are
the model's own, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from moc.checkpoint.parts import EngineParts, unwrap
from moc.checkpoint.policy.tokens import TokenLedger
from moc.checkpoint.shards import local
from moc.checkpoint.spec import ExpertSpec

IndicesFn = Callable[[nn.Module, tuple, Any], torch.Tensor]
"""fn(module, inputs, output) -> integer tensor of the global expert ids the module chose
for the tokens of this forward (any shape: one id per token and choice)."""

ROUTER_NAMES = ("gate", "router")
"""The children of an MoE block that route its tokens (transformers, moc)."""

_graph_task_id: Callable[[], int] = getattr(torch._C, "_current_graph_task_id", lambda: -1)
"""-1 outside autograd's backward. A forward that runs inside backward is a recompute of
activation checkpointing; without this private hook (a future torch) none is detected."""


@dataclass(frozen=True)
class Hooked:
    """What is hooked for one MoE layer, and how its forward is read."""

    module: nn.Module
    """The router: its output holds the expert ids (or logits) of each forward."""
    block: nn.Module | None = None
    """The MoE block around the router, whose output is read first: an (E,) integer
    tensor last is the counts the block kept (moc's MoE, after capacity dropping). None
    for a router given by `routers=`: its output alone is read."""
    top_k: int | None = None
    """k of a router that returns only logits (the router's or its block's `top_k`)."""


class _Counting:
    """Whether a forward of one MoE layer counts: a training forward with grad, counted
    once under activation recomputation (module docstring). One per layer, called once
    per forward by the hook that records."""

    def __init__(self) -> None:
        self.unrecomputed = 0  # counted forwards of this layer not recomputed (yet)

    def __call__(self, module: nn.Module) -> bool:
        if not (module.training and torch.is_grad_enabled()):
            return False
        if _graph_task_id() != -1:  # activation checkpointing's recompute
            if self.unrecomputed:  # non-reentrant: its first forward counted
                self.unrecomputed -= 1
                return False
            return True  # reentrant: the first forward ran without grad; this one counts
        self.unrecomputed += 1
        return True


class RoutingRecorder:
    """Counts the tokens each MoE layer routes to each global expert, by forward hooks,
    into a token ledger (an engine's, through `watch_routing`, or its own).

    `routers`: None finds one per MoE layer (see the module docstring); else a mapping
    {MoE layer: module or module name} (or a sequence in layer order): only those are
    hooked, and other layers are counted only through `observe`. `indices`: how to read
    the chosen global expert ids out of a hooked router's forward; None reads the counts
    by what the outputs are (the block's counts, else the router's ids or logits).
    `top_k`: the k of a router that returns only logits (default: the router's or its
    block's `top_k`).

    Owner: the caller's thread, which runs the forwards (the ledger's `record_layer`).
    `remove()` (or leaving a `with` block) takes the hooks off; a removed recorder
    counts nothing more.
    """

    def __init__(self, model: nn.Module, spec: ExpertSpec | None = None, *,
                 ledger: TokenLedger | None = None,
                 routers: Mapping[int, nn.Module | str] | Sequence[nn.Module | str] | None
                 = None, indices: IndicesFn | None = None, top_k: int | None = None) -> None:
        if top_k is not None and top_k < 1:
            raise ValueError(f"RoutingRecorder top_k must be >= 1 or None, got {top_k}")
        model = unwrap(model)
        self.spec = spec if spec is not None else ExpertSpec.infer(model)
        hooked = (find_routers(model, self.spec) if routers is None
                  else _named_routers(model, self.spec, routers))
        if indices is None and top_k is None:
            _refuse_logits_without_k(hooked, self.spec.n_experts)
        self.routers: dict[int, nn.Module] = {m: h.module for m, h in sorted(hooked.items())}
        """The router hooked for each MoE layer (found ones: its block is hooked too)."""
        self._own_ledger = ledger is None
        self.ledger = ledger if ledger is not None else TokenLedger(
            self.spec.n_moe_layers, self.spec.n_experts)
        # Refuses a second recorder, or one after record_routing; an engine's ledger
        # ends its recorder with the engine (`TokenLedger.end_watch`).
        self.ledger.watch(self.remove)
        self._handles: list | None = [
            module.register_forward_hook(hook)
            for m, h in sorted(hooked.items())
            for module, hook in self._hooks(m, h, indices, top_k)]

    def _hooks(self, layer: int, hooked: Hooked, indices: IndicesFn | None,
               top_k: int | None) -> list[tuple[nn.Module, Callable]]:
        """The (module, forward hook) pairs that count one MoE layer."""
        n_experts, ledger = self.spec.n_experts, self.ledger
        k = top_k or hooked.top_k
        counting = _Counting()
        if indices is not None or hooked.block is None:
            def router_hook(module: nn.Module, inputs: tuple, output: Any) -> None:
                if counting(module):
                    ledger.record_layer(layer, (
                        bincount(indices(module, inputs, output), n_experts)
                        if indices is not None else read_counts(module, output, n_experts, k)))

            return [(hooked.module, router_hook)]

        # The router runs inside its block's forward: its hook keeps its output for the
        # block's hook, which runs last and knows whether the block returned its counts.
        routed: list[Any] = [None]

        def keep(module: nn.Module, inputs: tuple, output: Any) -> None:
            routed[0] = output

        def block_hook(block: nn.Module, inputs: tuple, output: Any) -> None:
            router_output, routed[0] = routed[0], None  # never held past this forward
            if not counting(block):
                return
            counts_E = kept_counts(output, n_experts)
            if counts_E is None:
                if router_output is None:
                    raise RuntimeError(
                        f"{type(block).__name__}'s forward did not call its router "
                        f"{type(hooked.module).__name__} (a fused kernel?), so its routing "
                        "cannot be read: pass watch_routing(model, routers={layer: module}, "
                        "indices=fn) for the module that chooses the experts")
                counts_E = read_counts(hooked.module, router_output, n_experts, k)
            ledger.record_layer(layer, counts_E)

        return [(hooked.module, keep), (hooked.block, block_hook)]

    def observe(self, layer: int, expert_ids: torch.Tensor) -> None:
        """Count the global expert ids one MoE layer chose in this forward, for a model
        whose router cannot be hooked: call it from the forward of training steps. Not
        counted without grad or inside backward (a recompute: this call cannot tell a
        reentrant one from another, so with activation checkpointing call it outside
        the checkpointed part)."""
        if not 0 <= layer < self.spec.n_moe_layers:
            raise ValueError(f"observe: MoE layer {layer} is outside 0.."
                             f"{self.spec.n_moe_layers - 1} (the spec's MoE layers)")
        if self._handles is None:
            raise RuntimeError("observe on a removed RoutingRecorder: it counts nothing more")
        if torch.is_grad_enabled() and _graph_task_id() == -1:
            self.ledger.record_layer(layer, bincount(expert_ids, self.spec.n_experts))

    def take(self) -> torch.Tensor:
        """(MoE layers, experts) counts since the last `take`, on the CPU, reset to zero;
        only for a recorder with its own ledger (an engine's takes them at a checkpoint)."""
        if not self._own_ledger:
            raise RuntimeError("this recorder feeds a checkpoint engine, which takes its "
                               "counts at each checkpoint; build RoutingRecorder(model, "
                               "spec) without a ledger to read counts yourself")
        return self.ledger.take_pending()

    def remove(self) -> None:
        """Take the hooks off; idempotent."""
        if self._handles is None:
            return
        for handle in self._handles:
            handle.remove()
        self._handles = None
        self.ledger.unwatch()

    def __enter__(self) -> RoutingRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


class EngineRouting:
    """The routed-token calls of an engine built on `EngineParts` (`moc.Checkpointer`,
    `moc.TwoLevelCheckpointer`): both feed the parts' token ledger."""

    parts: EngineParts

    def record_routing(self, counts: torch.Tensor) -> None:
        """The manual alternative to `watch_routing`: (MoE layers, global experts) tokens
        this rank routed this step. Refused while a recorder watches (double count)."""
        self.parts.ledger.record(counts)

    def watch_routing(self, model: nn.Module, **options: Any) -> RoutingRecorder:
        """Count routed tokens by forward hooks on `model`'s routers, for PLT and
        Dynamic-K, instead of calling `record_routing`: once, before the loop. Options:
        `RoutingRecorder`'s (`routers`, `indices`, `top_k`); `remove()` ends it."""
        return RoutingRecorder(model, self.parts.spec, ledger=self.parts.ledger, **options)


def bincount(ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """(E,) int64 count of each id, on the ids' device (of a DTensor, its local ids). A
    scatter-add, not `torch.bincount`, which on CUDA reads the largest id back to the host
    (a sync).
    Ids outside 0..E-1 raise on the CPU (and trip a device assert on CUDA)."""
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TypeError(f"routing indices must be an integer tensor of global expert ids, "
                        f"got {ids.dtype}")
    # A DTensor router's output (tensor or sequence parallel): the tokens this rank
    # routed, as the ledger sums every rank's counts; no collective, no sync.
    flat = local(ids).reshape(-1).long()
    return torch.zeros(n_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))


def kept_counts(output: Any, n_experts: int) -> torch.Tensor | None:
    """The (E,) counts a block returns last (moc's MoE: the assignments it kept), or None
    when its output does not end with an (E,) integer tensor. Shapes and dtypes only (no
    sync)."""
    last = output[-1] if isinstance(output, tuple) and output else None
    return last if _is_int(last) and tuple(last.shape) == (n_experts,) else None


def read_counts(module: nn.Module, output: Any, n_experts: int, top_k: int | None
                ) -> torch.Tensor:
    """A router's (E,) counts, read by what its output is (module docstring)."""
    members = _members(output)
    ids = [t for t in members if _is_int(t)]
    if len(ids) > 1:
        # torchtitan 0.2.x: (scores, ids, counts per expert); the (E,) one is the counts
        # of this forward, the other one the ids chosen.
        ids = [t for t in ids if tuple(t.shape) != (n_experts,)] or ids
    if len(ids) == 1:  # transformers v5: (logits, scores, ids[, ...]); moc's Routing
        return bincount(ids[0], n_experts)
    if len(ids) > 1:
        raise TypeError(
            f"{type(module).__name__} returns {len(ids)} integer tensors; which holds the "
            "chosen experts is not clear: pass watch_routing(model, routers={layer: "
            "module}, indices=fn) with fn(module, inputs, output) -> the global expert ids")
    logits = [t for t in members if isinstance(t, torch.Tensor)
              and t.dtype.is_floating_point and t.dim() and t.shape[-1] == n_experts]
    if logits:
        k = top_k or getattr(module, "top_k", None)
        if k is None:
            raise ValueError(f"{type(module).__name__} returns router logits but no top_k "
                             "is known: pass watch_routing(model, top_k=k)")
        # transformers v4: top-k of the float32 softmax, ties broken as the block does.
        return bincount(logits[-1].float().softmax(dim=-1).topk(k, dim=-1).indices,
                        n_experts)
    raise TypeError(
        f"cannot read the experts {type(module).__name__} chose from its output "
        f"({type(output).__name__}); pass watch_routing(model, routers={{layer: module}}, "
        "indices=fn) with fn(module, inputs, output) -> LongTensor of global expert ids")


def _refuse_logits_without_k(hooked: Mapping[int, Hooked], n_experts: int) -> None:
    """Refuse at the call, not at the first forward, a router that can only return
    logits (an `nn.Linear` with an output per expert) when no k is known to take their
    top-k with: the recorder could not count that layer (issue 50: a 20-line traceback
    from a hook at the first forward). A block that returns its own counts would not
    need k; one that does is rare enough to be told to pass `top_k=` all the same."""
    for layer, h in sorted(hooked.items()):
        if (h.top_k is None and isinstance(h.module, nn.Linear)
                and h.module.out_features == n_experts):
            raise ValueError(
                f"MoE layer {layer}'s router is an nn.Linear returning logits, and neither it "
                f"nor its block{' ' + type(h.block).__name__ if h.block is not None else ''} "
                "has a top_k: pass watch_routing(model, top_k=k), k the experts each token "
                "is routed to")


def _members(output: Any) -> list[Any]:
    """The output itself if a tensor, else the members of a tuple or list, or the fields
    of an object (moc's `Routing` dataclass): one level, no deeper."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return list(output)
    if isinstance(output, Mapping):
        return list(output.values())
    return list(getattr(output, "__dict__", {}).values())


def _is_int(t: object) -> bool:
    return (isinstance(t, torch.Tensor) and not t.dtype.is_floating_point
            and not t.dtype.is_complex and t.dtype != torch.bool)


def layer_containers(spec: ExpertSpec) -> list[set[str]]:
    """The names of each MoE layer's expert containers (usually one), in layer order."""
    out: list[set[str]] = [set() for _ in range(spec.n_moe_layers)]
    for p in spec.params:
        if p.expert_dim is not None:
            out[p.moe_layer].add(p.name.rpartition(".")[0])
            continue
        parts = p.name.split(".")  # <container>.<i>.<rel>, stem <container>.<rel>
        for j, part in enumerate(parts):
            if part.isdigit() and ".".join(parts[:j] + parts[j + 1:]) == p.stem:
                out[p.moe_layer].add(".".join(parts[:j]))
                break
    return out


def find_routers(model: nn.Module, spec: ExpertSpec) -> dict[int, Hooked]:
    """What to hook for each MoE layer of `spec`: the block that holds the layer's
    experts and its router (its child `gate` or `router`; the nearest ancestor of the
    experts with such a child). Raises ValueError naming the
    layers it cannot map."""
    named = dict(model.named_modules())
    found: dict[int, Hooked] = {}
    missing = []
    per_layer = layer_containers(spec)
    for layer, containers in enumerate(per_layer):
        blocks = {c.rpartition(".")[0] for c in containers}
        block_name = blocks.pop() if len(blocks) == 1 else None
        others = set().union(*per_layer[:layer], *per_layer[layer + 1:])
        block, router = _routed_block(named, block_name, others)
        if router is None:
            where = (f"block {block_name or '(the model)'}" if block is not None
                     else "experts in several modules")
            missing.append(f"layer {layer} ({where}, experts {', '.join(sorted(containers))})")
            continue
        found[layer] = Hooked(router, block, _top_k(router) or _top_k(block))
    if missing:
        raise ValueError(
            f"found a router for {len(found)} of the {spec.n_moe_layers} MoE layers: no "
            f"child named {' or '.join(ROUTER_NAMES)} next to the experts of "
            f"{'; '.join(missing)}. Pass the routers: watch_routing(model, routers="
            "{layer: module, ...}, indices=fn) with fn(module, inputs, output) -> global "
            "expert ids, or call recorder.observe(layer, ids) from the forward")
    return found


def _top_k(module: nn.Module | None) -> int | None:
    """A module's k as transformers and torchtitan name it: `top_k` (transformers'
    blocks, torchtitan's router), else `num_experts_per_tok` (a config's name, kept on
    some blocks)."""
    for name in ("top_k", "num_experts_per_tok"):
        k = getattr(module, name, None)
        if isinstance(k, int) and not isinstance(k, bool) and k >= 1:
            return k
    return None


def _routed_block(named: dict[str, nn.Module], name: str | None, others: set[str]
                  ) -> tuple[nn.Module | None, nn.Module | None]:
    """(block, router) for experts whose parent module is `name`: the parent if it has
    a router child, else its nearest ancestor that has one (torchtitan 0.3.0: the
    experts are `moe.routed_experts.inner_experts`, the router `moe.router`) and holds
    no other MoE layer's experts (`others`); (the parent, None) when there is none."""
    block = named.get(name) if name is not None else None
    while name is not None:
        if any(o == name or o.startswith(f"{name}.") or not name for o in others):
            break  # this module holds another layer's experts: not this layer's block
        router = next((r for r in (getattr(named[name], n, None) for n in ROUTER_NAMES)
                       if isinstance(r, nn.Module)), None)
        if router is not None:
            return named[name], router
        name = name.rpartition(".")[0] if name else None
    return block, None


def _named_routers(model: nn.Module, spec: ExpertSpec,
                   routers: Mapping[int, nn.Module | str] | Sequence[nn.Module | str]
                   ) -> dict[int, Hooked]:
    """`routers` as given: {MoE layer: module or its name} (a sequence: in layer order)."""
    if not isinstance(routers, Mapping):
        routers = dict(enumerate(routers))
    named = dict(model.named_modules())
    out: dict[int, Hooked] = {}
    for layer, module in routers.items():
        if not (isinstance(layer, int) and 0 <= layer < spec.n_moe_layers):
            raise ValueError(f"routers: key {layer!r} is not an MoE layer of the spec "
                             f"(0..{spec.n_moe_layers - 1}, in the spec's layer order)")
        if isinstance(module, str):
            if module not in named:
                raise ValueError(f"routers: the model has no module named {module!r}")
            module = named[module]
        if not isinstance(module, nn.Module):
            raise ValueError(f"routers[{layer}] must be an nn.Module or its name, got "
                             f"{type(module).__name__}")
        out[layer] = Hooked(module)
    if len({id(h.module) for h in out.values()}) < len(out):
        raise ValueError("routers: one module is given for two MoE layers; each layer "
                         "needs its own router")
    return out
