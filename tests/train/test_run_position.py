"""Where `moc train` starts from a directory that already holds a run (issue 29, items 2
and 11): a run past --steps is said to be, not "trained" into NaN; a rollback
(--resume-step) continues from the step asked for and keeps its chain intact."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from moc.checkpoint.store.steps import complete_steps
from moc.checkpoint.tools import verify_checkpoints
from moc.train.metrics import read_events

pytestmark = pytest.mark.integration

BASE = ["--nproc", "2", "--config", "tiny", "--ckpt-interval", "10", "--k-persist", "1",
        "--no-progress", "--device", "cpu"]


def _train(root: Path, steps: int, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moc", "train", *BASE, "--steps", str(steps),
                           "--ckpt-dir", str(root / "ckpt"), "--metrics",
                           str(root / "m.jsonl"), *extra],
                          capture_output=True, text=True, timeout=600)


def _steps(root: Path) -> list[int]:
    return [e["step"] for e in read_events(root / "m.jsonl") if e["event"] == "step"]


@pytest.fixture(scope="module")
def at_60(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("at60")
    r = _train(root, 60)
    assert r.returncode == 0, r.stderr[-3000:]
    return root


def test_a_run_already_past_the_steps_asked_is_refused_in_one_line(at_60):
    """Before: exit 0, nothing trained, "final train loss nan" and a misleading "newest
    checkpoint ... is not complete"."""
    before = _steps(at_60)
    r = _train(at_60, 30)
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.strip().splitlines() == [
        f"moc train: error: the run in {at_60 / 'ckpt'} is already at step 60, past --steps "
        "30: nothing to train; raise --steps to go on, --resume-step S to roll back to "
        "step S, or use another --ckpt-dir"]
    assert _steps(at_60) == before and "nan" not in r.stderr


def test_a_run_already_complete_says_so_and_succeeds(at_60):
    r = _train(at_60, 60)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "already complete at step 60" in r.stderr and "nan" not in r.stderr


def test_a_worker_under_plain_torchrun_refuses_too_and_leaves_no_memory(at_60, tmp_path):
    shm = tmp_path / "shm"
    env = {**os.environ, "MOC_SHM_ROOT": str(shm)}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "2", "-m", "moc.train", "--config", "tiny",
                        "--steps", "30", "--ckpt-dir", str(at_60 / "ckpt"), "--device", "cpu",
                        "--no-progress"], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode != 0
    assert "already at step 60, past --steps 30" in r.stderr, r.stderr[-3000:]
    assert "NothingToTrain" not in r.stderr  # one line, no traceback of the workers'
    assert not list(shm.glob("moc-*"))


@pytest.mark.slow  # long; CI time (make test-slow runs it)
def test_resume_step_rolls_back_and_a_restart_after_a_fault_does_not_roll_back_again(
        tmp_path):
    r = _train(tmp_path, 60)
    assert r.returncode == 0, r.stderr[-3000:]
    r = _train(tmp_path, 70, "--resume-step", "30", "--fault-at", "45", "--fault-rank", "1",
               "--max-restarts", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "rolled back to step 30" in r.stderr
    recoveries = [e for e in read_events(tmp_path / "m.jsonl") if e["event"] == "recovery"]
    # The rollback's attempt from 30; the restart after the fault from its newest, 40.
    assert [e["resumed_from"] for e in recoveries] == [30, 40], recoveries
    ckpt = tmp_path / "ckpt"
    assert complete_steps(ckpt)[-1] == 70
    aside = sorted(p.name for p in ckpt.glob("step-*.rolledback"))
    assert aside == [f"step-{s:08d}.rolledback" for s in (40, 50, 60)]
    assert verify_checkpoints(ckpt).ok


def test_resume_step_of_a_step_that_is_not_there_is_one_line(at_60):
    r = _train(at_60, 80, "--resume-step", "35")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"moc train: error: --resume-step 35: {at_60 / 'ckpt'} holds no complete checkpoint "
        "of that step (complete steps: 10, 20, 30, 40, 50, 60)"]
