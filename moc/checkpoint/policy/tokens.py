"""Routed-token accounting, the Proportion of Lost Tokens (PLT) and Dynamic-K: one owner.

Each step the ledger receives the tokens this rank routed to every (MoE layer, global
expert): from the loop's `record_routing`, or from a `RoutingRecorder`'s hooks as the
forward runs (`watch_routing`). The counts stay local (one tensor add, no communication) and
are summed over ranks only at a checkpoint. Every manifest carries, per (layer, expert):

    cumulative  assignments routed to the expert from the start of the run to this step
    at_save     the cumulative count when the expert's newest saved copy was taken
    lost        per layer, assignments lost by earlier faults (carried along the run)

Recovering a step s, an expert restored from an older copy loses the updates of the
tokens routed to it between that copy and s:  lost_e = cumulative_e - at_copy_e, where
at_copy_e is the cumulative count when the copy restored was taken (`at_save` for a copy
on storage, the snapshot's count for a copy in memory). PLT (paper, sec. 2) = mean over
MoE layers i of  sum_j L_ij / (T_i * topk_i), where the denominator is every assignment
of layer i so far (sum_e cumulative).

Dynamic-K (paper, sec. 3): after each recovery, if the PLT lost since K last changed
exceeds the threshold, K doubles (up to N). Every kind of recovery (from memory, from
storage, mixed) accounts through `TokenLedger.recover`, so they cannot disagree.

One source only: `record` refuses while a recorder watches (it would count twice).

Without counts (the loop never called `record_routing`, no recorder watched) nothing
says what a recovery that restored older experts lost: its PLT is unknown (None), never
a 0 that was not measured, and a partial policy warns at the first checkpoint
(`warn_if_untracked`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


class RoutingNotRecordedWarning(UserWarning):
    """A partial checkpoint policy runs without routed-token counts."""


class PLTOverBudgetWarning(UserWarning):
    """A recovery left the run's PLT past its budget (`plt_threshold`)."""


def format_plt(plt: float | None, budget: float) -> str:
    """PLT as every message of moc shows it: a percentage against the budget (issue 50:
    the demo printed `PLT 0.00% (budget 3.75%)` and `moc train` `PLT 0.2340`)."""
    if plt is None:
        return f"PLT unknown (no routing recorded; budget {100 * budget:.2f}%)"
    over = ", OVER" if plt > budget else ""
    return f"PLT {100 * plt:.2f}% (budget {100 * budget:.2f}%{over})"


@dataclass(frozen=True)
class PLTReport:
    """What one recovery lost, and the K in force after it."""

    lost_tokens: int | None
    """Assignments lost by this recovery, over all layers (None: unknown)."""
    lost_per_layer: list[int] | None
    plt: float | None
    """Cumulative PLT of the run, this recovery included (None: unknown, no routing was
    recorded and some expert came back older than the step restored)."""
    k: int = 0
    """K_pec after this recovery (Dynamic-K may have raised it)."""
    k_before: int = 0
    """K_pec before Dynamic-K judged this recovery."""


