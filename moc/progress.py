"""Progress with an ETA for long work (training, benchmarks, export), for a human at a
terminal.

    with progress(total=len(runs), desc="bench size", unit="run") as bar:
        for name in runs:
            bar.note(name)           # what is running now, after the bar
            ...
            bar.update()             # one more done: rate and ETA follow
            bar.write("a line")      # printed above the bar (or plainly, without one)

The bar is drawn by tqdm, and only where someone watches: when the stream (stderr) is a
terminal, `CI` is not set, the caller did not pass `disable=True` (`--no-progress`) and
tqdm is installed (it is imported only to draw a bar: a machine with torch alone, such as
a lent GPU running `scripts/gpu_check.sh`, runs everything without bars).
Otherwise no bar is drawn, and a plain line on the stream says how far the work is, at
most one every `PLAIN_EVERY_S` seconds, when the count moves or the note changes
(`bench size: 3/8 runs, 41 s, about 68 s left (pec-k1)`): a log or a pipe sees the work
advance (issue 50: `moc bench size | cat` printed nothing for 1 min 41 s), and a short
command prints none. Nothing else is written but what `write` is given.
"""

from __future__ import annotations

import os
import sys
import time
from types import TracebackType
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from tqdm import tqdm

PLAIN_EVERY_S = 5.0
"""Without a bar: the least time between two plain progress lines."""

BAR_ROWS = 20
"""The terminal height tqdm is told: any height above one row shows our single bar."""


def wanted(stream: TextIO | None = None, disable: bool = False) -> bool:
    """Whether a bar would be drawn on `stream` (default stderr): a terminal, not CI
    (CI logs are terminals to no one, and some CI runners fake one), not disabled."""
    stream = sys.stderr if stream is None else stream
    if disable or os.environ.get("CI"):
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty()) and _tqdm() is not None


def _tqdm() -> type[tqdm] | None:
    """tqdm's bar class, or None where tqdm is not installed."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


class Progress:
    """One bar (see the module docstring); inert when not `wanted`. Owned by the thread
    that made it: tqdm draws on the caller's thread, in `update`."""

    def __init__(self, total: int | None, desc: str, unit: str = "it", *, initial: int = 0,
                 disable: bool = False, stream: TextIO | None = None) -> None:
        self.stream = sys.stderr if stream is None else stream
        self._bar: tqdm | None = None
        self._desc, self._unit, self._total = desc, unit, total
        self._done: float = initial
        self._initial = initial
        self._text = ""
        self._start = self._last = time.monotonic()
        if wanted(self.stream, disable):
            # nrows: one bar needs one row, and a terminal that reports a height of 0
            # (`script`, some containers) would make tqdm hide it as off-screen.
            bar = _tqdm()
            assert bar is not None, "wanted() found it"
            self._bar = bar(total=total, desc=desc, unit=unit, initial=initial,
                            file=self.stream, nrows=BAR_ROWS, leave=True)

    @property
    def active(self) -> bool:
        """A bar is being drawn."""
        return self._bar is not None

    def update(self, n: float = 1) -> None:
        self._done += n
        if self._bar is not None:
            self._bar.update(n)
        else:
            self._plain()

    def set_total(self, total: float) -> None:
        """The amount of work, once it is known (an export learns it from the manifest)."""
        self._total = total
        if self._bar is not None and self._bar.total != total:
            self._bar.total = total
            self._bar.refresh()

    def note(self, text: str) -> None:
        """Text after the bar (the loss, the configuration running); redrawn at once."""
        self._text = text
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=True)
        else:
            self._plain()

    def _plain(self) -> None:
        """Without a bar: one line of how far the work is, if `PLAIN_EVERY_S` passed."""
        now = time.monotonic()
        if now - self._last < PLAIN_EVERY_S:
            return
        self._last = now
        elapsed = now - self._start
        done = self._done - self._initial
        amount = (f"{self._done:g}/{self._total:g} {self._unit}" if self._total
                  else f"{self._done:g} {self._unit}")
        left = ""
        if self._total and done > 0 and self._done < self._total:
            left = f", about {elapsed / done * (self._total - self._done):.0f} s left"
        note = f" ({self._text})" if self._text else ""
        self.write(f"{self._desc}: {amount}, {elapsed:.0f} s{left}{note}")

    def write(self, text: str) -> None:
        """A line for the reader: above the bar when there is one, else plainly."""
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            self.stream.write(text + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def progress(total: int | None, desc: str, unit: str = "it", *, initial: int = 0,
             disable: bool = False, stream: TextIO | None = None) -> Progress:
    """A bar over `total` units of work, `initial` of them already done (a resumed run);
    a context manager that closes it."""
    return Progress(total, desc, unit, initial=initial, disable=disable, stream=stream)
