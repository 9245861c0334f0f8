from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from moc.checkpoint.errors import CorruptCheckpointError, IncompatibleCheckpointError
from moc.checkpoint.manifest import FORMAT_VERSION, Entry, Manifest
from moc.checkpoint.storage import (
    TensorReader,
    begin_step,
    commit_step,
    complete_steps,
    remove_abandoned,
    step_dir,
    tmp_dir,
    write_safetensors,
)


def test_written_file_is_standard_safetensors_and_views_need_no_copy(tmp_path):
    base = torch.randn(4, 3, 5)
    tensors = {"a": base[1], "b": base[2], "bf16": torch.randn(7).bfloat16(),
               "scalar": torch.tensor(3.0), "ints": torch.arange(6), "empty": torch.zeros(0)}
    records = write_safetensors(tmp_path / "f.safetensors", tensors)
    loaded = load_file(tmp_path / "f.safetensors")
    assert set(loaded) == set(tensors)
    for k, t in tensors.items():
        assert torch.equal(loaded[k], t), k
    reader = TensorReader(tmp_path / "f.safetensors")
    assert torch.equal(reader.read("a", records["a"].crc32), base[1])


def test_flipped_byte_is_detected_and_named(tmp_path):
    path = tmp_path / "f.safetensors"
    records = write_safetensors(path, {"w": torch.randn(100)})
    raw = bytearray(path.read_bytes())
    raw[-10] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match=r"f\.safetensors.*'w'"):
        TensorReader(path).read("w", records["w"].crc32)


def test_truncated_file_is_detected(tmp_path):
    path = tmp_path / "f.safetensors"
    write_safetensors(path, {"w": torch.randn(100)})
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(CorruptCheckpointError, match=r"f\.safetensors"):
        TensorReader(path).read("w", 0)


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


def _manifest_json(**changes) -> str:
    m = Manifest(step=3, mode="blocking", layout={"world_size": 1, "ep": 1},
                 model={"d_model": 8}, entries={"param/x": Entry(3, "r.safetensors", "F32",
                                                                 (2,), 123)})
    d = json.loads(m.to_json())
    d.update(changes)
    return json.dumps({k: v for k, v in d.items() if v is not None})


def test_manifest_round_trips():
    m = Manifest.from_json(_manifest_json(), "m")
    assert m.entries["param/x"] == Entry(3, "r.safetensors", "F32", (2,), 123)


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
