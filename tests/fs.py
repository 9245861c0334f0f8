"""Real file systems with real limits for tests: a small tmpfs fills up (ENOSPC).

Mounting needs CAP_SYS_ADMIN (root in a container). Where it is not allowed, the test
that needs it is skipped with the reason: no fake file system stands in for it.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(path: Path, size: str = "16m") -> Iterator[Path]:
    """A fresh tmpfs of `size` mounted at `path` (created), unmounted afterwards."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs",
                           str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()})")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)



def fill(path: Path) -> None:
    """Fill the file system of directory `path` to the last byte, as another job would."""
    with open(path / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 16))
                f.flush()
        except OSError:
            pass
