"""A checkpoint directory belongs to one job at a time; its run identity; real processes."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import moc
from moc.checkpoint.store.identity import RUN_FILE, ensure_run_id, read_run_id
from moc.checkpoint.store.lock import LOCK_FILE, DirectoryInUseError
from moc.model import ModelConfig, Transformer
from tests.distributed import run_ranks
from tests.fs import tmpfs

REPO = Path(__file__).resolve().parents[3]
CFG = ModelConfig(seq_len=8, d_model=16, n_layers=2, n_heads=2, d_ffn=32, n_experts=4)

HOLD = """
import sys, time, torch
import moc
from moc.model import ModelConfig, Transformer
model = Transformer(ModelConfig(seq_len=8, d_model=16, n_layers=2, n_heads=2, d_ffn=32,
                                n_experts=4))
ckpt = moc.Checkpointer(model, torch.optim.AdamW(model.parameters()), sys.argv[1])
print("holding", flush=True)
time.sleep(600)
"""


def _engine(root: Path) -> moc.Checkpointer:
    model = Transformer(CFG)
    return moc.Checkpointer(model, torch.optim.AdamW(model.parameters()), root)


def _holder(root: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(root)], stdout=subprocess.PIPE,
                            text=True, env=env)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "holding"
    return proc


@pytest.mark.integration
def test_a_second_job_on_a_directory_is_refused_naming_the_holder(tmp_path):
    root = tmp_path / "ckpt"
    holder = _holder(root)
    try:
        with pytest.raises(DirectoryInUseError, match=f"pid {holder.pid} on .*use another"):
            _engine(root)
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.integration
def test_the_lock_dies_with_its_holder_so_a_restarted_job_takes_it(tmp_path):
    root = tmp_path / "ckpt"
    holder = _holder(root)
    os.kill(holder.pid, signal.SIGKILL)  # a crash: nobody releases anything
    holder.wait()
    ckpt = _engine(root)  # the restart of the same job
    ckpt.close()


def _locked_by_someone(root: Path) -> bool:
    """Whether another open file description (as another job would have) is refused."""
    fd = os.open(root / LOCK_FILE, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def test_engines_of_one_process_share_the_lock_until_the_last_closes(tmp_path):
    root = tmp_path / "ckpt"
    first, second = _engine(root), _engine(root)  # e.g. a fresh engine to restore with
    first.close()
    assert _locked_by_someone(root)  # still held for the second engine
    second.close()
    assert not _locked_by_someone(root)


def test_a_run_id_is_created_with_the_directory_and_kept(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    assert read_run_id(root) is None
    run_id = ensure_run_id(root)
    assert run_id and ensure_run_id(root) == run_id == read_run_id(root)
    (root / RUN_FILE).unlink()  # the directory emptied: a new run
    assert ensure_run_id(root) != run_id
    (root / RUN_FILE).write_text("{not json")
    with pytest.raises(moc.CheckpointError, match="unreadable"):
        read_run_id(root)


# -- a directory the job cannot write (issue 29, item 13) ------------------------------------

READ_ONLY = r"is not writable \(Read-only file system: .*moc\.lock\).*use a writable " \
    r"directory.*optimizer=None"


@contextlib.contextmanager
def _read_only_checkpoints(mnt: Path) -> Iterator[Path]:
    """A real tmpfs at `mnt` holding a checkpoint directory with step 1, then remounted
    read-only (EROFS: root ignores permission bits, not a read-only mount)."""
    with tmpfs(mnt, "64m"):
        root = mnt / "ckpt"
        ckpt = _engine(root)
        ckpt.save(1, {"step": 1})
        ckpt.close()
        done = subprocess.run(["mount", "-o", "remount,ro", str(mnt)], capture_output=True,
                              text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot remount a tmpfs read-only here ({done.stderr.strip()})")
        yield root


def test_a_training_engine_on_a_read_only_directory_is_refused_at_construction(
        tmp_path, monkeypatch):
    """It once warned, trained, failed every save and lost the run at the final one."""
    from moc.checkpoint.twolevel.checkpointer import TwoLevelCheckpointer

    monkeypatch.setenv("MOC_SHM_ROOT", str(tmp_path / "shm"))
    with _read_only_checkpoints(tmp_path / "mnt") as root:
        with pytest.raises(moc.CheckpointError, match=READ_ONLY):
            _engine(root)
        model = Transformer(CFG)
        with pytest.raises(moc.CheckpointError, match=READ_ONLY):
            TwoLevelCheckpointer(model, torch.optim.AdamW(model.parameters()), root)
        # Reading needs no write: a model-only engine restores from the same mount.
        reader = moc.Checkpointer(Transformer(CFG), None, root)
        assert reader.restore().step == 1
        reader.close()


def _build_on_read_only(rank: int, world: int, root: str) -> str:
    model = Transformer(CFG)
    try:
        moc.Checkpointer(model, torch.optim.AdamW(model.parameters()), root)
    except moc.CheckpointError as e:
        return str(e)
    return "built"


@pytest.mark.integration  # two gloo ranks
def test_every_rank_raises_the_read_only_refusal(tmp_path):
    """Rank 0 alone locks: the other ranks learn its refusal and raise it too, at once,
    rather than train on towards a save that cannot happen."""
    with _read_only_checkpoints(tmp_path / "mnt") as root:
        messages = run_ranks(_build_on_read_only, 2, str(root), timeout=120)
    assert all("is not writable (Read-only file system" in m for m in messages), messages
    assert messages[1].startswith("rank 0: "), messages
