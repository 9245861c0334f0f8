"""Every two-level test gets node-local memory of its own."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest


@pytest.fixture(autouse=True)
def shm(tmp_path, monkeypatch):
    """Snapshots under the test's own directory (inherited by the ranks and the persist
    processes it starts), never in the machine's /dev/shm. Where MOC_TEST_SHM_BASE names
    a tmpfs (scripts/gpu_check.sh, on a lent GPU: tmp_path is a disk there, and a
    file-backed mapping may not be pinned), in a directory of their own under it."""
    base = os.environ.get("MOC_TEST_SHM_BASE")
    if base is None:
        monkeypatch.setenv("MOC_SHM_ROOT", str(tmp_path / "shm"))
        yield
        return
    root = tempfile.mkdtemp(prefix="moc-test-", dir=base)
    monkeypatch.setenv("MOC_SHM_ROOT", root)
    yield
    shutil.rmtree(root, ignore_errors=True)
