"""The snapshot thread: a plan, then a copy, behind forward and backward; its errors
reach the caller's thread."""

from __future__ import annotations

import os

import pytest
import torch

from moc.checkpoint.errors import CheckpointError
from moc.checkpoint.twolevel.slots import SnapshotStore
from moc.checkpoint.twolevel.worker import SnapshotHandle, SnapshotJob, SnapshotWorker


def test_the_copy_runs_in_the_background_and_errors_surface_on_wait():
    store, worker = SnapshotStore("job", rank=0), SnapshotWorker()
    handle = SnapshotHandle(worker, store, 5, lambda: SnapshotJob(2, {"w": torch.ones(3)}, {}))
    assert handle.wait().step == 5 and handle.slot == 2
    bad = SnapshotHandle(worker, store, 6, lambda: SnapshotJob(2, {"x": torch.ones(2)}, {},
                                                               on_done=lambda h: 1 / 0))
    with pytest.raises(CheckpointError, match="snapshot of step 6 failed"):
        bad.wait()


def test_a_failed_plan_is_raised_as_it_is_and_nothing_is_copied():
    store = SnapshotStore("job", rank=0)

    def plan() -> SnapshotJob:
        raise RuntimeError("Connection closed by peer")

    handle = SnapshotHandle(SnapshotWorker(), store, 7, plan)
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        handle.wait()
    assert handle.slot is None and store.headers() == {}


def test_a_process_leaving_does_not_wait_for_the_snapshot_thread(tmp_path):
    """The snapshot thread may sit in a collective whose peers are gone; the process must
    still exit (a non-daemon worker would hold it until the collective timed out)."""
    import subprocess
    import sys

    code = ("import threading, time\n"
            "from moc.checkpoint.twolevel.worker import SnapshotWorker\n"
            "worker = SnapshotWorker()\n"
            "started = threading.Event()\n"
            "worker.submit(lambda: (started.set(), time.sleep(3600)))\n"
            "started.wait()\n"
            "raise SystemExit(3)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "MOC_SHM_ROOT": str(tmp_path)})
    assert r.returncode == 3, r.stderr
