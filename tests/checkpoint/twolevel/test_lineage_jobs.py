"""Several jobs on one checkpoint directory, on different hosts (each its own
MOC_SHM_ROOT): memory left by one line of training is never restored, nor mixed, into
another (issue 29, item 1). Real processes, a real SIGKILL, real persist processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moc.checkpoint.store.manifest import Manifest
from moc.checkpoint.store.steps import complete_steps
from moc.checkpoint.tools import verify_checkpoints

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[3]


def _job(root: Path, host: Path, *args: str, stall: float = 0.0) -> dict:
    env = {**os.environ, "MOC_SHM_ROOT": str(host), "MOC_PERSIST_STALL_S": str(stall)}
    # Files, not pipes: a SIGKILLed job's persist process may outlive it for a moment,
    # and would hold a pipe open.
    log = root.parent / f"job-{len(list(root.parent.glob('job-*.out')))}"
    with open(f"{log}.out", "w") as out, open(f"{log}.err", "w") as err:
        done = subprocess.run([sys.executable, "-m", "tests.checkpoint.twolevel.job",
                               str(root), *args], cwd=REPO, env=env, stdout=out,
                              stderr=err, timeout=600)
    lines = [ln for ln in Path(f"{log}.out").read_text().splitlines() if ln.startswith("{")]
    assert lines, (f"job {args} printed nothing (exit {done.returncode}): "
                   f"{Path(f'{log}.err').read_text()[-3000:]}")
    return json.loads(lines[-1])


@pytest.mark.slow  # long; CI time (make test-slow runs it)
def test_a_later_job_never_restores_another_lines_memory_over_a_newer_commit(tmp_path):
    """The issue's three jobs. A (host A) commits step 10, then its persist stalls and it
    dies with steps up to 50 in host A's memory only. B (host B, other batches)
    resumes from 10 and commits 20..50 of its own line. C, back on host A, must take
    B's step 50 from storage: A's memory snapshot of step 50 is of another line."""
    root, host_a, host_b = tmp_path / "ckpt", tmp_path / "host-a", tmp_path / "host-b"
    _job(root, host_a, "--steps", "10", "--persist-policy", "wait")
    a = _job(root, host_a, "--restore", "--steps", "50", "--crash", stall=600.0)
    assert complete_steps(root) == [10]
    b = _job(root, host_b, "--restore", "--data", "1", "--steps", "50",
             "--persist-policy", "wait")
    assert b["restored"] == [10, "storage"]
    assert complete_steps(root)[-1] == 50
    c = _job(root, host_a, "--restore", "--steps", "50")
    assert c["restored"] == [50, "storage"]  # before the fix: [50, "memory"], A's
    assert c["restored_digest"] == b["digest"] != a["digest"]  # B's weights, not A's
    assert verify_checkpoints(root).ok


def test_storage_steps_record_their_run_and_line(tmp_path):
    root, host = tmp_path / "ckpt", tmp_path / "host"
    _job(root, host, "--steps", "20", "--persist-policy", "wait")
    _job(root, host, "--restore", "--steps", "30", "--persist-policy", "wait")
    run = json.loads((root / "moc-run.json").read_text())["run_id"]
    first, resumed = Manifest.load(root, 20), Manifest.load(root, 30)
    assert first.run_id == resumed.run_id == run
    assert resumed.lineage.descends_from(30, first.lineage, 20)
    assert not first.lineage.descends_from(20, resumed.lineage, 30)
