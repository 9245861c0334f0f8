from __future__ import annotations

import logging
import re
import shutil
import tempfile
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moc.checkpoint.errors import CheckpointError
from moc.checkpoint.recovery import CheckpointReader
from moc.checkpoint.store import retention
from moc.checkpoint.store.format import tensor_checksum, write_safetensors
from moc.checkpoint.store.manifest import Entry, Manifest
from moc.checkpoint.store.retention import (
    SUPERSEDED,
    BackgroundRetention,
    RetentionPlan,
    apply_retention,
    plan_retention,
    referenced_steps,
)
from moc.checkpoint.store.steps import (
    MANIFEST,
    begin_step,
    commit_step,
    complete_steps,
    rank_file,
    step_dir,
)

# -- plan_retention ------------------------------------------------------------------

# The example of the task: 50 still holds an expert last saved at 30, 40 one last saved
# at 20; 10 is needed by nobody.
PARTIAL_HISTORY = {10: {10}, 20: {20}, 30: {30}, 40: {20, 40}, 50: {30, 50}}

# A PEC chain with interval 3: each manifest references the steps its predecessor does,
# less the ones whose experts were all saved again since.
PEC_CHAIN = {3: {3}, 6: {3, 6}, 9: {3, 6, 9}, 12: {6, 9, 12}, 15: {9, 12, 15},
             18: {9, 12, 15, 18}}


def test_a_kept_step_keeps_every_step_it_references():
    manifests = {10: {10}, 20: {20}, 30: {30}, 40: {10, 20, 30, 40}}
    assert plan_retention(manifests, keep_last=1) == RetentionPlan(
        keep=(10, 20, 30, 40), delete=(), demote=(10, 20, 30))


def test_references_of_demoted_steps_are_not_followed():
    # 18 reads 9, 12 and 15; 9 once read 3 and 6, but 9 is no longer restorable.
    assert plan_retention(PEC_CHAIN, keep_last=1) == RetentionPlan(
        keep=(9, 12, 15, 18), delete=(3, 6), demote=(9, 12, 15))


def test_every_restorable_step_keeps_what_it_references():
    plan = plan_retention(PARTIAL_HISTORY, keep_last=2)
    assert plan == RetentionPlan(keep=(20, 30, 40, 50), delete=(10,), demote=(20, 30))


def test_a_referenced_step_is_kept_only_as_data():
    # 30 is kept only because 50 reads it; 30's own reference to 10 no longer counts.
    manifests = {10: {10}, 20: {20}, 30: {10, 30}, 40: {40}, 50: {30, 50}}
    assert plan_retention(manifests, keep_last=1) == RetentionPlan(
        keep=(30, 50), delete=(10, 20, 40), demote=(30,))


def test_data_only_steps_are_kept_while_referenced_and_deleted_after():
    plan = plan_retention({15: {9, 12, 15}, 18: {12, 15, 18}}, keep_last=1,
                          data_only={9, 12})
    assert plan == RetentionPlan(keep=(12, 15, 18), delete=(9,), demote=(15,))


def test_keep_last_beyond_the_history_keeps_everything():
    assert plan_retention(PARTIAL_HISTORY, keep_last=9) == RetentionPlan(
        keep=(10, 20, 30, 40, 50), delete=())
    assert plan_retention({}, keep_last=1) == RetentionPlan(keep=(), delete=())


@pytest.mark.parametrize("keep_last", [0, -3])
def test_keep_last_below_one_is_rejected_naming_it(keep_last):
    with pytest.raises(ValueError, match=rf"keep_last must be >= 1.*got {keep_last}"):
        plan_retention(PARTIAL_HISTORY, keep_last)


def test_a_restorable_unreadable_step_leaves_every_older_step_as_it_is():
    manifests = {10: {10}, 20: {20}, 30: None, 40: {40}}
    assert plan_retention(manifests, keep_last=2, data_only={5}) == RetentionPlan(
        keep=(5, 10, 20, 30, 40), delete=())


def test_an_unreadable_step_no_restorable_step_needs_is_deleted():
    manifests = {10: None, 20: {20}, 30: {30}}
    assert plan_retention(manifests, keep_last=1) == RetentionPlan(keep=(30,),
                                                                   delete=(10, 20))


def test_an_unreadable_step_no_longer_restorable_is_demoted_like_any_other():
    manifests = {10: {10}, 20: None, 30: {20, 30}}
    assert plan_retention(manifests, keep_last=1) == RetentionPlan(
        keep=(20, 30), delete=(10,), demote=(20,))


