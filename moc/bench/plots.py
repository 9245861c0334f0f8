"""What every benchmark shares: running `moc train` and reading its events, and what it
prints and writes (its table, JSON and picture). matplotlib is optional
(`pip install matplotlib`, moc's plots extra): the tables and JSON never need it."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moc.train.metrics import read_events, table


def train_run(args: list[str], workdir: Path, timeout: float | None = None
              ) -> list[dict[str, Any]]:
    """Run `moc train ARGS` with its checkpoints and metrics in `workdir`; every event
    of `workdir`'s metrics file (a later run in the same workdir resumes there and
    appends). A failed run raises with the end of its stderr."""
    metrics = workdir / "metrics.jsonl"
    cmd = [sys.executable, "-m", "moc", "train", *args, "--ckpt-dir", str(workdir / "ckpt"),
           "--metrics", str(metrics)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    return read_events(metrics)


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend (no display needed), or a clear
    error saying how to get it."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("PNG output needs matplotlib: pip install 'matplotlib>=3.7' (moc's "
                         "plots extra), or drop --png") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def publish(title: str, rows: list[tuple[str, str]], markdown: str, result: dict[str, Any],
            json_path: Path | None, png_path: Path | None,
            draw: Callable[[Path], None]) -> None:
    """Print a benchmark's header rows and markdown table; write its JSON and its
    picture where asked."""
    print(table(rows, title))
    print()
    print(markdown)
    if json_path:
        json_path.write_text(json.dumps(result, indent=1))
    if png_path:
        draw(png_path)
