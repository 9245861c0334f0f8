"""The bytes of a tensor file: safetensors written by moc, read by the safetensors library,
with a CRC32 of every tensor.

Files are written by `write_safetensors` rather than `safetensors.torch.save_file`: it
streams each tensor's bytes straight from memory (views into one storage are fine, no
copy), computes the CRC32 of each tensor on the way, and fsyncs. The result is a
standard safetensors file; loading goes through the safetensors library itself, so any
divergence from the format would fail the tests.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from moc.checkpoint.errors import CorruptCheckpointError

DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
"""torch dtype -> safetensors dtype name: the dtypes a checkpoint can hold."""
ALIGN = 8
"""safetensors pads its JSON header so the data section starts 8-byte aligned."""


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU tensor, without a copy when it is contiguous."""
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.contiguous().view(torch.uint8).numpy())


def crc32(t: torch.Tensor) -> int:
    return zlib.crc32(tensor_bytes(t))


@dataclass(frozen=True)
class TensorRecord:
    dtype: str
    shape: tuple[int, ...]
    crc32: int


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor],
                      metadata: dict[str, str] | None = None,
                      crcs: dict[str, int] | None = None) -> dict[str, TensorRecord]:
    """Write `tensors` (CPU) as one safetensors file, fsync it, return per-key records.
    `crcs`: checksums already known (taken with a snapshot), not computed again."""
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for key, t in tensors.items():
        if t.dtype not in DTYPES:
            raise ValueError(f"cannot checkpoint {key!r}: dtype {t.dtype} is not supported")
        nbytes = t.numel() * t.element_size()
        header[key] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape),
                       "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % ALIGN)
    records = {}
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for key, t in tensors.items():
            data = tensor_bytes(t.cpu())
            f.write(data)
            crc = crcs[key] if crcs is not None else zlib.crc32(data)
            records[key] = TensorRecord(DTYPES[t.dtype], tuple(t.shape), crc)
        f.flush()
        os.fsync(f.fileno())  # blocks until the bytes are on disk, not in the page cache
    return records


class TensorReader:
    """Reads tensors from one safetensors file and checks each against its checksum."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            self._file = safe_open(str(path), framework="pt")
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{path}: file is missing") from None
        except Exception as e:  # safetensors raises its own error types for bad headers
            raise CorruptCheckpointError(f"{path}: not a readable safetensors file ({e})"
                                         ) from None

    def read(self, key: str, expected_crc: int) -> torch.Tensor:
        try:
            t = self._file.get_tensor(key)
        except Exception as e:
            raise CorruptCheckpointError(f"{self.path}: cannot read key {key!r} ({e})") from None
        if crc32(t) != expected_crc:
            raise CorruptCheckpointError(
                f"{self.path}: checksum mismatch for key {key!r}; the file is corrupt")
        return t