def test_references_to_absent_steps_are_reported_as_missing():
    plan = plan_retention({20: {20}, 30: {5, 30}}, keep_last=1)
    assert plan == RetentionPlan(keep=(30,), delete=(20,), missing=(5,))


def test_referenced_steps_include_the_manifest_own_step():
    entries = {"a": Entry(10, "r.safetensors", "F32", (1,), 0),
               "b": Entry(30, "r.safetensors", "F32", (1,), 0)}
    m = Manifest(step=40, mode="pec", layout={}, model={}, entries=entries)
    assert referenced_steps(m) == {10, 30, 40}


@st.composite
def histories(draw: st.DrawFn, unreadable: bool
              ) -> tuple[dict[int, set[int] | None], set[int]]:
    """Random step directories: complete steps referencing themselves and older steps
    (None: an unreadable manifest), and steps demoted earlier (data only)."""
    n = draw(st.integers(1, 10))
    steps = [10 * (i + 1) for i in range(n)]
    manifests: dict[int, set[int] | None] = {}
    data_only: set[int] = set()
    for i, step in enumerate(steps):
        kind = draw(st.integers(0, 5))
        if kind == 0 and i < n - 1:
            data_only.add(step)
        elif unreadable and kind == 1:
            manifests[step] = None
        else:
            manifests[step] = {step} | draw(st.sets(st.sampled_from(steps[:i]))
                                            if i else st.just(set()))
    return manifests, data_only


def _check_plan(manifests: dict[int, set[int] | None], data_only: set[int],
                keep_last: int) -> None:
    plan = plan_retention(manifests, keep_last, data_only)
    keep, delete, demote = set(plan.keep), set(plan.delete), set(plan.demote)
    for field in (plan.keep, plan.delete, plan.demote):
        assert list(field) == sorted(field)
    existing = set(manifests) | data_only
    assert keep | delete == existing and not keep & delete
    assert demote <= keep - data_only
    restorable = set(sorted(manifests)[-keep_last:])
    assert restorable <= keep and not restorable & demote
    readable = {s for s in restorable if manifests[s] is not None}
    referenced = set().union(*(manifests[s] for s in readable))
    assert set(plan.missing) == referenced - existing
    assert referenced & existing <= keep, "a restorable manifest would lose its data"
    unreadable = [s for s in restorable if manifests[s] is None]
    frozen = {s for s in existing if s <= max(unreadable)} if unreadable else set()
    assert not frozen & (delete | demote), "a fallback behind an unreadable step changed"
    assert keep <= restorable | referenced | frozen, \
        f"kept without need: {sorted(keep - restorable - referenced - frozen)}"
    # Afterwards the complete steps are exactly the restorable ones, plus the fallbacks
    # an unreadable restorable manifest holds.
    assert set(manifests) - delete - demote == restorable | (frozen & set(manifests))


@given(histories(unreadable=False), st.integers(1, 12))
def test_restorable_steps_keep_their_data_and_nothing_else_is_kept(history, keep_last):
    _check_plan(*history, keep_last)


@given(histories(unreadable=True), st.integers(1, 12))
def test_unreadable_manifests_never_cost_a_restorable_step_its_data(history, keep_last):
    _check_plan(*history, keep_last)


# -- apply_retention on real directories ---------------------------------------------


def _value(step: int) -> torch.Tensor:
    return torch.full((3,), float(step))


def _save(root: Path, step: int, refs: set[int]) -> None:
    """Commit `step`, writing key `k/<step>` and pointing at `k/<r>` of each older step r,
    as a partial checkpoint points at experts it did not save."""
    tmp = begin_step(root, step)
    name = rank_file(0)
    records = write_safetensors(tmp / name, {f"k/{step}": _value(step)})
    entries = {k: Entry(step, name, r.dtype, r.shape, r.crc) for k, r in records.items()}
    for old in refs - {step}:  # where _save(root, old, ...) wrote it, demoted or not
        entries[f"k/{old}"] = Entry(old, name, "F32", (3,), tensor_checksum(_value(old)))
    manifest = Manifest(step=step, mode="pec", layout={"world_size": 1, "ep": 1},
                        model={"d_model": 8}, entries=entries)
    commit_step(root, step, manifest.to_json())


def _save_history(root: Path, history: dict[int, set[int]]) -> None:
    for step in sorted(history):
        _save(root, step, history[step])


