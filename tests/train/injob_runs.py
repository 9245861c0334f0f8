"""`moc train` runs the in-job recovery tests share (tests/train/test_injob.py,
test_injob_faults.py): the command, its events, and the check that a faulted run equals
the run without faults (`injob_reference`, tests/train/conftest.py, run once a session
per layout)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from moc.checkpoint.tools import verify_checkpoints
from moc.train.metrics import read_events
from tests.engines import losses_by_step

STEPS, INTERVAL = 30, 5
LAYOUTS = {"one": ("--nproc", "2"), "two": ("--nodes", "2", "--nproc", "1")}
"""The layouts of the runs without faults: one node of 2 ranks, 2 simulated nodes of
one rank."""


def moc(*args: str, timeout: float = 300, env: dict[str, str] | None = None
        ) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moc", *args], capture_output=True,
                          text=True, timeout=timeout,
                          env={**os.environ, **env} if env else None)


def train(root: Path, *extra: str, ok: bool = True, env: dict[str, str] | None = None
          ) -> subprocess.CompletedProcess:
    r = moc("train", "--config", "tiny", "--steps", str(STEPS), "--ckpt-dir",
            str(root / "ckpt"), "--ckpt-interval", str(INTERVAL), "--k-persist", "1",
            "--device", "cpu", "--no-progress", "--metrics", str(root / "metrics.jsonl"),
            *extra, env=env)
    if ok:
        assert r.returncode == 0, r.stderr[-3000:]
    return r


def events(root: Path, kind: str) -> list[dict]:
    return [e for e in read_events(root / "metrics.jsonl") if e["event"] == kind]


def last_losses(root: Path) -> dict[int, float]:
    """Each step's last loss: the one the run kept."""
    return {s: ls[-1] for s, ls in losses_by_step(read_events(
        root / "metrics.jsonl")).items()}


def assert_exact(root: Path, reference: dict[int, float]) -> None:
    """Every step's last loss (the one the run kept) equals the fault-free run's, and
    every step before a fault and after its recovery was logged."""
    got = losses_by_step(read_events(root / "metrics.jsonl"))
    assert sorted(got) == list(range(1, STEPS + 1))
    assert {s: ls[-1] for s, ls in got.items()} == reference
    assert verify_checkpoints(root / "ckpt").ok  # `moc verify`'s check, in this process
