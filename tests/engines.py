"""Helpers for driving any checkpoint engine through its contract in tests."""

from __future__ import annotations

from typing import Any

from moc.checkpoint.api import CheckpointEngine, CheckpointResult


def save_now(ckpt: CheckpointEngine, step: int, extra: dict[str, Any] | None = None
             ) -> CheckpointResult:
    """Checkpoint `step`, finish it and return its result (collective)."""
    ckpt.save(step, extra)
    ckpt.flush()
    (result,) = [r for r in ckpt.drain_completed() if r.step == step]
    return result


def losses_by_step(events: list[dict]) -> dict[int, list[float]]:
    """Every loss a run's metrics logged, by step (a step redone after a fault: twice)."""
    out: dict[int, list[float]] = {}
    for e in events:
        if e["event"] == "step":
            out.setdefault(e["step"], []).append(e["loss"])
    return out
