"""What a run reports: its result, each finished checkpoint (metrics and the progress
bar's note) and the summary table rank 0 prints at the end."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from moc.checkpoint.api import CheckpointResult
from moc.topology import ParallelGroups
from moc.train.config import TrainConfig
from moc.train.metrics import MetricsWriter, StepProgress, table


@dataclass
class RunResult:
    steps: int
    final_loss: float
    val_loss: float
    wall_s: float
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    """The checkpoint events of this attempt."""
    resumed_from: int | None = None
    preempted: int | None = None
    """The step at which a SIGTERM or SIGINT stopped the run (None: it was not)."""
    final_error: str | None = None
    """Why the run's final checkpoint did not reach storage (None: it did, or none)."""


def report_checkpoint(metrics: MetricsWriter, progress: StepProgress, result: RunResult,
                      res: CheckpointResult, step: int) -> str:
    """Log one finished checkpoint (the loop is at `step`); the progress bar's note."""
    if res.k_snapshot_chosen:
        chosen = res.k_snapshot_chosen
        metrics.emit("k_snapshot", step=res.step, k=chosen["k_snapshot"],
                     window_s=chosen["window_s"], plan_s=chosen["plan_s"],
                     copy_Bps=chosen["copy_Bps"], copy_s=chosen.get("copy_s"),
                     reason=chosen.get("reason"))
        why = f": {chosen['reason']}" if chosen.get("reason") else ""
        progress.message(f"K_snapshot = {res.k_snapshot} (auto){why}")
    event = res.event()
    error = event.pop("error")
    if error and event["step"] == step:
        result.final_error = error
    if error:
        metrics.emit("checkpoint_failed", step=event["step"], error=error)
        progress.message(f"checkpoint of step {event['step']} failed, training goes on "
                         f"from the previous one: {error}")
        return ""
    result.checkpoints.append(event)
    metrics.emit("checkpoint", **event)
    return f" ckpt {event['bytes'] / 1e6:.1f} MB, stall {event['stall_s']:.3f}s"


def summary(cfg: TrainConfig, groups: ParallelGroups, model: nn.Module, r: RunResult) -> str:
    """The table rank 0 prints at the end of a run."""
    rows = [
        ("config", f"{cfg.preset} ({sum(p.numel() for p in model.parameters()):,} "
                   f"params on rank 0)"),
        ("ranks / ep", f"{groups.world_size} / {groups.layout.ep}"),
        ("steps", f"{r.steps}" + (f" (resumed from {r.resumed_from})"
                                   if r.resumed_from is not None else "")),
        ("final train loss", f"{r.final_loss:.4f}"),
        ("validation loss", f"{r.val_loss:.4f}"),
        ("wall time", f"{r.wall_s:.1f}s (this attempt)"),
    ]
    if r.checkpoints:
        stalls = [c["stall_s"] for c in r.checkpoints]
        mean_mb = statistics.mean(c["bytes"] for c in r.checkpoints) / 1e6
        rows += [("checkpoints", f"{len(r.checkpoints)} x {cfg.ckpt_mode}, "
                                 f"{mean_mb:.1f} MB on average"),
                 ("median stall", f"{statistics.median(stalls):.3f}s")]
    return "\n" + table(rows, "moc train summary")