@dataclass
class TokenLedger:
    """Token counts, PLT and K_pec of one run.

    Owners: `record`, `record_layer`, `watch` and `take_pending` (this rank's counts of
    the current interval) belong to the caller's thread, which trains; everything else
    (the counts summed over ranks, lost tokens, K) to whoever runs the checkpoint's
    plan: the caller's thread in the synchronous engine, the snapshot thread in the
    two-level one (whose caller touches it only when no plan runs: after
    `wait_for_snapshot`).
    """

    n_moe_layers: int
    n_experts: int
    k: int = 0
    """K_pec in force: experts per MoE layer a partial checkpoint saves (0: all N)."""
    dynamic_k: bool = False
    plt_threshold: float = 0.0375
    cumulative: torch.Tensor = field(init=False)
    at_save: torch.Tensor = field(init=False)
    lost: torch.Tensor = field(init=False)
    lost_base: torch.Tensor = field(init=False)
    """Per-layer lost tokens when K last changed: Dynamic-K judges what was lost since."""
    watched: bool = field(init=False, default=False)
    """A `RoutingRecorder` counts into this ledger (`record_layer`); `record` refuses."""
    _pending: torch.Tensor = field(init=False)
    _warned: bool = field(init=False, default=False)
    _remove: Callable[[], None] | None = field(init=False, default=None)
    """The watching recorder's `remove` (`end_watch`)."""
    _recorded: bool = field(init=False, default=False)
    """`record` (the loop's `record_routing`) was called in this run."""

    def __post_init__(self) -> None:
        shape = (self.n_moe_layers, self.n_experts)
        self.k = self.k or self.n_experts
        self.cumulative = torch.zeros(shape, dtype=torch.int64)
        self.at_save = torch.zeros(shape, dtype=torch.int64)
        self.lost = torch.zeros(self.n_moe_layers, dtype=torch.int64)
        self.lost_base = torch.zeros(self.n_moe_layers, dtype=torch.int64)
        self._pending = torch.zeros(shape, dtype=torch.int64)

    # -- the caller's thread ---------------------------------------------------------------

    def record(self, counts: torch.Tensor) -> None:
        """Add one step's local (layers x experts) counts. Hot path: one add on the
        counts' own device, no host sync, no communication."""
        if self.watched:
            raise ValueError(
                "record_routing while watch_routing's RoutingRecorder counts the same "
                "tokens would count every token twice: drop the record_routing call, or "
                "call recorder.remove() first to count by hand")
        self._recorded = True
        if counts.shape != self._pending.shape:
            raise ValueError(f"record_routing expects counts of shape (MoE layers, experts) = "
                             f"{tuple(self._pending.shape)}, got {tuple(counts.shape)}")
        if self._pending.device != counts.device:
            self._pending = self._pending.to(counts.device)
        self._pending += counts.detach()

    def record_layer(self, layer: int, counts_E: torch.Tensor) -> None:
        """Add one MoE layer's (E,) counts of one forward (a `RoutingRecorder` hook).
        Hot path: one add on the counts' own device, no host sync, no communication."""
        if self._pending.device != counts_E.device:
            self._pending = self._pending.to(counts_E.device)
        self._pending[layer] += counts_E.detach()

    def watch(self, remove: Callable[[], None] | None = None) -> None:
        """A `RoutingRecorder` starts counting into this ledger: refused when one already
        does, or when the loop records counts itself (either would count twice).
        `remove`: takes the recorder's hooks off, at `end_watch`."""
        if self.watched:
            raise ValueError("this checkpointer already watches a model's routing; one "
                             "RoutingRecorder counts every MoE layer (remove() it first)")
        if self._recorded:
            raise ValueError("watch_routing after record_routing would count every token "
                             "twice: use one of them (watch_routing, before the loop)")
        self.watched = True
        self._remove = remove

    def unwatch(self) -> None:
        self.watched = False
        self._remove = None

    def end_watch(self) -> None:
        """The engine that owns this ledger ends (closed or abandoned): its recorder's
        hooks come off the model. A loop that makes a new engine on the same model (in-job
        recovery, `moc.run`) would otherwise keep counting into every engine it had."""
        if self._remove is not None:
            self._remove()

    def take_pending(self, wait: bool = True) -> torch.Tensor:
        """This rank's counts since the last checkpoint (on the CPU), reset to zero; the
        engine sums them over ranks (`Dist`) and hands them to `add_synced`.

        Counts kept on a CUDA device (a `RoutingRecorder` counting where the router
        runs) are copied to the host. With `wait=False` the copy is only queued on the
        current stream, into pinned memory, and nothing waits for the device: the
        returned tensor holds the counts once the work queued so far is done (the
        two-level engine's `ready` event, which its snapshot thread waits for). A
        blocking copy here made every checkpointed step wait for the device to finish
        the step (94 ms of a 195 ms step on an H200)."""
        pending = self._pending
        self._pending = torch.zeros_like(pending)
        if pending.device.type != "cuda" or wait:
            return pending.to("cpu", torch.int64)
        host = torch.empty(pending.shape, dtype=torch.int64, pin_memory=True)
        host.copy_(pending, non_blocking=True)
        return host

    # -- the plan ----------------------------------------------------------------------------

    def add_synced(self, summed: torch.Tensor) -> None:
        """Fold counts already summed over every rank into `cumulative`."""
        self.cumulative += summed.view(self.cumulative.shape)

    def unsaved(self) -> torch.Tensor:
        """(layers x experts) tokens routed to each expert since its newest saved copy."""
        return self.cumulative - self.at_save

    def at_save_after(self, written: list[list[int]]) -> torch.Tensor:
        """`at_save` as it is once the experts `written` (per layer) are saved now."""
        at_save = self.at_save.clone()
        for m, experts in enumerate(written):
            at_save[m, experts] = self.cumulative[m, experts]
        return at_save

    def committed(self, tokens: dict[str, Any]) -> None:
        """A checkpoint was committed: its `at_save` (`tokens` of its manifest) is now
        where every expert's newest persisted copy stands."""
        self.at_save = torch.tensor(tokens["at_save"], dtype=torch.int64)

    def to_json(self) -> dict[str, Any]:
        """The manifest's `tokens` (without `at_save` after this checkpoint; see
        `at_save_after`)."""
        return {"cumulative": self.cumulative.tolist(), "at_save": self.at_save.tolist(),
                "lost": self.lost.tolist()}

    def policy_json(self) -> dict[str, Any]:
        """What the manifest's `policy` carries of this ledger: K and `lost_base`."""
        return {"k": self.k, "lost_base": self.lost_base.tolist()}

    def load_json(self, d: dict[str, Any]) -> None:
        """Restore the counts of a manifest or snapshot; an empty dict (no accounting
        saved) starts from zeros. Counts recorded since belong to steps that will be
        redone, so they are dropped."""
        self._pending = torch.zeros_like(self._pending)
        if not d:
            return
        self.cumulative = torch.tensor(d["cumulative"], dtype=torch.int64)
        self.at_save = torch.tensor(d["at_save"], dtype=torch.int64)
        self.lost = torch.tensor(d["lost"], dtype=torch.int64)
        if self.cumulative.shape != (self.n_moe_layers, self.n_experts):
            raise ValueError(f"token counts of shape {tuple(self.cumulative.shape)} do not fit "
                             f"{self.n_moe_layers} MoE layers x {self.n_experts} experts")

    # -- recovery ----------------------------------------------------------------------------

    @property
    def tracked(self) -> bool:
        """Whether any routing was recorded in this run (summed over ranks)."""
        return bool(self.cumulative.any())

    def recover(self, at_copy: torch.Tensor, saved_policy: dict[str, Any],
                stale: bool = True, warn: bool = False) -> PLTReport:
        """Account a recovery and apply Dynamic-K; call after `load_json`.

        `at_copy` is the (layers x experts) cumulative count at the copy of each expert
        that was restored. `saved_policy` is the policy state the restored checkpoint
        carries ({"k", "lost_base"}, see `policy_json`): a K that Dynamic-K had raised
        in this run is kept, otherwise the K the user configured stays. `stale`: whether
        some expert came back from a copy older than the step restored; without counts
        (`tracked`) such a recovery's loss is unknown and reported as None. `warn` (one
        rank's): a `PLTOverBudgetWarning` when the PLT is now past the budget.
        """
        if self.dynamic_k and "k" in saved_policy:
            self.k = max(self.k, int(saved_policy["k"]))
            self.lost_base = torch.tensor(
                saved_policy.get("lost_base", [0] * self.n_moe_layers), dtype=torch.int64)
        k_before = self.k
        if stale and not self.tracked:
            return PLTReport(None, None, None, self.k, k_before)
        lost_per_layer = (self.cumulative - at_copy).sum(dim=1)
        self.lost += lost_per_layer
        if (self.dynamic_k and self.k < self.n_experts
                and self.plt(self.lost_base) > self.plt_threshold):
            self.k = min(2 * self.k, self.n_experts)
            self.lost_base = self.lost.clone()
        report = PLTReport(int(lost_per_layer.sum()), lost_per_layer.tolist(), self.plt(),
                           self.k, k_before)
        if warn and report.plt is not None and report.plt > self.plt_threshold:
            then = (f"Dynamic-K raised K from {k_before} to {self.k} experts per layer"
                    if self.k != k_before else
                    "K stays at its maximum" if self.k >= self.n_experts else
                    f"K stays {self.k}: pass PECPolicy(dynamic_k=True) to raise it, or a "
                    "larger k")
            warnings.warn(f"this recovery lost {report.lost_tokens} routed tokens and left "
                          f"the run's {format_plt(report.plt, self.plt_threshold)}: {then}",
                          PLTOverBudgetWarning, stacklevel=4)
        return report

    def warn_if_untracked(self, step: int, rank: int) -> None:
        """Warn once, at the first checkpoint (after its counts were summed), when K < N
        and no routing was recorded: PLT and Dynamic-K cannot work without counts."""
        if self._warned or self.k >= self.n_experts or self.tracked or self.watched:
            return
        self._warned = True
        if rank == 0:
            warnings.warn(
                f"checkpoint of step {step}: partial checkpoints (K={self.k} of "
                f"{self.n_experts} experts per layer) but no routing was recorded; call "
                "ckpt.watch_routing(model) before the loop (or record_routing("
                "tokens_per_expert) every step), or recoveries will report PLT as "
                "unknown and Dynamic-K cannot raise K", RoutingNotRecordedWarning,
                stacklevel=3)

    def all_saved(self) -> None:
        """Every expert's state is now its newest persisted copy (a restore from storage):
        nothing routed so far is unsaved, and nothing is lost twice."""
        self.at_save = self.cumulative.clone()

    def plt(self, lost_base: torch.Tensor | None = None) -> float:
        """Cumulative PLT: the mean over all MoE layers of lost / all assignments so far.

        With `lost_base` (per-layer lost counts at some earlier point), only the tokens
        lost since then count: the PLT attributable to the K in force since then.
        """
        lost = self.lost if lost_base is None else self.lost - lost_base
        total = self.cumulative.sum(dim=1).double()
        per_layer = torch.where(total > 0, lost.double() / total.clamp(min=1), 0.0)
        return float(per_layer.mean()) if len(per_layer) else 0.0
