"""Step directories: invisible until committed, never the only good copy overwritten."""

from __future__ import annotations

import torch

from moc.checkpoint.store.format import write_safetensors
from moc.checkpoint.store.steps import (
    begin_step,
    commit_step,
    complete_steps,
    remove_abandoned,
    step_dir,
    tmp_dir,
)


def test_step_is_invisible_until_committed(tmp_path):
    tmp = begin_step(tmp_path, 10)
    write_safetensors(tmp / "rank-00000.safetensors", {"x": torch.ones(2)})
    assert complete_steps(tmp_path) == []
    commit_step(tmp_path, 10, "{}")
    assert complete_steps(tmp_path) == [10]
    assert not tmp_dir(tmp_path, 10).exists()


def test_abandoned_tmp_is_removed_but_a_replaced_only_copy_is_put_back(tmp_path):
    begin_step(tmp_path, 5)
    begin_step(tmp_path, 10)
    commit_step(tmp_path, 10, "{}")
    # A crash while re-committing step 10: the old copy was moved aside, the new one
    # never took its name.
    step_dir(tmp_path, 10).rename(tmp_path / "step-00000010.replaced")
    removed = remove_abandoned(tmp_path)
    assert [p.name for p in removed] == ["step-00000005.tmp"]
    assert complete_steps(tmp_path) == [10]


def test_a_planted_tmp_or_replaced_symlink_is_unlinked_and_its_target_kept(tmp_path):
    root, outside = tmp_path / "ckpt", tmp_path / "precious"
    root.mkdir()
    outside.mkdir()
    (outside / "data").write_text("keep me")
    (root / "step-00000005.tmp").symlink_to(outside, target_is_directory=True)
    (root / "step-00000006.replaced").symlink_to(outside, target_is_directory=True)
    removed = remove_abandoned(root)
    assert sorted(p.name for p in removed) == ["step-00000005.tmp", "step-00000006.replaced"]
    assert list(root.iterdir()) == [] and (outside / "data").read_text() == "keep me"
