"""The snapshot thread: a plan, then a copy, behind forward and backward; its errors
reach the caller's thread."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from moc.checkpoint.errors import CheckpointError
from moc.checkpoint.twolevel.memory.slots import SnapshotStore
from moc.checkpoint.twolevel.snapshot.capture import HostCopy
from moc.checkpoint.twolevel.snapshot.worker import SnapshotHandle, SnapshotJob, SnapshotWorker


def test_the_copy_runs_in_the_background_and_errors_surface_on_wait():
    store, worker = SnapshotStore("job", rank=0), SnapshotWorker()
    handle = SnapshotHandle(worker, store, HostCopy(), 5,
                            lambda: SnapshotJob(2, {"w": torch.ones(3)}, {}))
    handle.wait()
    assert handle.wait_sealed().step == 5 and handle.slot == 2
    bad = SnapshotHandle(worker, store, HostCopy(fused=False), 6, lambda: SnapshotJob(
        2, {"x": torch.ones(2)}, {}, on_done=lambda h: 1 / 0))
    bad.wait()  # captured: the failure is the seal's
    with pytest.raises(CheckpointError, match="snapshot of step 6 failed"):
        bad.wait_sealed()
    # The fused capture took the checksums: its seal only writes the header, and the
    # capture waits for it, so a failure there is the capture's too.
    fused = SnapshotHandle(worker, store, HostCopy(), 7, lambda: SnapshotJob(
        2, {"x": torch.ones(2)}, {}, on_done=lambda h: 1 / 0))
    for wait in (fused.wait, fused.wait_sealed):
        with pytest.raises(CheckpointError, match="snapshot of step 7 failed"):
            wait()


def test_a_failed_capture_is_raised_by_both_waits_and_the_plan_hears_of_it():
    store, worker = SnapshotStore("job", rank=0), SnapshotWorker()
    heard = []
    tensor = torch.ones(3)

    def plan() -> SnapshotJob:
        tensor.add_(1)  # in place, between the plan's versions and the copy: see below
        return SnapshotJob(1, {"w": tensor}, {}, on_error=heard.append)

    handle = SnapshotHandle(worker, store, HostCopy(), 7, plan)
    handle.wait()  # this change came before the versions were read: nothing to see
    held, go = threading.Event(), threading.Event()

    class SlowCopy(HostCopy):
        def copy(self, views, tensors, ready):
            held.set()
            assert go.wait(30)
            return super().copy(views, tensors, ready)

    handle = SnapshotHandle(worker, store, SlowCopy(), 8,
                            lambda: SnapshotJob(2, {"w": tensor}, {}, on_error=heard.append))
    assert held.wait(30)
    tensor.add_(1)  # during the copy: the capture holds some of each version
    go.set()
    for wait in (handle.wait, handle.wait_sealed):
        with pytest.raises(CheckpointError, match="snapshot of step 8 failed: the state "
                                                  "changed while the snapshot"):
            wait()
    assert len(heard) == 1 and 2 not in store.headers() and 1 in store.headers()


def test_a_failed_plan_is_raised_as_it_is_and_nothing_is_copied():
    store = SnapshotStore("job", rank=0)

    def plan() -> SnapshotJob:
        raise RuntimeError("Connection closed by peer")

    handle = SnapshotHandle(SnapshotWorker(), store, HostCopy(), 7, plan)
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        handle.wait()
    assert handle.slot is None and store.headers() == {}


def test_a_process_leaving_does_not_wait_for_the_snapshot_thread(tmp_path):
    """The snapshot thread may sit in a collective whose peers are gone; the process must
    still exit (a non-daemon worker would hold it until the collective timed out)."""
    import subprocess
    import sys

    code = ("import threading, time\n"
            "from moc.checkpoint.twolevel.snapshot.worker import SnapshotWorker\n"
            "worker = SnapshotWorker()\n"
            "started = threading.Event()\n"
            "worker.submit(lambda: (started.set(), time.sleep(3600)))\n"
            "started.wait()\n"
            "raise SystemExit(3)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "MOC_SHM_ROOT": str(tmp_path)})
    assert r.returncode == 3, r.stderr
