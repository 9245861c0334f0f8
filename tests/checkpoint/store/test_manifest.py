"""The manifest: what a step says about itself, validated on load."""

from __future__ import annotations

import json

import pytest

from moc.checkpoint.errors import CorruptCheckpointError, IncompatibleCheckpointError
from moc.checkpoint.store.manifest import (
    FORMAT_VERSION,
    MAX_DIFFS_SHOWN,
    Entry,
    Manifest,
    check_model,
    differences,
)
from moc.checkpoint.store.steps import MANIFEST, begin_step, commit_step, step_dir


def _manifest_json(**changes) -> str:
    m = Manifest(step=3, mode="blocking", layout={"world_size": 1, "ep": 1},
                 model={"d_model": 8}, entries={"param/x": Entry(3, "rank-00000.safetensors", "F32",
                                                                 (2,), 123)})
    d = json.loads(m.to_json())
    d.update(changes)
    return json.dumps({k: v for k, v in d.items() if v is not None})


def test_manifest_round_trips():
    m = Manifest.from_json(_manifest_json(), "m")
    assert m.entries["param/x"] == Entry(3, "rank-00000.safetensors", "F32", (2,), 123)


@pytest.mark.parametrize(("text", "error", "match"), [
    ("{not json", CorruptCheckpointError, "not valid JSON"),
    (_manifest_json(version=FORMAT_VERSION + 1), IncompatibleCheckpointError, "format version"),
    (_manifest_json(entries=None), CorruptCheckpointError, "lacks entries"),
    (_manifest_json(entries={"k": {"step": 1}}), CorruptCheckpointError, "malformed"),
    (_manifest_json(format="other"), CorruptCheckpointError, "not a moc manifest"),
])
def test_malformed_manifests_raise_clear_errors(text, error, match):
    with pytest.raises(error, match=match):
        Manifest.from_json(text, "m")


def test_model_mismatch_names_each_differing_field():
    m = Manifest.from_json(_manifest_json(), "ckpt")
    with pytest.raises(IncompatibleCheckpointError, match="d_model: checkpoint 8 vs now 16"):
        m.check_model({"d_model": 16}, "ckpt")


def test_a_manifest_in_the_wrong_directory_or_missing_is_corrupt(tmp_path):
    m = Manifest.from_json(_manifest_json(), "m")
    begin_step(tmp_path, 3)
    commit_step(tmp_path, 3, m.to_json())
    assert Manifest.load(tmp_path, 3) == m
    (tmp_path / "step-00000004").mkdir()
    (step_dir(tmp_path, 3) / MANIFEST).rename(step_dir(tmp_path, 4) / MANIFEST)
    with pytest.raises(CorruptCheckpointError, match="manifest says step 3, directory says 4"):
        Manifest.load(tmp_path, 4)
    with pytest.raises(CorruptCheckpointError, match="cannot read manifest"):
        Manifest.load(tmp_path, 3)


def test_model_differences_name_the_first_few_and_count_the_rest():
    saved = {"dense": {f"p{i}": [8] for i in range(7)}, "n_experts": 4}
    now = {"dense": {f"p{i}": [16] for i in range(7)}, "n_experts": 4}
    assert differences(saved, now)[0] == "dense.p0: checkpoint [8] vs now [16]"
    with pytest.raises(IncompatibleCheckpointError, match=r"\(and 2 more\)") as info:
        check_model(saved, now, "ckpt")
    assert str(info.value).count("vs now") == MAX_DIFFS_SHOWN
    assert differences({"a": 1}, {"b": 1}) == ["a: checkpoint 1 vs now None",
                                               "b: checkpoint None vs now 1"]
    check_model(saved, saved, "ckpt")  # the same model: nothing raised
