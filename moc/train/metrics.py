"""What the trainer tells machines (JSON lines) and humans (progress bar, summary table)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO


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


class Progress:
    """A one-line progress bar on a terminal; a line every 10% otherwise (logs, CI)."""

    def __init__(self, total: int, start: int = 0, stream: TextIO = sys.stderr,
                 enabled: bool = True) -> None:
        self.total, self.stream, self.enabled = total, stream, enabled
        self.tty = stream.isatty()
        self._last_pct = -1
        self._t0, self._start = time.perf_counter(), start

    def update(self, step: int, loss: float, note: str = "") -> None:
        if not self.enabled:
            return
        done = step / self.total
        rate = (step - self._start) / max(1e-9, time.perf_counter() - self._t0)
        text = f"step {step:>6}/{self.total}  loss {loss:7.4f}  {rate:6.2f} it/s {note}"
        if self.tty:
            bar = "#" * int(30 * done)
            self.stream.write(f"\r[{bar:<30}] {text}")
            if step == self.total:
                self.stream.write("\n")
        elif int(done * 10) > self._last_pct or step == self.total:
            self._last_pct = int(done * 10)
            self.stream.write(text + "\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        if self.enabled:
            self.stream.write(("\n" if self.tty else "") + text + "\n")
            self.stream.flush()


def table(rows: list[tuple[str, str]], title: str) -> str:
    width = max(len(k) for k, _ in rows)
    lines = [title, "-" * max(len(title), width + 2 + max(len(v) for _, v in rows))]
    lines += [f"{k:<{width}}  {v}" for k, v in rows]
    return "\n".join(lines)
