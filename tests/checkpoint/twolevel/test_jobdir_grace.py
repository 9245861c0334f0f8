"""A dead job's snapshots outlive it for a grace period (issue 40, item 5): the next job's
clean-up keeps them for the dead job's restart as a new command, unless the memory is
needed. The processes' version: tests/train/test_memory_grace.py."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from moc.checkpoint.errors import CheckpointError
from moc.checkpoint.liveness import ProcessId
from moc.checkpoint.twolevel.memory.jobdir import (
    GONE,
    GRACE_ENV,
    GRACE_S,
    OWNER,
    claim_job,
    grace_s,
    job_dir,
    remove_stale_jobs,
)
from moc.checkpoint.twolevel.memory.slots import SnapshotStore
from moc.checkpoint.twolevel.snapshot.capture import write_snapshot
from tests.fs import tmpfs
from tests.procs import dead_pid


def _dead_job(job: str, snapshot: bool = True, nbytes: int = 64) -> None:
    """A job whose owner is gone, as a SIGKILL leaves it: with a sealed snapshot or not."""
    job_dir(job).mkdir(parents=True)
    (job_dir(job) / OWNER).write_text(json.dumps(
        ProcessId.of(os.getpid()).to_json() | {"pid": dead_pid()}))
    if snapshot:
        write_snapshot(SnapshotStore(job, 0), 0, 5, {"w": torch.ones(nbytes // 4)}, {})


def test_a_dead_jobs_snapshots_are_kept_for_its_grace_then_removed():
    _dead_job("crashed")
    assert remove_stale_jobs(keep="next") == []
    assert 0 in SnapshotStore("crashed", 0).headers()
    first = float((job_dir("crashed") / GONE).read_text())  # the grace starts here
    assert remove_stale_jobs(keep="later") == []
    assert float((job_dir("crashed") / GONE).read_text()) == first  # not restarted by a look
    (job_dir("crashed") / GONE).write_text(repr(first - GRACE_S))  # the grace is over
    assert [p.name for p in remove_stale_jobs(keep="next")] == ["moc-crashed"]


def test_a_dead_job_with_nothing_to_resume_from_is_removed_at_once():
    """No sealed snapshot (it died before its first; or a `moc train --nodes` root):
    nothing a restart could use, so no grace."""
    _dead_job("early", snapshot=False)
    SnapshotStore("early", 0).prepare(1024)  # slots reserved, none sealed
    assert [p.name for p in remove_stale_jobs(keep="next")] == ["moc-early"]


def test_no_grace_removes_a_dead_job_at_the_next_start(monkeypatch):
    _dead_job("crashed")
    monkeypatch.setenv(GRACE_ENV, "0")
    assert grace_s() == 0
    claim_job("next")
    assert not job_dir("crashed").exists()


def test_the_restarted_job_claims_its_memory_back_and_its_next_death_starts_a_new_grace():
    _dead_job("crashed")
    remove_stale_jobs(keep="next")
    assert (job_dir("crashed") / GONE).exists()
    claim_job("crashed")  # the restart: this process is its owner now
    assert not (job_dir("crashed") / GONE).exists()
    assert 0 in SnapshotStore("crashed", 0).headers()  # its recovery source


@pytest.mark.parametrize("value", ["ten", "-1", "nan", "inf"])
def test_a_bad_grace_is_one_line_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv(GRACE_ENV, value)
    with pytest.raises(CheckpointError, match=rf"^{GRACE_ENV}='{value}': expected a number "
                       "of seconds >= 0 \\(the default is 600"):
        claim_job("next")
    monkeypatch.setenv(GRACE_ENV, "2.5")
    assert grace_s() == 2.5


@pytest.mark.integration
def test_a_job_short_of_memory_takes_it_from_dead_jobs_in_their_grace(
        tmp_path, monkeypatch, caplog):
    """The grace costs a live job nothing: when its slots cannot be reserved, the dead
    jobs' snapshots give way (else it would fail with ENOSPC while a dead job's memory
    waits for a restart that may never come). A live job's are never touched."""
    with tmpfs(tmp_path / "shm", "8m") as root:
        monkeypatch.setenv("MOC_SHM_ROOT", str(root))
        _dead_job("crashed", nbytes=1_600_000)  # 3 slots of 1.6 MB
        claim_job("alive")  # this process: running
        write_snapshot(SnapshotStore("alive", 0), 0, 5, {"w": torch.ones(50_000)}, {})
        claim_job("new")  # the dead job is in its grace: kept
        assert job_dir("crashed").exists()
        store = SnapshotStore("new", 0)
        write_snapshot(store, 0, 5, {"w": torch.ones(300_000)}, {})  # 3 x 1.2 MB: no room
        assert 0 in store.headers()
        assert not job_dir("crashed").exists()
        assert 0 in SnapshotStore("alive", 0).headers()
    assert "removed the snapshots of dead job moc-crashed before its grace was over" in (
        caplog.text)


def test_the_grace_starts_when_a_clean_up_first_finds_the_owner_gone():
    """Not at the dead job's last write: a job can run an hour between snapshots, and
    its crash is not known to anyone until a clean-up looks."""
    _dead_job("crashed")
    long_ago = time.time() - 10 * GRACE_S
    for p in job_dir("crashed").rglob("*"):
        os.utime(p, (long_ago, long_ago))
    assert remove_stale_jobs(keep="next") == []
