"""The CUDA tests' snapshots live where production's do: in a tmpfs (/dev/shm, or the
MOC_TEST_SHM_BASE that scripts/gpu_check.sh gives them), never under tmp_path, which is a
disk file system on a lent GPU machine (cudaHostRegister of a file-backed mapping can be
refused there, and a test would then measure what production never runs)."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest


@pytest.fixture(autouse=True)
def shm(monkeypatch):
    base = os.environ.get("MOC_TEST_SHM_BASE", "/dev/shm")
    root = tempfile.mkdtemp(prefix="moc-gpu-test-", dir=base)
    monkeypatch.setenv("MOC_SHM_ROOT", root)
    yield root
    shutil.rmtree(root, ignore_errors=True)
