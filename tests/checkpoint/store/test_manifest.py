"""The manifest: what a step says about itself, validated on load."""

from __future__ import annotations

import json

import pytest

from moc.checkpoint.errors import CorruptCheckpointError, IncompatibleCheckpointError
from moc.checkpoint.store.manifest import (
    MAX_DIFFS_SHOWN,
    READABLE_VERSIONS,
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
    (_manifest_json(version=max(READABLE_VERSIONS) + 1), IncompatibleCheckpointError,
     "format version"),
    (_manifest_json(entries=None), CorruptCheckpointError, "lacks entries"),
    (_manifest_json(entries={"k": {"step": 1}}), CorruptCheckpointError, "malformed"),
    (_manifest_json(format="other"), CorruptCheckpointError, "not a moc manifest"),
])
def test_malformed_manifests_raise_clear_errors(text, error, match):
    with pytest.raises(error, match=match):
        Manifest.from_json(text, "m")


def _entry_json(step: int = 3, **changes) -> dict:
    return {**Entry(step, "rank-00000.safetensors", "F32", (2, 4), 123).to_dict(), **changes}


def test_the_next_step_takes_unchanged_entries_from_the_known_manifest():
    known = Manifest.from_json(_manifest_json(entries={"param/x": _entry_json(),
                                                       "param/y": _entry_json()}), "m")
    text = _manifest_json(step=5, entries={"param/x": _entry_json(),  # carried over
                                           "param/y": _entry_json(step=5, xxh3=9)})
    fresh = Manifest.from_json(text, "m")
    m = Manifest.from_json(text, "m", known=known)
    assert m == fresh
    assert m.entries["param/x"] is known.entries["param/x"]  # not checked again
    assert m.entries["param/y"] == Entry(5, "rank-00000.safetensors", "F32", (2, 4), 9)


@pytest.mark.parametrize("changes", [
    {"step": True}, {"xxh3": 123.0}, {"shape": [2.0, 4]}, {"shape": [2, True]},
    {"shape": [2, 4, 1]}, {"dtype": "F99"}, {"file": "../x"}, {"extra": 1},
    {"xxh3": None, "crc32c": 123}, {"xxh3": None, "crc32": 123}, {"crc32c": 123},
])
def test_an_entry_that_differs_from_the_known_one_in_any_way_is_checked_again(changes):
    # Values that equal the known entry's in Python (JSON true == 1 == 1.0) but that a
    # fresh parse refuses must be refused too: the known manifest is no excuse.
    known = Manifest.from_json(_manifest_json(entries={"param/x": _entry_json(step=1)}),
                               "m")
    entry = {k: v for k, v in {**_entry_json(step=1), **changes}.items() if v is not None}
    text = _manifest_json(step=5, entries={"param/x": entry})
    try:
        fresh = Manifest.from_json(text, "m")
    except CorruptCheckpointError as e:
        with pytest.raises(CorruptCheckpointError, match="malformed") as got:
            Manifest.from_json(text, "m", known=known)
        assert str(got.value) == str(e)
    else:  # still well-formed (a CRC32C or CRC32 of the same value): its own entry
        m = Manifest.from_json(text, "m", known=known)
        assert m == fresh and m.entries["param/x"] is not known.entries["param/x"]


@pytest.mark.parametrize(("algo", "bits"), [("xxh3", 64), ("crc32c", 32), ("crc32", 32)])
def test_a_checksum_wider_than_its_algorithm_is_malformed(algo, bits):
    entry = {k: v for k, v in _entry_json().items() if k != "xxh3"}
    ok = Manifest.from_json(_manifest_json(entries={"param/x": {**entry, algo: 2**bits - 1}}),
                            "m")
    assert ok.entries["param/x"].crc == 2**bits - 1 and ok.entries["param/x"].algo == algo
    with pytest.raises(CorruptCheckpointError, match=f"below {2**bits}"):
        Manifest.from_json(_manifest_json(entries={"param/x": {**entry, algo: 2**bits}}), "m")


def test_a_known_entry_newer_than_the_step_is_not_taken():
    known = Manifest.from_json(_manifest_json(step=7, entries={
        "param/x": _entry_json(step=7)}), "m")
    with pytest.raises(CorruptCheckpointError, match="below 6"):
        Manifest.from_json(_manifest_json(step=5, entries={"param/x": _entry_json(step=7)}),
                           "m", known=known)


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
