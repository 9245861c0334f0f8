"""What the trainer tells machines (JSON lines) and humans (progress, summary table)."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from moc.progress import Progress, progress


class MetricsWriter:
    """Appends one JSON object per line; flushed at once so a SIGKILL loses nothing
    already reported. A no-op when `path` is None (and on ranks other than 0)."""

    def __init__(self, path: str | Path | None) -> None:
        self._file: TextIO | None = None
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a")  # noqa: SIM115 - lives as long as the run

    def emit(self, event: str, **fields: Any) -> None:
        if self._file is None:
            return
        # "time": wall-clock seconds, so runs that span restarts can be timed end to end.
        self._file.write(json.dumps({"event": event, "time": time.time(), **fields}) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """All events of a metrics file; a torn last line (killed mid-write) is ignored."""
    events = []
    p = Path(path)
    if not p.exists():
        return events
    for line in p.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events


@dataclass(frozen=True)
class CheckpointCounts:
    """What a run's events say of its checkpoints, counted by step: a step checkpointed
    again after a restart (the fault came before its first save finished) counts once.
    Every save the trainer finishes ends in exactly one event, `checkpoint` or
    `checkpoint_failed` (`moc.train.report.report_checkpoint`), logged once the save is
    done (an asynchronous one: once persisted). A fault can come before that: a step
    the run then resumed from (its `recovery` event's `resumed_from`) was checkpointed
    all the same, and counts."""

    written: int
    """Steps with a `checkpoint` event or resumed from: checkpoints that were taken and
    did not fail."""
    failed: int
    """Steps whose only outcome was `checkpoint_failed`."""
    persist_skipped: int
    """`checkpoint` events whose persist was skipped (moc's `--persist-policy skip`: the
    previous persist still ran); the checkpoint is in memory only."""
    first_error: str | None
    """The first failed checkpoint's error (None: none failed)."""

    @property
    def taken(self) -> int:
        return self.written + self.failed


def checkpoint_counts(events: list[dict[str, Any]]) -> CheckpointCounts:
    """Count the checkpoints of a run's events (every attempt's)."""
    written = {e["step"] for e in events if e["event"] == "checkpoint"}
    written |= {e["resumed_from"] for e in events
                if e["event"] == "recovery" and e.get("resumed_from")}
    failed = [e for e in events if e["event"] == "checkpoint_failed"
              and e["step"] not in written]
    return CheckpointCounts(
        written=len(written), failed=len({e["step"] for e in failed}),
        persist_skipped=sum(1 for e in events
                            if e["event"] == "checkpoint" and e.get("persist_skipped")),
        first_error=failed[0]["error"] if failed else None)


class StepProgress:
    """Training progress of rank 0: a tqdm bar with the rate and ETA on a terminal
    (`moc.progress`), a line every 10% otherwise (logs, CI, pipes, `--no-progress`).
    Without a terminal the output is the plain lines alone, as the tests that read it
    expect; `bar=False` for a progress that only reports messages (the recovery)."""

    def __init__(self, total: int, start: int = 0, stream: TextIO = sys.stderr,
                 enabled: bool = True, bar: bool = True) -> None:
        self.total, self.stream, self.enabled = total, stream, enabled
        # Inert (no bar, plain writes) unless a human watches: see moc.progress.
        self._bar: Progress = progress(total, "train", "step", initial=start, stream=stream,
                                       disable=not (enabled and bar))
        self._last_pct = -1
        self._t0, self._start, self._step = time.perf_counter(), start, start
        self._ckpt_note = ""  # the last checkpoint's, kept on the bar until the next

    def update(self, step: int, loss: float, note: str = "") -> None:
        if not self.enabled:
            return
        if self._bar.active:
            self._bar.update(step - self._step)
            self._step = step
            self._ckpt_note = note or self._ckpt_note
            self._bar.note(f"loss {loss:.4f}{self._ckpt_note}")
            if step == self.total:
                self.close()  # what follows is plain text
            return
        done = step / self.total
        if int(done * 10) > self._last_pct or step == self.total:
            self._last_pct = int(done * 10)
            rate = (step - self._start) / max(1e-9, time.perf_counter() - self._t0)
            self.stream.write(f"step {step:>6}/{self.total}  loss {loss:7.4f}  "
                              f"{rate:6.2f} it/s {note}\n")
            self.stream.flush()

    def message(self, text: str) -> None:
        if self.enabled:
            self._bar.write(text)

    def close(self) -> None:
        self._bar.close()


def table(rows: list[tuple[str, str]], title: str) -> str:
    width = max(len(k) for k, _ in rows)
    lines = [title, "-" * max(len(title), width + 2 + max(len(v) for _, v in rows))]
    lines += [f"{k:<{width}}  {v}" for k, v in rows]
    return "\n".join(lines)


@dataclass
class RecoveryLog:
    """A recovery's event, written once the first step after it is done: only then is
    its downtime known, from the last step done before the fault (`last_step_time`,
    the wall clock rank 0 logged; None: no step was logged) to that one. What a fault
    cost the run, all of it: noticing it, a restart or a re-formation, the restore."""

    last_step_time: float | None
    fields: dict[str, Any]

    def emit(self, metrics: MetricsWriter) -> float | None:
        """Write the event; its downtime (None: unknown)."""
        downtime = (time.time() - self.last_step_time if self.last_step_time is not None
                    else None)
        metrics.emit("recovery", **self.fields, downtime_s=downtime)
        return downtime
