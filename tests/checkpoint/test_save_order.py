"""Saves never go back, rollbacks are explicit, and a step of another run or line is
never restored (issue 29, items 1 and 2): the synchronous engine, real files."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from moc.checkpoint.errors import CorruptCheckpointError
from moc.checkpoint.export import export
from moc.checkpoint.policy.selection import PECPolicy
from moc.checkpoint.store.manifest import Manifest
from moc.checkpoint.store.steps import ROLLED_BACK_SUFFIX, complete_steps, step_dir
from moc.checkpoint.sync import Checkpointer
from moc.checkpoint.tools import format_verify, verify_checkpoints
from moc.model import ModelConfig, Transformer

CFG = ModelConfig(vocab_size=64, seq_len=8, d_model=16, n_layers=2, n_heads=2, d_ffn=16,
                  n_experts=4)


def _build(seed: int = 0):
    torch.manual_seed(seed)
    model = Transformer(CFG)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _engine(root, model, opt, **kw) -> Checkpointer:
    kw.setdefault("policy", PECPolicy(k=1))
    return Checkpointer(model, opt, root, interval=10, **kw)


def _train(model, opt, ckpt, first: int, last: int, lr_scale: float = 1.0) -> None:
    for step in range(first, last + 1):
        idx = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step))
        out = model(idx, idx)
        (out.loss * lr_scale).backward()
        opt.step()
        opt.zero_grad()
        ckpt.record_routing(out.tokens_per_expert)
        ckpt.maybe_save(step, {"step": step})


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _run(root, last: int = 60, keep_last: int | None = 3):
    model, opt = _build()
    ckpt = _engine(root, model, opt, keep_last=keep_last)
    _train(model, opt, ckpt, 1, last)
    ckpt.close()
    return model


def test_a_loop_that_forgot_restore_cannot_save_over_the_directory(tmp_path):
    """The issue's loop: steps 10-30 saved into a directory holding 30-60 (keep_last=3)
    were all accepted, and the new step 30 replaced a file that steps 40 and 50 read
    (verify: checksum mismatch). Each is now refused before a byte is written."""
    root = tmp_path / "ckpt"
    _run(root)
    before = sorted(p.name for p in root.iterdir())
    model, opt = _build(1)
    ckpt = _engine(root, model, opt, keep_last=3)
    for step in (10, 20, 30, 60):
        with pytest.raises(ValueError, match=rf"step {step} is not after step 60, the "
                                             r"newest checkpoint.*restore\(\)"):
            ckpt.save(step, {"step": step})
    ckpt.close()
    assert sorted(p.name for p in root.iterdir()) == before
    assert verify_checkpoints(root).ok
    assert _engine(root, *_build(2)).restore().step == 60


def test_steps_must_increase_within_a_run_but_the_newest_may_be_saved_again(tmp_path):
    model, opt = _build()
    ckpt = _engine(tmp_path, model, opt)
    ckpt.save(5, {"step": 5})
    with pytest.raises(ValueError, match="step 3 is before step 5"):
        ckpt.save(3, {"step": 3})
    ckpt.save(5, {"step": 5}, final=True)  # the newest again: a final save
    ckpt.close()
    assert complete_steps(tmp_path) == [5]


def test_a_restored_step_continues_and_may_be_saved_again(tmp_path):
    root = tmp_path / "ckpt"
    _run(root, 30, keep_last=None)
    model, opt = _build(1)
    ckpt = _engine(root, model, opt)
    assert ckpt.restore().step == 30
    ckpt.save(30, {"step": 30}, final=True)  # complete, for an export
    _train(model, opt, ckpt, 31, 40)
    ckpt.close()
    assert complete_steps(root) == [10, 20, 30, 40]
    assert verify_checkpoints(root).ok


def test_a_rollback_continues_from_its_step_and_sets_the_newer_ones_aside(tmp_path):
    root = tmp_path / "ckpt"
    _run(root, 60, keep_last=None)
    model, opt = _build(1)
    ckpt = _engine(root, model, opt)
    report = ckpt.restore(step=30)
    assert report.step == 30 and report.extra["step"] == 30
    assert complete_steps(root) == [10, 20, 30]
    aside = sorted(p.name for p in root.glob(f"step-*{ROLLED_BACK_SUFFIX}*"))
    assert aside == [f"step-{s:08d}{ROLLED_BACK_SUFFIX}" for s in (40, 50, 60)]
    assert "rolled back" in (root / aside[0] / "ROLLED_BACK.txt").read_text()
    _train(model, opt, ckpt, 31, 50, lr_scale=2.0)  # another trajectory from 30
    ckpt.save(50, {"step": 50}, final=True)  # complete: every expert restores as trained
    expected = _params(model)
    ckpt.close()
    assert complete_steps(root) == [10, 20, 30, 40, 50]
    assert verify_checkpoints(root).ok  # step 30's chain is intact
    fresh, fresh_opt = _build(2)
    assert _engine(root, fresh, fresh_opt).restore().step == 50
    assert all(torch.equal(p, expected[n]) for n, p in fresh.named_parameters())
    new, old = Manifest.load(root, 50).lineage, Manifest.load(root, 30).lineage
    assert new.descends_from(50, old, 30)


def test_a_second_rollback_past_the_same_steps_keeps_both_sets_aside(tmp_path):
    root = tmp_path / "ckpt"
    _run(root, 40, keep_last=None)
    for _ in range(2):
        model, opt = _build(1)
        ckpt = _engine(root, model, opt)
        ckpt.restore(step=20)
        _train(model, opt, ckpt, 21, 40, lr_scale=0.5)
        ckpt.close()
    names = sorted(p.name for p in root.glob("step-00000040.rolledback*"))
    assert names == ["step-00000040.rolledback", "step-00000040.rolledback-1"]


def test_a_rollback_to_a_step_that_is_not_there_is_refused_and_changes_nothing(tmp_path):
    root = tmp_path / "ckpt"
    _run(root, 30, keep_last=None)
    ckpt = _engine(root, *_build(1))
    with pytest.raises(ValueError, match=r"cannot restore step 25: .*complete steps: 10, 20, "
                                         "30"):
        ckpt.restore(step=25)
    ckpt.close()
    assert complete_steps(root) == [10, 20, 30]


def test_a_reader_rolls_back_without_changing_the_directory(tmp_path):
    root = tmp_path / "ckpt"
    _run(root, 30, keep_last=None)
    model, _ = _build(1)
    report = Checkpointer(model, None, root, model_meta=None).restore(step=20)
    assert report.step == 20
    assert complete_steps(root) == [10, 20, 30]


def test_a_step_copied_in_from_another_run_is_never_restored_and_fails_verify(tmp_path):
    """Another run's complete step (a full one, so that its own files are all it needs)
    copied into the directory: before, restore took it as the newest, and verify said
    OK. Now restore skips it (and the next save sets it aside), verify names it."""
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    _run(ours, 20, keep_last=None)
    model, opt = _build(7)
    other = _engine(theirs, model, opt, policy=PECPolicy.full())
    _train(model, opt, other, 1, 30)
    other.close()
    shutil.copytree(step_dir(theirs, 30), step_dir(ours, 30))
    report = verify_checkpoints(ours)
    assert not report.ok and report.damaged_steps == [30]
    assert "belongs to run" in format_verify(report)
    with pytest.raises(CorruptCheckpointError, match="belongs to run"):
        export(ours, tmp_path / "out")  # the newest step: the foreign one
    assert not (tmp_path / "out").exists()
    model, opt = _build(1)
    ckpt = _engine(ours, model, opt)
    restored = ckpt.restore()
    assert restored.step == 20 and "belongs to run" in restored.skipped[0]
    _train(model, opt, ckpt, 21, 30)  # its first save sets the foreign step aside
    ckpt.close()
    assert (ours / "step-00000030.corrupt").is_dir()
    assert verify_checkpoints(ours).ok


def test_a_step_that_reads_another_lines_files_fails_verify(tmp_path):
    """Two copies of one run's directory continue along two lines from step 10; one's
    step 30 (which reads its own line's step 20) copied over the other's: verify says
    which step mixes lines, not only that a checksum fails."""
    a = tmp_path / "a"
    _run(a, 10, keep_last=None)
    b = tmp_path / "b"
    shutil.copytree(a, b)
    for root, scale in ((a, 1.0), (b, 3.0)):
        model, opt = _build(1)
        ckpt = _engine(root, model, opt)
        ckpt.restore()
        _train(model, opt, ckpt, 11, 30, lr_scale=scale)
        ckpt.close()
    shutil.rmtree(step_dir(b, 30))
    shutil.copytree(step_dir(a, 30), step_dir(b, 30))
    text = format_verify(verify_checkpoints(b))
    assert "step 30 reads files of step 20, which belongs to another line" in text
    with pytest.raises(CorruptCheckpointError, match="another line of training"):
        export(b, tmp_path / "out", allow_partial=True)


def test_a_directory_without_its_run_file_adopts_the_run_of_its_steps(tmp_path):
    """Steps copied with their chain into a fresh directory (without moc-run.json) are
    that run's: the directory takes their run id instead of making them all foreign."""
    src = tmp_path / "src"
    _run(src, 20, keep_last=None)
    dst = tmp_path / "dst"
    dst.mkdir()
    for step in (10, 20):
        shutil.copytree(step_dir(src, step), step_dir(dst, step))
    model, opt = _build(1)
    ckpt = _engine(dst, model, opt)
    assert ckpt.restore().step == 20
    ckpt.close()
    run = json.loads((dst / "moc-run.json").read_text())["run_id"]
    assert run == json.loads((src / "moc-run.json").read_text())["run_id"]


def test_a_restore_only_engine_says_nothing_of_a_step_it_did_not_write(tmp_path, caplog):
    """Before: an engine that only restored a complete final step warned at close that
    "the newest checkpoint ... is partial"; one that saved a partial last step must."""
    root = tmp_path / "ckpt"
    model, opt = _build()
    ckpt = _engine(root, model, opt)
    _train(model, opt, ckpt, 1, 10)
    ckpt.save(10, {"step": 10}, final=True)
    ckpt.close()
    caplog.clear()
    reader = _engine(root, *_build(1))
    assert reader.restore().step == 10
    reader.close()
    assert "partial" not in caplog.text
    model, opt = _build(1)
    writer = _engine(root, model, opt)
    writer.restore()
    _train(model, opt, writer, 11, 20)  # step 20: K=1 of 4 experts
    writer.close()
    assert "the newest checkpoint (step 20) is partial" in caplog.text


@pytest.mark.integration  # the two-level engine's persist process
def test_a_restore_only_two_level_engine_closes_without_a_warning(tmp_path, caplog,
                                                                  monkeypatch):
    from moc.checkpoint.twolevel.checkpointer import TwoLevelCheckpointer

    monkeypatch.setenv("MOC_SHM_ROOT", str(tmp_path / "shm"))
    root = tmp_path / "ckpt"
    _run(root, 20, keep_last=None)
    caplog.clear()
    model, opt = _build(1)
    ckpt = TwoLevelCheckpointer(model, opt, root, policy=PECPolicy(k=1), interval=10)
    assert ckpt.restore().step == 20
    ckpt.close()
    assert "not complete" not in caplog.text and "partial" not in caplog.text
