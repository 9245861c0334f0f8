"""How workers end when the job fails (issue 29, item 19): with their own status and one
line each, never aborted by Python's teardown (SIGABRT, exit -6) nor left to be killed."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.fs import tmpfs

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("mode", ["pec", "moc"])
def test_too_many_failed_checkpoints_end_every_worker_with_its_own_status(tmp_path, mode):
    """A checkpoint directory on a full file system: every checkpoint fails, the third in
    a row ends the job (max_failures). Before, a worker could end with -6 (SIGABRT in the
    process groups' teardown) or -15 (killed by torchrun while it was still reporting)."""
    with tmpfs(tmp_path / "ckpt", size="600k") as ckpt:
        r = subprocess.run([sys.executable, "-m", "moc", "train", "--nproc", "2", "--config",
                            "tiny", "--steps", "100", "--ckpt-interval", "5", "--ckpt-mode",
                            mode, "--persist-policy", "wait", "--k-persist", "1",
                            "--ckpt-dir", str(ckpt), "--no-progress", "--device", "cpu"],
                           capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr[-3000:]
    assert "3 checkpoints in a row failed (max_failures=3)" in r.stderr
    codes = [int(c) for c in re.findall(r"rank \d+: exit (-?\d+)", r.stderr)]
    assert codes and all(c > 0 for c in codes), r.stderr[-3000:]
    assert "Traceback" not in r.stderr
