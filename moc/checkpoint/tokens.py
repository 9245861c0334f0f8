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
        """Add one step's local (layers x experts) counts. Hot path: one add on the
        counts' own device, no host sync, no communication."""
        if counts.shape != self._pending.shape:
            raise ValueError(f"record_routing expects counts of shape (MoE layers, experts) = "
                             f"{tuple(self._pending.shape)}, got {tuple(counts.shape)}")
        if self._pending.device != counts.device:
            self._pending = self._pending.to(counts.device)
        self._pending += counts.detach()

    def sync(self, group: dist.ProcessGroup | None) -> None:
        """Fold the pending local counts of every rank into `cumulative` (collective over
        a CPU group)."""
        pending = self.take_pending()
        if group is not None:
            dist.all_reduce(pending, group=group)
        self.add_synced(pending)

    def take_pending(self) -> torch.Tensor:
        """This rank's counts since the last sync (on the CPU), reset to zero: for a
        caller that sums them over ranks inside a collective of its own."""
        pending = self._pending.to("cpu", torch.int64)
        self._pending = torch.zeros_like(self._pending)
        return pending

    def add_synced(self, summed: torch.Tensor) -> None:
        """Fold counts already summed over every rank into `cumulative`."""
        self.cumulative += summed.view(self.cumulative.shape)

    def unsaved(self) -> torch.Tensor:
        return self.cumulative - self.at_save

    def mark_saved(self, experts_per_layer: list[list[int]]) -> None:
        for m, experts in enumerate(experts_per_layer):
            self.at_save[m, experts] = self.cumulative[m, experts]

    def to_json(self) -> dict[str, Any]:
        return {"cumulative": self.cumulative.tolist(), "at_save": self.at_save.tolist(),
                "lost": self.lost.tolist()}

    def load_json(self, d: dict[str, Any]) -> None:
        """Restore from a manifest; an empty dict (no accounting saved) starts from zeros.
        Counts recorded since that checkpoint belong to steps that will be redone."""
        self._pending = torch.zeros_like(self._pending)
        if not d:
            return
        self.cumulative = torch.tensor(d["cumulative"], dtype=torch.int64)
        self.at_save = torch.tensor(d["at_save"], dtype=torch.int64)
        self.lost = torch.tensor(d["lost"], dtype=torch.int64)
        if self.cumulative.shape != (self.n_moe_layers, self.n_experts):
            raise ValueError(f"token counts of shape {tuple(self.cumulative.shape)} do not fit "
                             f"{self.n_moe_layers} MoE layers x {self.n_experts} experts")

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

    def plt(self, lost_base: torch.Tensor | None = None) -> float:
        """Cumulative PLT: the mean over all MoE layers of lost / all assignments so far.

        With `lost_base` (per-layer lost counts at some earlier point), only the tokens
        lost since then count: the PLT attributable to the K in force since then.
        """
        lost = self.lost if lost_base is None else self.lost - lost_base
        total = self.cumulative.sum(dim=1).double()
        per_layer = torch.where(total > 0, lost.double() / total.clamp(min=1), 0.0)
        return float(per_layer.mean()) if len(per_layer) else 0.0
