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
    """(layers x experts) checkpoints since each expert was last saved; load-aware breaks
    ties by it, so an idle expert is still saved eventually."""


def sequential(ctx: SelectionContext) -> list[list[int]]:
    """Rotate through the experts, interleaved across layers.

    K = 1 is the paper's rule: layer m saves expert (m + c) mod N at checkpoint c. For
    K > 1 dividing N, layer m saves {(m + c) mod (N/K) + j N/K : j < K}: over N/K
    consecutive checkpoints every expert is saved exactly once, and the K chosen experts
    are N/K apart, i.e. spread over the expert-parallel ranks (which hold contiguous
    blocks of experts). When K does not divide N, a window of K experts starting at
    (m + c K) mod N rotates; every expert is saved at least once per ceil(N/K).
    """
    N, K, c = ctx.n_experts, ctx.k, ctx.checkpoint_index
    if K >= N:
        return [list(range(N)) for _ in range(ctx.n_moe_layers)]
    out = []
    for m in range(ctx.n_moe_layers):
        if N % K == 0:
            stride = N // K
            chosen = [(m + c) % stride + j * stride for j in range(K)]
        else:
            chosen = [(m + c * K + j) % N for j in range(K)]
        out.append(sorted(chosen))
    return out


def load_aware(ctx: SelectionContext) -> list[list[int]]:
    """The K experts per layer with the most unsaved tokens; ties go to the expert saved
    longest ago, then to the lower id (deterministic on every rank)."""
    if ctx.unsaved_tokens is None:
        raise ValueError("load-aware selection needs routed token counts: call "
                         "Checkpointer.record_routing(counts) every step")
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