def _assert_restorable(root: Path, step: int) -> None:
    """Read every key of `step`'s manifest as recovery does, checksums and values."""
    manifest = Manifest.load(root, step)
    reader = CheckpointReader(root, manifest)
    for key in manifest.entries:
        assert torch.equal(reader.get(key), _value(int(key.removeprefix("k/")))), key


def _dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def _names(root: Path, steps: list[int]) -> list[str]:
    return sorted(step_dir(root, s).name for s in steps)


def test_apply_retention_demotes_data_and_deletes_what_no_restorable_step_reads(tmp_path):
    _save_history(tmp_path, PEC_CHAIN)
    assert apply_retention(tmp_path, keep_last=1) == [3, 6]
    assert complete_steps(tmp_path) == [18]
    _assert_restorable(tmp_path, 18)
    assert _dirs(tmp_path) == _names(tmp_path, [9, 12, 15, 18])
    for step in (9, 12, 15):
        d = step_dir(tmp_path, step)
        assert (d / SUPERSEDED).is_file() and not (d / MANIFEST).exists()
        assert Manifest.from_json((d / SUPERSEDED).read_text(), str(d)).step == step
    assert apply_retention(tmp_path, keep_last=1) == []
    assert _dirs(tmp_path) == _names(tmp_path, [9, 12, 15, 18])
    # Step 21 holds a fresh copy of everything 9 held: 9 is needed by nobody now.
    _save(tmp_path, 21, {12, 15, 18, 21})
    assert apply_retention(tmp_path, keep_last=1) == [9]
    assert complete_steps(tmp_path) == [21]
    _assert_restorable(tmp_path, 21)
    assert _dirs(tmp_path) == _names(tmp_path, [12, 15, 18, 21])
    assert (step_dir(tmp_path, 18) / SUPERSEDED).is_file()


def test_apply_retention_keeps_the_newest_steps_restorable(tmp_path):
    _save_history(tmp_path, PARTIAL_HISTORY)
    assert apply_retention(tmp_path, keep_last=2) == [10]
    assert complete_steps(tmp_path) == [40, 50]
    for step in (40, 50):
        _assert_restorable(tmp_path, step)
    assert _dirs(tmp_path) == _names(tmp_path, [20, 30, 40, 50])


def test_directories_storage_owns_or_nobody_wrote_are_left_alone(tmp_path, caplog):
    _save_history(tmp_path, {10: {10}, 20: {20}})
    others = ["step-00000030.tmp", "step-00000005.replaced", "step-00000015.corrupt",
              "step-00000001"]  # the last: neither manifest; not ours to judge
    for name in others:
        (tmp_path / name).mkdir()
        (tmp_path / name / "rank-00000.safetensors").write_bytes(b"x")
    with caplog.at_level(logging.WARNING, logger=retention.__name__):
        assert apply_retention(tmp_path, keep_last=1) == [10]
    assert _dirs(tmp_path) == sorted([*others, step_dir(tmp_path, 20).name])
    (warning,) = [r.getMessage() for r in caplog.records if "neither" in r.getMessage()]
    assert warning.endswith(": 1")


def test_a_corrupt_newest_manifest_leaves_every_older_step_restorable(tmp_path):
    _save_history(tmp_path, {10: {10}, 20: {20}, 30: {10, 30}, 40: {40}})
    (step_dir(tmp_path, 40) / MANIFEST).write_text("{not json")
    assert apply_retention(tmp_path, keep_last=1) == []
    assert complete_steps(tmp_path) == [10, 20, 30, 40]
    for step in (10, 20, 30):  # recovery falls back to 30, which reads 10
        _assert_restorable(tmp_path, step)


def test_a_corrupt_step_no_restorable_step_reads_is_deleted(tmp_path):
    _save_history(tmp_path, {10: {10}, 20: {20}, 30: {30}, 40: {20, 40}})
    (step_dir(tmp_path, 30) / MANIFEST).write_text("{not json")
    assert apply_retention(tmp_path, keep_last=1) == [10, 30]
    assert complete_steps(tmp_path) == [40]
    _assert_restorable(tmp_path, 40)
    assert _dirs(tmp_path) == _names(tmp_path, [20, 40])


def test_a_deletion_interrupted_by_a_crash_is_finished_and_never_read(tmp_path):
    _save_history(tmp_path, {10: {10}, 20: {20}})
    # A crash after the rename: files partly gone, the manifest still there.
    leftover = tmp_path / "step-00000010.deleting"
    step_dir(tmp_path, 10).rename(leftover)
    next(leftover.glob("*.safetensors")).unlink()
    assert complete_steps(tmp_path) == [20]
    # Step 10 was re-committed since (training resumed from an older step).
    _save(tmp_path, 10, {10})
    assert apply_retention(tmp_path, keep_last=1) == [10]
    assert _dirs(tmp_path) == [step_dir(tmp_path, 20).name]


