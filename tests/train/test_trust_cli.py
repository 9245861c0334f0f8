"""`moc train` as a user runs it, attacked the ways that once lost or mixed up state."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moc.injob.machines import machine_pids
from moc.train.metrics import read_events
from tests.fs import tmpfs

pytestmark = pytest.mark.integration  # real torchrun jobs


def moc(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moc", *args], capture_output=True,
                          text=True, timeout=timeout)


def _train_args(ckpt: Path, steps: int, *extra: str) -> list[str]:
    return ["train", "--nproc", "2", "--ep", "2", "--config", "tiny", "--steps", str(steps),
            "--ckpt-dir", str(ckpt), "--ckpt-mode", "moc", *extra]


@pytest.mark.slow  # long; CI time (make test-slow runs it)
def test_a_finished_run_restarted_for_more_steps_loses_nothing(tmp_path):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    args = ("--ckpt-interval", "1", "--k-persist", "1", "--metrics", str(metrics))
    assert moc(*_train_args(ckpt, 12, *args)).returncode == 0
    inspect = moc("inspect", "--json", str(ckpt))
    newest = json.loads(inspect.stdout)["newest"]
    assert newest["step"] == 12
    assert {a for row in newest["expert_age"].values() for a in row} == {0}
    r = moc(*_train_args(ckpt, 14, *args))
    assert r.returncode == 0, r.stderr[-2000:]
    (recovery,) = [e for e in read_events(metrics) if e["event"] == "recovery"]
    assert (recovery["resumed_from"], recovery["plt"], recovery["lost_tokens"]) == (12, 0.0, 0)


def test_a_second_job_on_the_same_directory_is_refused_and_the_first_keeps_its_checkpoints(
        tmp_path):
    ckpt = tmp_path / "ckpt"
    first = subprocess.Popen(
        [sys.executable, "-m", "moc", "train", "--nproc", "1", "--config", "tiny", "--steps",
         "60", "--seed", "1", "--ckpt-dir", str(ckpt), "--ckpt-interval", "5",
         "--ckpt-mode", "pec", "--keep-last", "2"], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    stopped, job = False, []
    try:
        deadline = time.monotonic() + 300
        while not list(ckpt.glob("step-*")) and time.monotonic() < deadline:
            time.sleep(0.2)  # the first job is training: it holds the directory
        # Held still while the second starts (SIGSTOP: alive, holding its lock): on a
        # busy machine the second's start outlasted the first's 60 steps, and found the
        # run complete instead of a directory in use (issue 48). Every process of the
        # job: torchrun starts its workers in sessions of their own.
        job = machine_pids(first.pid)
        for pid in job:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        stopped = True
        second = moc("train", "--nproc", "1", "--config", "tiny", "--steps", "60", "--seed",
                     "2", "--ckpt-dir", str(ckpt), "--ckpt-interval", "5", "--ckpt-mode",
                     "pec", "--keep-last", "2")
        assert second.returncode != 0, second.stderr[-2000:]
        assert "is in use by another job: pid" in second.stderr
        assert "Traceback" not in second.stderr
    finally:
        if stopped:
            for pid in job:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-2000:]
    verify = moc("verify", str(ckpt))
    assert verify.returncode == 0 and "OK" in verify.stdout
    newest = json.loads(moc("inspect", "--json", str(ckpt)).stdout)["steps"][-1]
    assert newest["step"] == 60


def test_memory_snapshots_of_a_killed_run_are_not_resumed_by_another_run(tmp_path):
    ckpt = tmp_path / "ckpt"
    killed = moc(*_train_args(ckpt, 30, "--ckpt-interval", "5", "--k-persist", "1",
                              "--fault-at", "23", "--fault-rank", "1", "--recovery",
                              "restart"))
    assert killed.returncode != 0  # no restarts allowed: the job died at step 23
    for p in ckpt.iterdir():  # rm -rf DIR/*
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    other = moc(*_train_args(ckpt, 10, "--ckpt-interval", "5", "--seed", "7"))
    assert other.returncode == 0, other.stderr[-2000:]
    assert "resumed from" not in other.stdout + other.stderr


def test_a_read_only_checkpoint_directory_is_refused_before_any_worker_starts(tmp_path):
    """It once warned, trained every step, failed every checkpoint and ended with the
    final one failed (issue 29, item 13)."""
    with tmpfs(tmp_path / "mnt", "64m") as mnt:
        ckpt = mnt / "ckpt"
        args = ["train", "--nproc", "1", "--config", "tiny", "--ckpt-dir", str(ckpt),
                "--ckpt-interval", "2", "--ckpt-mode", "pec", "--no-progress"]
        first = moc(*args, "--steps", "2")
        assert first.returncode == 0, first.stderr[-2000:]
        done = subprocess.run(["mount", "-o", "remount,ro", str(mnt)], capture_output=True,
                              text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot remount a tmpfs read-only here ({done.stderr.strip()})")
        r = moc(*args, "--steps", "6")
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().count("\n") == 0, r.stderr  # one line, from the launcher
    assert r.stderr.startswith(f"moc train: error: checkpoint directory {ckpt} is not "
                               "writable (Read-only file system"), r.stderr
    assert "use a writable directory" in r.stderr and "step" not in r.stdout


def test_k_snapshot_beyond_the_experts_is_refused_like_k_persist():
    """`--k-snapshot 9` with 4 experts once ran, silently as 'all' (issue 29, item 14)."""
    r = moc("train", "--nproc", "1", "--config", "tiny", "--steps", "2", "--k-snapshot", "9")
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().count("\n") == 0, r.stderr
    assert "--k-snapshot 9 is more than the 4 experts per MoE layer of --config tiny; use " \
        "at most 4, 'all' or 'auto'" in r.stderr
