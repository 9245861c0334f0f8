"""Node-local memory of the test run's own: no test leaves snapshots in the machine's.

A job killed by a test leaves its snapshots in shared memory for a grace period
(`moc.checkpoint.twolevel.memory.jobdir.GRACE_S`, ten minutes), for a restart to resume from.
A test run kills many jobs; in the machine's /dev/shm their memory would outlive the run
by that much, on a CI runner whose /dev/shm is often 64 MB. So every test gets a
MOC_SHM_ROOT of its own (inherited by the processes it starts), removed after it, and
the fixtures shared by several tests one for the session, removed at its end. A test
that sets MOC_SHM_ROOT itself overrides both.

The roots are in /dev/shm where there is one (tmpfs, as a node's memory is), or under
MOC_SHM_ROOT when the run is given one (scripts/gpu_check.sh, where /dev/shm is small).
The session's records this process as its owner (`jobdir.record_owner`), as a job's
directory does: a session killed before its end leaves it behind, and the next session,
or the next job's clean-up, removes it once this process is gone.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from moc.checkpoint.twolevel.memory.jobdir import read_owner, record_owner

BASE = os.environ.get("MOC_SHM_ROOT") or ("/dev/shm" if os.path.isdir("/dev/shm") else None)

# Checkpoint work at training's priority in every test and every process a test starts
# (issue 48). By default the snapshot thread runs in SCHED_IDLE and the persist process
# at niceness 19, to give the cores to training; on a machine that other work keeps
# busy that is almost nothing (weight 3 and 15 against 1024), and a test that waits for a
# snapshot or a persist waited minutes. The default is tested where it is the subject
# (`test_checkpointer.py`, `test_injob_units.py`), with the variable removed.
os.environ.setdefault("MOC_CKPT_PRIORITY", "normal")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The files that start real processes first, each file's tests kept together and in
    order. `make test` runs two workers (pytest-xdist, `--dist loadfile`: a file is one
    worker's, so its module fixtures run once), which take files in this order: long
    files first and the short unit files last let both finish together; in file order
    the last integration file ran alone on one worker while the other had nothing left."""
    heavy = {item.path for item in items if item.get_closest_marker("integration")}
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (item.path not in heavy, order[id(item)]))


@pytest.fixture(scope="session", autouse=True)
def session_shm_root() -> Iterator[Path]:
    base = Path(BASE or tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    for left in base.glob("moc-tests-*"):  # of sessions killed before their end
        owner = read_owner(left)
        if owner is not None and owner.gone(this_machine=True) is True:
            shutil.rmtree(left, ignore_errors=True)
    root = Path(tempfile.mkdtemp(prefix="moc-tests-", dir=base))
    record_owner(root, os.getpid())
    before = os.environ.get("MOC_SHM_ROOT")
    os.environ["MOC_SHM_ROOT"] = str(root)
    try:
        yield root
    finally:
        if before is None:
            os.environ.pop("MOC_SHM_ROOT", None)
        else:
            os.environ["MOC_SHM_ROOT"] = before
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(autouse=True)
def shm_root_per_test(session_shm_root: Path, monkeypatch: pytest.MonkeyPatch
                      ) -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="t-", dir=session_shm_root))
    monkeypatch.setenv("MOC_SHM_ROOT", str(root))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)
