"""A preempted `moc train` keeps its last step (issue 29, item 8): SIGTERM to the launcher,
as a scheduler sends it, or SIGINT to its whole process group, as Ctrl-C does, in the
middle of a real run. Before: SIGTERM exited 1 with SignalException tracebacks, the
steps since the last checkpoint were lost and the job's shared memory stayed behind;
Ctrl-C printed about 60 lines of tracebacks."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from moc.checkpoint.store.manifest import Manifest
from moc.checkpoint.store.steps import complete_steps
from moc.train.metrics import read_events

pytestmark = pytest.mark.integration

ARGS = ["--nproc", "2", "--config", "tiny", "--ckpt-interval", "10", "--k-persist", "1",
        "--no-progress", "--device", "cpu"]


@pytest.fixture
def shm() -> Iterator[Path]:
    """Node-local memory of the test's own (a short path: the persist socket is under it)."""
    root = Path(tempfile.mkdtemp(prefix="moc-test-"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _reap(launcher: subprocess.Popen) -> None:
    """Whatever is left of a launcher's job (its own session), SIGKILLed."""
    if launcher.poll() is None:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()


def _steps(metrics: Path) -> list[int]:
    return [e["step"] for e in read_events(metrics) if e["event"] == "step"]


@pytest.mark.parametrize("signum", [signal.SIGTERM,
                                    pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_a_preempted_run_keeps_its_last_step_and_resumes_from_it(tmp_path, shm, signum):
    ckpt, metrics, err = tmp_path / "ckpt", tmp_path / "m.jsonl", tmp_path / "err.txt"
    env = {**os.environ, "MOC_SHM_ROOT": str(shm)}
    with open(err, "w") as stderr:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "moc", "train", *ARGS, "--steps", "100000", "--ckpt-dir",
             str(ckpt), "--metrics", str(metrics)], stdout=subprocess.DEVNULL, stderr=stderr,
            env=env, start_new_session=True)
        try:
            deadline = time.monotonic() + 180
            while max(_steps(metrics), default=0) < 25:  # mid-run: past a few checkpoints
                assert launcher.poll() is None, err.read_text()[-3000:]
                assert time.monotonic() < deadline, "the run never got going"
                time.sleep(0.2)
            if signum == signal.SIGTERM:
                launcher.send_signal(signum)  # the launcher alone, as `kill` or a scheduler
            else:
                os.killpg(launcher.pid, signum)  # every process of the job, as Ctrl-C
            launcher.wait(timeout=120)
        finally:
            _reap(launcher)
    text = err.read_text()
    name = signal.Signals(signum).name
    assert launcher.returncode == 128 + signum, text[-3000:]
    assert "Traceback" not in text and "SignalException" not in text, text[-3000:]
    last = max(_steps(metrics))
    lines = [ln for ln in text.splitlines() if "preempted" in ln]
    assert lines == [f"moc train: preempted ({name}) at step {last}: checkpoint {last} is "
                     "on storage"], text[-3000:]
    # The newest durable step is the last step trained, with every expert.
    assert complete_steps(ckpt)[-1] == last
    saved = Manifest.load(ckpt, last).experts_saved
    assert all(ids == [0, 1, 2, 3] for ids in saved.values())
    (preempted,) = [e for e in read_events(metrics) if e["event"] == "preempted"]
    assert preempted["step"] == last
    assert not list(shm.glob("moc-*")), "the job's shared memory was left behind"
    # The restart resumes from it and loses nothing.
    done = subprocess.run([sys.executable, "-m", "moc", "train", *ARGS, "--steps",
                           str(last + 5), "--ckpt-dir", str(ckpt), "--metrics", str(metrics)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (recovery,) = [e for e in read_events(metrics) if e["event"] == "recovery"]
    assert (recovery["resumed_from"], recovery["lost_tokens"]) == (last, 0), json.dumps(recovery)
    assert _steps(metrics)[-5:] == list(range(last + 1, last + 6))  # nothing redone


def test_a_sigterm_during_the_final_checkpoint_says_the_run_is_complete(tmp_path, shm):
    """Issue 47, finding 9: a SIGTERM that came after the last step's agreement round
    (during the final checkpoint, the validation or the close) ended the run with 143 and
    no line. The run still finishes and is durable; now it says so, in one line."""
    ckpt, metrics, err = tmp_path / "ckpt", tmp_path / "m.jsonl", tmp_path / "err.txt"
    steps = 12
    env = {**os.environ, "MOC_SHM_ROOT": str(shm)}
    # `small`: a final checkpoint and validation that outlast the poll below by far.
    args = [*ARGS, "--config", "small", "--ckpt-interval", "5"]
    with open(err, "w") as stderr:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "moc", "train", *args, "--steps", str(steps),
             "--ckpt-dir", str(ckpt), "--metrics", str(metrics)],
            stdout=subprocess.DEVNULL, stderr=stderr, env=env, start_new_session=True)
        try:
            deadline = time.monotonic() + 300
            while steps not in _steps(metrics):  # the last step's event: past its round
                assert launcher.poll() is None, err.read_text()[-3000:]
                assert time.monotonic() < deadline, "the run never got to its last step"
                time.sleep(0.02)
            launcher.send_signal(signal.SIGTERM)
            launcher.wait(timeout=120)
        finally:
            _reap(launcher)
    text = err.read_text()
    assert launcher.returncode == 128 + signal.SIGTERM, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    lines = [ln for ln in text.splitlines() if "SIGTERM" in ln]
    assert lines == [f"moc train: SIGTERM came after the last step ({steps}), as the run "
                     f"finished: the run is complete, checkpoint {steps} is on storage; "
                     "exit 143 as for any signal"], text[-3000:]
    assert complete_steps(ckpt)[-1] == steps
    assert not [e for e in read_events(metrics) if e["event"] == "preempted"]
    assert not list(shm.glob("moc-*")), "the job's shared memory was left behind"
