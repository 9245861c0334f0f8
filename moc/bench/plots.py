"""Pictures of the benchmarks (PNG). matplotlib is optional (`pip install moc[plots]`):
the tables and JSON never need it."""

from __future__ import annotations

from typing import Any


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
