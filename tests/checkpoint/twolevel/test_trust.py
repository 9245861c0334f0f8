"""Two-level checkpoints are never stale, foreign or silently lost at the end of a run."""

from __future__ import annotations

import shutil

import pytest
import torch

from moc.checkpoint.failures import CheckpointFailedError
from moc.checkpoint.policy.selection import PECPolicy
from moc.checkpoint.store.steps import complete_steps
from moc.checkpoint.tools import inspect_checkpoints
from moc.checkpoint.twolevel.checkpointer import TwoLevelCheckpointer
from moc.checkpoint.twolevel.memory.jobdir import job_dir
from moc.model import ModelConfig, Transformer
from tests.checkpoint.twolevel.test_checkpointer import _train
from tests.fs import fill, tmpfs

pytestmark = pytest.mark.integration  # real persist processes

CFG = ModelConfig(seq_len=8, d_model=16, n_layers=2, n_heads=2, d_ffn=32, n_experts=4)


def _build(seed: int):
    torch.manual_seed(seed)
    model = Transformer(CFG)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _ages(root):
    info = inspect_checkpoints(root)["newest"]
    return info["step"], sorted({a for row in info["expert_age"].values() for a in row})


@pytest.mark.parametrize("final", [True, False], ids=["final-save", "close-only"])
def test_a_finished_run_leaves_a_complete_lossless_checkpoint_on_storage(tmp_path, final):
    root = tmp_path / "ckpt"
    model, opt = _build(0)
    ckpt = TwoLevelCheckpointer(model, opt, root, policy=PECPolicy(k=1), interval=1)
    _train(model, opt, ckpt, 9, final_at=9 if final else None)
    ckpt.close()  # memory is gone after this: only storage is left
    assert not job_dir(ckpt.job).exists()
    assert _ages(root) == (9, [0])  # every expert of the final step is from that step
    fresh, fresh_opt = _build(1)
    resumed = TwoLevelCheckpointer(fresh, fresh_opt, root, policy=PECPolicy(k=1), interval=1)
    report = resumed.restore()
    assert (report.step, report.source, report.lost_tokens, report.plt) == (9, "storage", 0,
                                                                             0.0)
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
    resumed.close()


def test_a_final_save_is_persisted_even_while_a_persist_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("MOC_PERSIST_STALL_S", "0.3")  # a slow disk: saves would be skipped
    root = tmp_path / "ckpt"
    model, opt = _build(0)
    ckpt = TwoLevelCheckpointer(model, opt, root, policy=PECPolicy(k=1), interval=1)
    _train(model, opt, ckpt, 4, final_at=4)
    ckpt.flush()
    ckpt.close()
    assert complete_steps(root)[-1] == 4 and _ages(root) == (4, [0])


def test_snapshots_of_another_run_on_the_same_directory_are_never_restored(tmp_path):
    root = tmp_path / "ckpt"
    model, opt = _build(0)
    ckpt = TwoLevelCheckpointer(model, opt, root, policy=PECPolicy(k=1), interval=5)
    _train(model, opt, ckpt, 10)
    ckpt.close(keep_snapshots=True)  # as after a crash: memory survives
    for p in root.iterdir():  # rm -rf DIR/*: the directory is kept, its content is not
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    other, other_opt = _build(7)  # a different run (another seed), the same model
    fresh = TwoLevelCheckpointer(other, other_opt, root, policy=PECPolicy(k=1), interval=5)
    assert fresh.restore() is None  # a fresh start, not "resumed from step 10 (memory)"
    fresh.close()


def test_persists_that_keep_failing_end_the_run_and_keep_the_only_copy(tmp_path):
    with tmpfs(tmp_path / "fs", size="4m") as fs:
        root = fs / "ckpt"
        model, opt = _build(0)
        ckpt = TwoLevelCheckpointer(model, opt, root, policy=PECPolicy(k=1), interval=1,
                                    persist_policy="wait", max_failures=2)
        _train(model, opt, ckpt, 1)
        ckpt.flush()
        fill(fs)  # the disk fills up under the job
        with pytest.raises(CheckpointFailedError, match="2 checkpoints in a row failed"):
            _train(model, opt, ckpt, 4, start=2)
        with pytest.raises(CheckpointFailedError):
            ckpt.close()  # the newest snapshot cannot be made durable either
        assert complete_steps(root) == [1]
        assert job_dir(ckpt.job).is_dir()  # the newest copy was not deleted
