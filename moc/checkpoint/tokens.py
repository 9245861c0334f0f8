"""Routed-token accounting and the Proportion of Lost Tokens (PLT).

Each step the trainer hands `record_routing` the tokens this rank routed to every
(MoE layer, global expert). The counts stay local (one tensor add, no communication) and
are summed over ranks only at a checkpoint. Every manifest carries, per (layer, expert):

    cumulative  assignments routed to the expert from the start of the run to this step
    at_save     the cumulative count when the expert's newest saved copy was taken
    lost        per layer, assignments lost by earlier faults (carried along the run)

Recovering from a step s, an expert restored from an older copy loses the updates of
the tokens routed to it between that copy and s:  lost_e = cumulative_e - at_save_e.
PLT (paper, sec. 2) = mean over MoE layers i of  sum_j L_ij / (T_i * topk_i), where the
denominator is every assignment of layer i so far (sum_e cumulative).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class PLTReport:
    lost_tokens: int
    """Assignments lost by this recovery, over all layers."""
    lost_per_layer: list[int]
    plt: float
    """Cumulative PLT of the run, this recovery included."""


@dataclass
class TokenLedger:
    n_moe_layers: int
    n_experts: int
    cumulative: torch.Tensor = field(init=False)
    at_save: torch.Tensor = field(init=False)
    lost: torch.Tensor = field(init=False)
    _pending: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        shape = (self.n_moe_layers, self.n_experts)
        self.cumulative = torch.zeros(shape, dtype=torch.int64)
        self.at_save = torch.zeros(shape, dtype=torch.int64)
        self.lost = torch.zeros(self.n_moe_layers, dtype=torch.int64)
        self._pending = torch.zeros(shape, dtype=torch.int64)

    def record(self, counts: torch.Tensor) -> None:
        """Add one step's local (layers x experts) counts. Hot path: one add, no sync."""
        if counts.shape != self._pending.shape:
            raise ValueError(f"record_routing expects counts of shape (MoE layers, experts) = "
                             f"{tuple(self._pending.shape)}, got {tuple(counts.shape)}")
        self._pending += counts.detach().to("cpu", torch.int64)

    def sync(self, group: dist.ProcessGroup | None) -> None:
        """Fold the pending local counts of every rank into `cumulative` (collective)."""
        pending = self._pending
        if group is not None:
            dist.all_reduce(pending, group=group)
        self.cumulative += pending
        self._pending = torch.zeros_like(pending)

    def unsaved(self) -> torch.Tensor:
        return self.cumulative - self.at_save

    def mark_saved(self, experts_per_layer: list[list[int]]) -> None:
        for m, experts in enumerate(experts_per_layer):
            self.at_save[m, experts] = self.cumulative[m, experts]

    def to_json(self) -> dict[str, Any]:
        return {"cumulative": self.cumulative.tolist(), "at_save": self.at_save.tolist(),
                "lost": self.lost.tolist()}

    def load_json(self, d: dict[str, Any]) -> None:
        """Restore from a manifest; an empty dict (no accounting saved) keeps zeros."""
        if not d:
            return
        self.cumulative = torch.tensor(d["cumulative"], dtype=torch.int64)
        self.at_save = torch.tensor(d["at_save"], dtype=torch.int64)
        self.lost = torch.tensor(d["lost"], dtype=torch.int64)
        if self.cumulative.shape != (self.n_moe_layers, self.n_experts):
            raise ValueError(f"token counts of shape {tuple(self.cumulative.shape)} do not fit "
                             f"{self.n_moe_layers} MoE layers x {self.n_experts} experts")
        self._pending.zero_()

    def recover(self, restored_at_save: torch.Tensor | None = None) -> PLTReport:
        """Account a recovery to the state just loaded and return the PLT.

        `restored_at_save` overrides `at_save` where the restored copy of an expert is
        newer than the newest persisted one (a snapshot in memory): cumulative counts at
        the copy actually restored. After the recovery every expert's state is that copy,
        so the ledger continues from `at_save = cumulative`: nothing is lost twice.
        """
        at_save = self.at_save if restored_at_save is None else restored_at_save
        lost_per_layer = (self.cumulative - at_save).sum(dim=1)
        self.lost += lost_per_layer
        self.at_save = self.cumulative.clone()
        return PLTReport(int(lost_per_layer.sum()), lost_per_layer.tolist(), self.plt())

    def plt(self) -> float:
        """Cumulative PLT: mean over layers of lost / all assignments so far."""
        total = self.cumulative.sum(dim=1)
        has = total > 0
        if not has.any():
            return 0.0
        return float((self.lost[has].double() / total[has].double()).mean())
