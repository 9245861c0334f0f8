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
from moc.train.metrics import MetricsWriter, StepProgress, read_events, table


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
    run = read_events(cfg.metrics) if cfg.metrics else []
    rows += checkpoint_rows(r.checkpoints, run, cfg.ckpt_mode, cfg.metrics)
    return "\n" + table(rows, "moc train summary")


def checkpoint_rows(attempt: list[dict[str, Any]], run: list[dict[str, Any]], mode: str,
                    metrics: str | None) -> list[tuple[str, str]]:
    """The summary's checkpoint rows: this attempt's checkpoints (`attempt`, its events)
    and, when the run had more (it resumed after a fault: `run`, every event of the
    metrics file), the run's too, each labelled with what it counts. Before, the summary
    of a restarted attempt said "3 x moc" where `moc demo`, counting the whole run from
    the metrics file, said "8 x moc", and median stalls of the two sets (0.002 s against
    0.0008 s) with nothing to tell them apart. A step checkpointed twice (again after a
    restart) counts once, its last event."""
    whole = list({e["step"]: e for e in run if e["event"] == "checkpoint"}.values())
    if not attempt and not whole:
        return []
    if len(whole) <= len(attempt):  # the run is this attempt (or unknown: no metrics)
        return _checkpoint_rows(attempt, mode, "")
    if not attempt:
        return _checkpoint_rows(whole, mode, f" in the run ({metrics})")
    mb = statistics.mean(c["bytes"] for c in attempt) / 1e6
    return [("checkpoints", f"{len(attempt)} x {mode} in this attempt, {mb:.1f} MB on "
                            f"average; {len(whole)} in the run ({metrics})"),
            ("median stall", f"{_median_stall(attempt):.4f}s in this attempt; "
                             f"{_median_stall(whole):.4f}s over the run's {len(whole)}")]


def _checkpoint_rows(checkpoints: list[dict[str, Any]], mode: str,
                     where: str) -> list[tuple[str, str]]:
    mb = statistics.mean(c["bytes"] for c in checkpoints) / 1e6
    return [("checkpoints", f"{len(checkpoints)} x {mode}{where}, {mb:.1f} MB on average"),
            ("median stall", f"{_median_stall(checkpoints):.4f}s")]


def _median_stall(checkpoints: list[dict[str, Any]]) -> float:
    """The training thread's median wait per checkpoint (`stall_s`; none recorded: 0, as
    `moc demo` counts it)."""
    return statistics.median(c["stall_s"] or 0.0 for c in checkpoints)
