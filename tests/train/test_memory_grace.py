"""Memory survives a neighbour (issue 40, item 5): a crashed job restarted as a new command
resumes from its snapshots in shared memory even when another moc job started on the node
in between. Before, the newcomer's clean-up removed them (their owner was dead) and the
restart resumed from storage. Real `moc train` jobs on one memory root; the rule itself:
tests/checkpoint/twolevel/test_jobdir_grace.py."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moc.checkpoint.twolevel.memory.jobdir import GONE, GRACE_ENV, default_job_id, job_dir
from moc.train.metrics import read_events

pytestmark = pytest.mark.integration

ARGS = ["--nproc", "2", "--config", "tiny", "--ckpt-interval", "5", "--k-persist", "1",
        "--no-progress", "--device", "cpu"]


def _train(ckpt: Path, steps: int, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moc", "train", *ARGS, "--steps", str(steps),
                           "--ckpt-dir", str(ckpt), "--metrics", f"{ckpt}.jsonl"],
                          env=env, capture_output=True, text=True, timeout=600)


def _job_processes(shm: str) -> list[int]:
    """The job's processes: every one whose MOC_SHM_ROOT is the test's (/proc)."""
    needle = f"MOC_SHM_ROOT={shm}".encode()
    pids = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if needle in environ.read_bytes().split(b"\0"):
                pids.append(int(environ.parent.name))
        except OSError:  # gone, or another user's
            continue
    return [p for p in pids if p != os.getpid()]


def _killed_mid_run(ckpt: Path, env: dict[str, str]) -> int:
    """Run a job until it has checkpointed twice, then SIGKILL every process of it, as a
    scheduler ending its job does: the launcher, torchrun's agent, the ranks (in
    sessions of their own: a SIGKILL of the launcher's process group leaves them
    training) and the persist process. No clean-up of its own runs. The newest step it
    reported."""
    metrics, err = Path(f"{ckpt}.jsonl"), Path(f"{ckpt}.err")
    with open(err, "w") as stderr:
        job = subprocess.Popen(
            [sys.executable, "-m", "moc", "train", *ARGS, "--steps", "100000", "--ckpt-dir",
             str(ckpt), "--metrics", str(metrics)], stdout=subprocess.DEVNULL, stderr=stderr,
            env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while len([e for e in read_events(metrics) if e["event"] == "checkpoint"]) < 2:
            assert job.poll() is None, err.read_text()[-3000:]
            assert time.monotonic() < deadline, "the job never checkpointed"
            time.sleep(0.2)
    finally:
        deadline = time.monotonic() + 60
        while pids := _job_processes(env["MOC_SHM_ROOT"]):
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            job.poll()  # reap the launcher
            assert time.monotonic() < deadline, f"the job's processes outlived it: {pids}"
            time.sleep(0.1)
        job.wait()
    return max(e["step"] for e in read_events(metrics) if e["event"] == "step")


def _headers(ckpt: Path) -> list[Path]:
    return sorted(job_dir(default_job_id(ckpt)).glob("rank-*/slot-*.json"))


def test_a_crashed_job_restarted_after_another_job_started_resumes_from_memory(tmp_path):
    # The memory root: the test's own (tests/conftest.py), where only these jobs run.
    env = {k: v for k, v in os.environ.items() if k != GRACE_ENV}  # the default grace
    first, other = tmp_path / "first", tmp_path / "other"

    last = _killed_mid_run(first, env)
    assert len(_headers(first)) >= 2  # a sealed snapshot per rank, left by the SIGKILL

    # Another job starts on the node (its start cleans up dead jobs), trains, and is
    # killed in its turn.
    _killed_mid_run(other, env)
    assert len(_headers(first)) >= 2, "the other job's start removed the dead job's memory"
    assert (job_dir(default_job_id(first)) / GONE).exists()  # its grace has begun

    # The first, restarted as a new command: from memory, not from storage.
    done = _train(first, last + 5, env)
    assert done.returncode == 0, done.stderr[-3000:]
    (recovery,) = [e for e in read_events(Path(f"{first}.jsonl"))
                   if e["event"] == "recovery"]
    assert recovery["source"] == "memory", recovery
    assert not job_dir(default_job_id(first)).exists()  # a job that ends removes its own

    # The other's grace began at the first's restart; past it, the next job's start
    # removes its memory (a grace of half a second here, ten minutes by default).
    gone = job_dir(default_job_id(other)) / GONE
    time.sleep(max(0.0, float(gone.read_text()) + 0.5 - time.time()))
    claim = subprocess.run(
        [sys.executable, "-c", "from moc.checkpoint.twolevel.memory.jobdir import claim_job;"
         "claim_job('next')"], env={**env, GRACE_ENV: "0.5"}, capture_output=True,
        text=True, timeout=120)
    assert claim.returncode == 0, claim.stderr[-2000:]
    assert not job_dir(default_job_id(other)).exists()
