"""Tensor files: standard safetensors, every tensor checked against its CRC32C."""

from __future__ import annotations

import errno
import os

import pytest
import torch
from safetensors.torch import load_file

from moc.checkpoint.errors import CorruptCheckpointError
from moc.checkpoint.phases import Phases
from moc.checkpoint.store.format import (
    DirectWriter,
    TensorReader,
    TensorRecord,
    tensor_checksum,
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


def test_write_all_writes_every_byte_in_order_through_short_writes(tmp_path, monkeypatch):
    """The kernel may take fewer bytes than a writev offers (a signal, a full pipe, a
    quota): the rest, from the middle of a buffer, must follow, in order."""
    from moc.checkpoint.store import disk
    from moc.checkpoint.store import format as fmt

    real = os.writev

    def short(fd, buffers):  # the real call, offered at most 7 bytes at a time
        first = bytes(buffers[0])[:7]
        return real(fd, [first])

    monkeypatch.setattr(fmt.os, "writev", short)
    monkeypatch.setattr(disk, "WRITE_BUFFERS", 3)  # where write_all reads it
    chunks = [b"header", memoryview(bytes(range(50))), b"", b"x" * 23, memoryview(b"tail")]
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    fmt.write_all(fd, chunks)
    os.close(fd)
    assert path.read_bytes() == b"".join(bytes(c) for c in chunks)


def test_a_tensor_file_records_xxh3_and_its_phases(tmp_path):
    phases = Phases()
    tensors = {"a": torch.randn(100), "b": torch.arange(5)}
    records = write_safetensors(tmp_path / "t.safetensors", tensors, phases=phases)
    assert {r.algo for r in records.values()} == {"xxh3"}
    assert records["a"].crc == tensor_checksum(tensors["a"])
    assert {"write", "fsync"} <= set(phases.wall)
    reader = TensorReader(tmp_path / "t.safetensors")
    assert torch.equal(reader.read("a", records["a"]), tensors["a"])
    for other in ("crc32c", "crc32"):  # the same value under another algorithm: no match
        wrong = TensorRecord(records["a"].dtype, records["a"].shape, records["a"].crc, other)
        with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
            reader.read("a", wrong)


@pytest.mark.parametrize("size", [0, 5, 4096, (8 << 20) + 13])
def test_a_file_written_with_o_direct_is_the_same_file(tmp_path, size):
    """Through the aligned buffer, in whole blocks, truncated to its length: byte for
    byte the buffered file (sizes below, at and across a block and a buffer's CHUNK)."""
    tensors = {"a": torch.arange(size, dtype=torch.uint8), "b": torch.randn(3)}
    buffered = write_safetensors(tmp_path / "b.safetensors", tensors)
    direct = DirectWriter()
    records = write_safetensors(tmp_path / "d.safetensors", tensors, direct=direct)
    assert records == buffered
    assert (tmp_path / "d.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()


def test_a_file_system_without_o_direct_is_written_buffered(monkeypatch, tmp_path):
    """tmpfs and some network file systems refuse O_DIRECT (EINVAL at open): the file is
    written the buffered way, and O_DIRECT is not tried again."""
    real_open = os.open

    def refuse(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    from moc.checkpoint.store import format as fmt

    monkeypatch.setattr(fmt.os, "open", refuse)
    direct = DirectWriter()
    tensors = {"a": torch.randn(10)}
    records = write_safetensors(tmp_path / "f.safetensors", tensors, direct=direct)
    assert not direct.supported
    assert torch.equal(TensorReader(tmp_path / "f.safetensors").read("a", records["a"]),
                       tensors["a"])