def test_apply_retention_on_a_missing_root_does_nothing(tmp_path):
    assert apply_retention(tmp_path / "none", keep_last=1) == []


@st.composite
def chains(draw: st.DrawFn) -> list[set[int]]:
    """References of consecutive PEC saves: each reads its own step and some of the
    steps its predecessor read (the experts it did not save again)."""
    n = draw(st.integers(1, 8))
    refs: list[set[int]] = []
    for i in range(n):
        older = draw(st.sets(st.sampled_from(sorted(refs[-1])))) if refs else set()
        refs.append({i + 1} | older)
    return refs


@settings(max_examples=25, deadline=None)  # real files, fsynced
@given(chains(), st.integers(1, 4))
def test_after_every_retention_restorable_steps_read_intact_and_nothing_else_survives(
        chain, keep_last):
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        for step, refs in enumerate(chain, start=1):
            _save(root, step, refs)
            apply_retention(root, keep_last)
            restorable = list(range(max(1, step - keep_last + 1), step + 1))
            assert complete_steps(root) == restorable
            needed = set(restorable).union(*(chain[s - 1] for s in restorable))
            for s in restorable:  # on disk, not only in the plan
                _assert_restorable(root, s)
            assert _dirs(root) == _names(root, sorted(needed))
            for s in needed - set(restorable):
                assert (step_dir(root, s) / SUPERSEDED).is_file()


# -- BackgroundRetention -------------------------------------------------------------


def test_background_retention_deletes_without_blocking_and_coalesces(tmp_path, monkeypatch):
    release = threading.Event()
    calls = []

    def slow_apply(root: Path, keep_last: int) -> list[int]:
        calls.append(root)
        if len(calls) == 1:
            assert release.wait(timeout=30)
        return [len(calls)]

    monkeypatch.setattr(retention, "apply_retention", slow_apply)
    bg = BackgroundRetention(tmp_path, keep_last=1)
    bg.request()  # returns while the first run is stalled
    bg.request()
    bg.request()
    release.set()
    bg.close()
    assert len(calls) == 2  # the requests made during the first run ran once, after it
    assert bg.deleted == [1, 2]


def test_background_retention_deletes_real_steps(tmp_path):
    _save_history(tmp_path, PARTIAL_HISTORY)
    bg = BackgroundRetention(tmp_path, keep_last=2)
    bg.request()
    bg.close()
    assert bg.deleted == [10]
    assert complete_steps(tmp_path) == [40, 50]


def _fail_rmtree_once(monkeypatch: pytest.MonkeyPatch) -> None:
    real = shutil.rmtree
    failed = []

    def rmtree(path, *args, **kwargs):
        if not failed:
            failed.append(path)
            raise OSError(5, "Input/output error", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(retention.shutil, "rmtree", rmtree)


def test_a_background_error_is_raised_once_by_the_next_request(tmp_path, monkeypatch):
    _save_history(tmp_path, PARTIAL_HISTORY)
    _fail_rmtree_once(monkeypatch)
    bg = BackgroundRetention(tmp_path, keep_last=2)
    bg.request()
    bg.wait()
    with pytest.raises(CheckpointError, match=re.escape(str(tmp_path))) as info:
        bg.request()
    assert isinstance(info.value.__cause__, OSError)
    # Reported once; the retry finishes the interrupted deletion.
    bg.request()
    bg.close()
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".deleting")] == []
    assert complete_steps(tmp_path) == [40, 50]


def test_a_background_error_is_raised_once_by_close(tmp_path, monkeypatch):
    _save_history(tmp_path, PARTIAL_HISTORY)
    _fail_rmtree_once(monkeypatch)
    bg = BackgroundRetention(tmp_path, keep_last=2)
    bg.request()
    with pytest.raises(CheckpointError, match=r"deleting old checkpoints in .* failed"):
        bg.close()
    bg.close()
    # Demoted before any deletion began; step 10 was renamed away before its files.
    assert complete_steps(tmp_path) == [40, 50]


def test_background_retention_rejects_keep_last_below_one(tmp_path):
    with pytest.raises(ValueError, match="keep_last"):
        BackgroundRetention(tmp_path, keep_last=0)
