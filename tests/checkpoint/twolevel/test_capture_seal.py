"""Captured, then sealed: training waits for the first alone, and only the second makes a
recovery source. A process SIGKILLed between the two leaves the previous sealed snapshot
as the newest in memory, and a restart resumes from it exactly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from moc.checkpoint.policy.selection import PECPolicy
from moc.checkpoint.twolevel.checkpointer import TwoLevelCheckpointer
from moc.checkpoint.twolevel.memory.jobdir import default_job_id
from moc.checkpoint.twolevel.memory.slots import SnapshotStore
from moc.checkpoint.twolevel.snapshot.capture import CAPTURE_ENV, SEAL_STALL_ENV, HostCopy
from tests.checkpoint.twolevel.test_consistency import _assert_same, _build, _state, _step

pytestmark = pytest.mark.integration  # real persist processes, a real SIGKILL

CHILD = textwrap.dedent(f"""
    import os, sys, time
    import torch
    from moc.checkpoint.policy.selection import PECPolicy
    from moc.checkpoint.twolevel.checkpointer import TwoLevelCheckpointer
    from tests.checkpoint.twolevel.test_consistency import _build, _state, _step

    root, out, device = sys.argv[1], sys.argv[2], sys.argv[3]
    model, opt = _build(0, device)
    ckpt = TwoLevelCheckpointer(model, opt, root, policy=PECPolicy(k=1), interval=1)
    for step in (1, 2):
        _step(model, opt, step, device)
        ckpt.wait_for_snapshot()
        opt.step()
        opt.zero_grad()
        if step == 1:
            ckpt.save(1)
            ckpt.flush()  # captured and sealed
            torch.save(_state(model, opt), out)
            os.environ[{SEAL_STALL_ENV!r}] = "600"  # every later seal stalls: the window
        else:
            ckpt.save(2)
    _step(model, opt, 3, device)  # the next forward and backward, as training goes on
    ckpt.wait_for_snapshot()  # captured: training may go on, the seal has not happened
    print("captured 2", flush=True)
    time.sleep(600)
""")


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]


@pytest.mark.parametrize("device", DEVICES)
def test_a_process_killed_between_capture_and_seal_resumes_from_the_sealed_one(tmp_path,
                                                                               device):
    root, out = tmp_path / "ckpt", tmp_path / "step1.pt"
    # On a CPU the default capture takes the checksums and the seal then only writes
    # the header, before training goes on: split, so that there is a window to kill in.
    env = {**os.environ, "PYTHONPATH": os.getcwd(), CAPTURE_ENV: "split"}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(root), str(out), device],
                             env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        assert line == "captured 2\n", line + child.stderr.read()
        child.send_signal(signal.SIGKILL)  # inside the seal of step 2
        child.wait(60)
    finally:
        if child.poll() is None:
            child.kill()
    store = SnapshotStore(default_job_id(root), 0)
    # Step 2's slot holds every byte of it, but no header: it is no recovery source.
    assert sorted(h.step for h in store.headers().values()) == [1]
    at_1 = torch.load(out)
    model, opt = _build(1, device)  # other weights: the restore must replace every one
    ckpt = TwoLevelCheckpointer(model, opt, root, policy=PECPolicy(k=1), interval=1)
    report = ckpt.restore()
    assert (report.step, report.source, report.lost_tokens) == (1, "memory", 0)
    _assert_same(_state(model, opt), at_1)
    # ... and it goes on: the next snapshot is captured and sealed as before (the
    # restarted process runs the default capture).
    _step(model, opt, 2, device)
    ckpt.wait_for_snapshot()
    opt.step()
    ckpt.save(2)
    ckpt.flush()
    assert sorted(h.step for h in store.headers().values()) == [1, 2]
    ckpt.close()


def test_training_waits_for_the_capture_alone_and_flush_for_the_seal(tmp_path, monkeypatch):
    """With the seal stalled, `wait_for_snapshot` returns (captured) while no header is
    written; `flush` waits for the seal, and the result reports both phases."""
    monkeypatch.setenv(SEAL_STALL_ENV, "1.5")
    monkeypatch.setenv(CAPTURE_ENV, "split")
    model, opt = _build(0)
    ckpt = TwoLevelCheckpointer(model, opt, tmp_path / "ckpt", policy=PECPolicy(k=1),
                                interval=1)
    store = SnapshotStore(ckpt.job, 0)
    _step(model, opt, 1)
    opt.step()
    ckpt.save(1)
    ckpt.wait_for_snapshot()
    assert store.headers() == {}  # captured, not sealed
    assert not ckpt.drain_completed()  # not final before its seal
    ckpt.flush()
    assert [h.step for h in store.headers().values()] == [1]
    [result] = ckpt.drain_completed()
    snapshot = result.phases["snapshot"]
    assert {"copy", "checksum", "header"} <= set(snapshot)
    assert result.snapshot_s >= 1.5 > result.wait_s
    ckpt.close()


def test_a_split_capture_restores_as_exactly_as_the_fused_one(tmp_path, monkeypatch):
    """MOC_CPU_CAPTURE=split copies first and lets the seal hash the slot: the same
    snapshot, restored bit for bit."""
    monkeypatch.setenv(CAPTURE_ENV, "split")
    model, opt = _build(0)
    ckpt = TwoLevelCheckpointer(model, opt, tmp_path / "ckpt", policy=PECPolicy(k=1),
                                interval=1)
    assert ckpt.snapshots.copier == HostCopy(fused=False)
    for step in (1, 2):
        _step(model, opt, step)
        ckpt.wait_for_snapshot()
        opt.step()
        opt.zero_grad()
        ckpt.save(step)
    ckpt.flush()
    at_2 = _state(model, opt)
    ckpt.close(keep_snapshots=True)
    model, opt = _build(1)
    again = TwoLevelCheckpointer(model, opt, tmp_path / "ckpt", policy=PECPolicy(k=1),
                                 interval=1)
    report = again.restore()
    assert (report.step, report.source) == (2, "memory")
    _assert_same(_state(model, opt), at_2)
    again.close()


def test_an_unknown_capture_mode_is_refused_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.setenv(CAPTURE_ENV, "fast")
    model, opt = _build(0)
    with pytest.raises(ValueError, match="MOC_CPU_CAPTURE='fast': expected fused"):
        TwoLevelCheckpointer(model, opt, tmp_path / "ckpt", interval=1)
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())
