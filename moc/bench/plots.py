"""What a benchmark prints and writes: its table, JSON and picture (PNG). matplotlib is
optional (`pip install moc[plots]`): the tables and JSON never need it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moc.train.metrics import table


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend (no display needed), or a clear
    error saying how to get it."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("PNG output needs matplotlib: pip install 'moc[plots]' "
                         "(or drop --png)") from None
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
