"""Every two-level test gets node-local memory of its own."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def shm(tmp_path, monkeypatch):
    """Snapshots under the test's own directory (inherited by the ranks and the persist
    processes it starts), never in the machine's /dev/shm."""
    monkeypatch.setenv("MOC_SHM_ROOT", str(tmp_path / "shm"))
