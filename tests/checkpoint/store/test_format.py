"""Tensor files: standard safetensors, every tensor checked against its CRC32."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from moc.checkpoint.errors import CorruptCheckpointError
from moc.checkpoint.store.format import TensorReader, write_safetensors


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
    assert torch.equal(reader.read("a", records["a"]), base[1])


def test_flipped_byte_is_detected_and_named(tmp_path):
    path = tmp_path / "f.safetensors"
    records = write_safetensors(path, {"w": torch.randn(100)})
    raw = bytearray(path.read_bytes())
    raw[-10] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match=r"f\.safetensors.*'w'"):
        TensorReader(path).read("w", records["w"])


def test_truncated_file_is_detected(tmp_path):
    path = tmp_path / "f.safetensors"
    records = write_safetensors(path, {"w": torch.randn(100)})
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(CorruptCheckpointError, match=r"f\.safetensors"):
        TensorReader(path).read("w", records["w"])
