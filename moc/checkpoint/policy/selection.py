"""What a checkpoint saves: the PEC policy and its expert selection (pure functions).

Partial Experts Checkpointing saves all non-expert state and K of the N experts of every
MoE layer. `select_experts` decides which K from a `SelectionContext`, identically on
every rank, so no communication is needed beyond the token counts the context carries.
"""

from __future__ import annotations

from dataclasses import dataclass

SELECTIONS = ("sequential", "load-aware", "full")
APPLY_TO = ("weights", "optimizer", "both")


@dataclass(frozen=True)
class PECPolicy:
    """Partial Experts Checkpointing. `PECPolicy.full()` saves every expert."""

    k: int | None = 1
    """Experts saved per MoE layer at each checkpoint (K_pec); None means all N."""
    selection: str = "sequential"
    """sequential: rotate, every expert once per N/K checkpoints, spread over EP ranks;
    load-aware: the K experts with the most tokens routed since their last save;
    full: all experts (K = N)."""
    apply_to: str = "both"
    """Which expert state is partial: weights (W), optimizer (O) or both (WO). The other
    part is saved for every expert."""
    dynamic_k: bool = False
    """Double K after a recovery whose PLT since K last changed exceeds plt_threshold."""
    plt_threshold: float = 0.0375
    """The paper's accuracy budget: PLT below 3.75% kept validation loss within noise."""

    def __post_init__(self) -> None:
        if self.selection not in SELECTIONS:
            raise ValueError(f"PECPolicy.selection must be one of {', '.join(SELECTIONS)}, "
                             f"got {self.selection!r}")
        if self.apply_to not in APPLY_TO:
            raise ValueError(f"PECPolicy.apply_to must be one of {', '.join(APPLY_TO)}, "
                             f"got {self.apply_to!r}")
        if self.k is not None and self.k < 1:
            raise ValueError(f"PECPolicy.k must be >= 1 or None (all experts), got {self.k}")
        if not 0 < self.plt_threshold < 1:
            raise ValueError(f"PECPolicy.plt_threshold must be in (0, 1), "
                             f"got {self.plt_threshold}")

    @classmethod
    def full(cls) -> PECPolicy:
        return cls(k=None, selection="full")

    def initial_k(self, n_experts: int) -> int:
        if self.selection == "full" or self.k is None:
            return n_experts
        return min(self.k, n_experts)

    def to_dict(self) -> dict[str, object]:
        return {"k": self.k, "selection": self.selection, "apply_to": self.apply_to,
                "dynamic_k": self.dynamic_k, "plt_threshold": self.plt_threshold}


@dataclass(frozen=True)
class SelectionContext:
    """What a selection may look at; the same on every rank."""

    checkpoint_index: int
    """How many partial checkpoints came before this one in the chain (c)."""
    n_experts: int
    n_moe_layers: int
    k: int
    unsaved_tokens: tuple[tuple[int, ...], ...] | None = None
    """(layers x experts) tokens routed to each expert since its newest saved copy,
    summed over all ranks; needed by load-aware."""
    staleness: tuple[tuple[int, ...], ...] | None = None
    """(layers x experts) steps since each expert was last saved; load-aware breaks
    ties by it, so an idle expert is still saved eventually."""
    ep: int = 1
    """Expert-parallel degree: ep rank r holds the contiguous block of experts
    [r N/ep, (r + 1) N/ep). Sequential selection interleaves over these blocks."""


def interleaves(n_experts: int, ep: int) -> bool:
    """Whether sequential selection alternates over the ep ranks' blocks of experts (ep >
    1 dividing N); then any K consecutive positions put ceil(K / ep) or fewer on a rank."""
    return ep > 1 and n_experts % ep == 0


def interleaved(position: int, n_experts: int, ep: int) -> int:
    """The expert at `position` of the order that visits the ep ranks in turn:
    0, N/ep, 2N/ep, ..., 1, N/ep + 1, ...  (the identity when ep = 1 or ep does not
    divide N)."""
    if not interleaves(n_experts, ep):
        return position
    return (position % ep) * (n_experts // ep) + position // ep


def sequential(ctx: SelectionContext) -> list[list[int]]:
    """Rotate through the experts, interleaved across layers and expert-parallel ranks.

    K = 1 is the paper's rule: layer m takes position (m + c) mod N at checkpoint c. For
    K > 1 dividing N, layer m takes the window of K consecutive positions starting at
    K (m + c) mod N: the N/K windows partition the positions, so over N/K consecutive
    checkpoints every position is taken exactly once. When K does not divide N the window
    starts at (m + c K) mod N and every position is taken at least once per ceil(N/K).

    Positions map to experts through `interleaved`, which alternates between the ep
    ranks' blocks of experts. With one expert per rank (the paper's example) that is the
    identity; with several it is what spreads one checkpoint's experts, and with them the
    write work, over the ranks instead of piling consecutive ids onto one rank: the K
    consecutive positions of a window land on K different ranks (K <= ep), and the
    layers' windows alternate between ranks.
    """
    N, K, c = ctx.n_experts, ctx.k, ctx.checkpoint_index
    if K >= N:
        return [list(range(N)) for _ in range(ctx.n_moe_layers)]
    out = []
    for m in range(ctx.n_moe_layers):
        start = K * (m + c) % N if N % K == 0 else (m + c * K) % N
        positions = [(start + j) % N for j in range(K)]
        out.append(sorted(interleaved(p, N, ctx.ep) for p in positions))
    return out


def load_aware(ctx: SelectionContext) -> list[list[int]]:
    """The K experts per layer with the most unsaved tokens; ties go to the expert saved
    longest ago, then to the lower id (deterministic on every rank)."""
    if ctx.unsaved_tokens is None:
        raise ValueError("load-aware selection needs routed token counts: call "
                         "ckpt.watch_routing(model) before the loop, or "
                         "ckpt.record_routing(counts) every step")
    N, K = ctx.n_experts, min(ctx.k, ctx.n_experts)
    out = []
    for m in range(ctx.n_moe_layers):
        tokens = ctx.unsaved_tokens[m]
        stale = ctx.staleness[m] if ctx.staleness is not None else (0,) * N
        ranked = sorted(range(N), key=lambda e: (-tokens[e], -stale[e], e))
        out.append(sorted(ranked[:K]))
    return out


def select_experts(selection: str, ctx: SelectionContext) -> list[list[int]]:
    """Global expert ids to save in each MoE layer, sorted."""
    if selection == "full" or ctx.k >= ctx.n_experts:
        return [list(range(ctx.n_experts)) for _ in range(ctx.n_moe_layers)]
    if selection == "sequential":
        return sequential(ctx)
    if selection == "load-aware":
        return load_aware(ctx)
    raise ValueError(f"unknown selection {selection!r}; expected one of {', '.join(SELECTIONS)}")
