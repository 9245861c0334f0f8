"""Where one checkpoint's time goes: wall and CPU seconds per named phase.

    phases = Phases()
    with phases("copy"):
        ...
    phases.wall["copy"], phases.cpu["copy"], phases.faults["copy"]

CPU time is the calling thread's own (`time.thread_time`: user and system time of this
thread, not of the process), so a phase on the snapshot thread is not charged for the
training thread running beside it, and the wall time minus the CPU time of a phase is
what it waited: for the disk, or for a core (checkpoint work runs in SCHED_IDLE). Page
faults (minor: the kernel mapping a page on first touch) are the thread's too: a copy
into memory the process has not touched yet pays one per 4 KiB. Used
only on checkpoint threads and processes, never on a training step: a phase costs two
clock reads.
"""

from __future__ import annotations

import contextlib
import resource
import time
from collections.abc import Iterator


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


class Phases:
    """Seconds per phase, wall and CPU, summed over repeats of a phase."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.faults: dict[str, int] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        w, c, f = time.perf_counter(), time.thread_time(), _faults()
        try:
            yield
        finally:
            self.wall[name] = self.wall.get(name, 0.0) + time.perf_counter() - w
            self.cpu[name] = self.cpu.get(name, 0.0) + time.thread_time() - c
            self.faults[name] = self.faults.get(name, 0) + _faults() - f

    def record(self, name: str, wall: float) -> None:
        """A phase measured elsewhere (waiting in a queue: no CPU time of its own)."""
        self.wall[name] = self.wall.get(name, 0.0) + wall
        self.cpu.setdefault(name, 0.0)
        self.faults.setdefault(name, 0)

    @property
    def cpu_s(self) -> float:
        return sum(self.cpu.values())

    def to_dict(self) -> dict[str, list[float]]:
        """{phase: [wall s, cpu s, page faults]}: what travels in messages and metrics
        events."""
        return {name: [self.wall[name], self.cpu.get(name, 0.0), self.faults.get(name, 0)]
                for name in self.wall}
