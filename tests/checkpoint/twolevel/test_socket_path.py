"""A job directory too deep for a Unix socket's address (108 bytes: "AF_UNIX path too
long", met by the GPU check's tests under nested temporary directories) still gets its
persist process: the socket is reached through a descriptor of the directory."""

import os

import pytest

from moc.checkpoint.policy.selection import PECPolicy
from moc.checkpoint.twolevel.checkpointer import TwoLevelCheckpointer
from moc.checkpoint.twolevel.memory.jobdir import job_dir
from moc.checkpoint.twolevel.persist.channel import SUN_PATH_MAX, socket_path
from tests.checkpoint.twolevel.test_consistency import _build, _step

pytestmark = pytest.mark.integration  # a real persist process


def test_a_job_directory_too_deep_for_a_socket_address_persists(tmp_path, monkeypatch):
    deep = tmp_path / ("d" * 90) / ("e" * 90)
    deep.mkdir(parents=True)
    monkeypatch.setenv("MOC_SHM_ROOT", str(deep))
    model, opt = _build(0)
    ckpt = TwoLevelCheckpointer(model, opt, tmp_path / "ckpt", policy=PECPolicy(k=1),
                                interval=1)
    try:
        _step(model, opt, 1, "cpu")
        ckpt.wait_for_snapshot()
        opt.step()
        ckpt.save(1)
        ckpt.flush()
        jdir = job_dir(ckpt.job)
        assert len(os.fsencode(str(jdir / "persist.sock"))) > SUN_PATH_MAX
        assert socket_path(jdir).startswith("/proc/self/fd/")
        assert (tmp_path / "ckpt").exists() and any((tmp_path / "ckpt").iterdir())
    finally:
        ckpt.close()
