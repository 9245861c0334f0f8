"""The end of a run with a fault, as a new user reads it (issue 40, item 7): the fault says
it was injected on purpose, and `moc train`'s summary says what its checkpoint figures
count, agreeing with `moc demo`'s table (which counts the whole run's events)."""

from __future__ import annotations

import re
import statistics
import subprocess
import sys

import pytest

from moc.train.metrics import read_events
from moc.train.report import checkpoint_rows


def _ckpt(step: int, stall: float | None, mb: float = 2.0) -> dict:
    return {"event": "checkpoint", "step": step, "stall_s": stall, "bytes": int(mb * 1e6)}


def test_a_resumed_attempt_counts_itself_and_the_run_each_labelled():
    """The demo's run: five checkpoints before the fault, three after the restart. Before,
    the summary said "3 x moc" and "0.002s" where the demo said "8 x moc" and "0.0008s"."""
    before = [_ckpt(s, 0.0005) for s in (25, 50, 75, 100, 125)]
    after = [_ckpt(s, 0.002, mb=1.0) for s in (150, 175, 200)]
    run = [{"event": "step", "step": 1}, *before, {"event": "fault", "step": 130}, *after]
    rows = dict(checkpoint_rows(after, run, "moc", "runs/demo/metrics.jsonl"))
    assert rows["checkpoints"] == ("3 x moc in this attempt, 1.0 MB on average; 8 in the "
                                   "run (runs/demo/metrics.jsonl)")
    demo_median = statistics.median(e["stall_s"] or 0.0 for e in before + after)  # moc demo's
    assert rows["median stall"] == (f"0.0020s in this attempt; {demo_median:.4f}s over the "
                                    "run's 8")


def test_a_run_of_one_attempt_has_one_count():
    ckpts = [_ckpt(s, s / 1e4) for s in (5, 10, 15)]
    assert checkpoint_rows(ckpts, ckpts, "moc", "m.jsonl") == [
        ("checkpoints", "3 x moc, 2.0 MB on average"), ("median stall", "0.0010s")]
    assert checkpoint_rows(ckpts, [], "moc", None)[0] == (  # no metrics file: this attempt
        "checkpoints", "3 x moc, 2.0 MB on average")
    assert checkpoint_rows([], [], "moc", None) == []


def test_a_step_checkpointed_again_after_a_restart_counts_once():
    run = [_ckpt(5, 0.001), _ckpt(10, 0.001), _ckpt(10, 0.003), _ckpt(15, 0.003)]
    rows = dict(checkpoint_rows(run[2:], run, "moc", "m.jsonl"))
    assert rows["checkpoints"].endswith("; 3 in the run (m.jsonl)")


@pytest.mark.integration
def test_a_faulted_run_says_the_fault_was_injected_and_its_summary_agrees_with_its_events(
        tmp_path):
    metrics = tmp_path / "m.jsonl"
    r = subprocess.run(
        [sys.executable, "-m", "moc", "train", "--nproc", "2", "--config", "tiny", "--steps",
         "20", "--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-interval", "5", "--k-persist",
         "1", "--fault-at", "12", "--fault-rank", "1", "--max-restarts", "1", "--device",
         "cpu", "--no-progress", "--metrics", str(metrics)],
        capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    injected = [ln for ln in r.stderr.splitlines() if "injecting a fault" in ln]
    assert len(injected) == 1, r.stderr[-3000:]
    assert re.fullmatch(r"moc train: rank 1: injecting a fault at step 12 \(--fault-at 12\): "
                        r"SIGKILL of this process \(pid \d+\)", injected[0])
    # The fault's line comes before what it causes.
    assert r.stderr.index("injecting a fault") < r.stderr.index("resumed from")
    steps = {e["step"] for e in read_events(metrics) if e["event"] == "checkpoint"}
    (row,) = [ln for ln in r.stderr.splitlines() if ln.startswith("checkpoints ")]
    assert re.search(rf"in this attempt, .*; {len(steps)} in the run \({metrics}\)$", row), row
