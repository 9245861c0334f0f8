"""How and where bytes land: safetensors files, checksums, fsync, atomic commit.

Layout under a checkpoint root:

    step-00000120/              complete: manifest.json exists (written last)
        rank-00003.safetensors
        manifest.json
    step-00000130.tmp/          being written or abandoned: never read

A step is committed by writing every file into `step-N.tmp/`, fsyncing them, writing
and fsyncing the manifest, then renaming the directory (atomic on POSIX) and fsyncing
the root. A crash at any point leaves either the complete step or a `.tmp` directory.

Files are written by `write_safetensors` rather than `safetensors.torch.save_file`: it
streams each tensor's bytes straight from memory (views into one storage are fine, no
copy), computes the CRC32 of each tensor on the way, and fsyncs. The result is a
standard safetensors file; loading goes through the safetensors library itself.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from moc.checkpoint.errors import CorruptCheckpointError

MANIFEST = "manifest.json"
_STEP_RE = re.compile(r"^step-(\d{8})$")

_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
_ALIGN = 8
"""safetensors pads its JSON header so the data section starts 8-byte aligned."""


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def tmp_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}.tmp"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


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
        if t.dtype not in _DTYPES:
            raise ValueError(f"cannot checkpoint {key!r}: dtype {t.dtype} is not supported")
        nbytes = t.numel() * t.element_size()
        header[key] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                       "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % _ALIGN)
    records = {}
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for key, t in tensors.items():
            data = tensor_bytes(t.cpu())
            f.write(data)
            crc = crcs[key] if crcs is not None else zlib.crc32(data)
            records[key] = TensorRecord(_DTYPES[t.dtype], tuple(t.shape), crc)
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


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def begin_step(root: Path, step: int) -> Path:
    """Create an empty `step-N.tmp/` (discarding an abandoned one) and return it."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = tmp_dir(root, step)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def commit_step(root: Path, step: int, manifest_json: str) -> Path:
    """Write the manifest into `step-N.tmp/` and atomically publish the step.

    Never overwrites the only good copy: a complete step of the same number (a step
    re-done after recovering from an older one) is moved aside first and deleted only
    after the new one is in place.
    """
    root = Path(root)
    tmp, final = tmp_dir(root, step), step_dir(root, step)
    path = tmp / MANIFEST
    with open(path, "w") as f:
        f.write(manifest_json)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)
    old = None
    if final.exists():
        old = root / f"{final.name}.replaced"
        if old.exists():
            shutil.rmtree(old)
        final.rename(old)
    tmp.rename(final)
    fsync_dir(root)
    if old is not None:
        shutil.rmtree(old)
    return final


def complete_steps(root: Path) -> list[int]:
    """Steps with a manifest, oldest first. Directories without one are never read."""
    root = Path(root)
    if not root.is_dir():
        return []
    steps = []
    for d in root.iterdir():
        m = _STEP_RE.match(d.name)
        if m and (d / MANIFEST).is_file():
            steps.append(int(m.group(1)))
    return sorted(steps)


def remove_abandoned(root: Path) -> list[Path]:
    """Delete `.tmp` directories left by an interrupted save.

    A `.replaced` directory is the previous copy of a step that was being re-committed;
    if the crash came before the new copy took its name, it is the only good copy and is
    put back instead of deleted.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    removed = []
    for d in sorted(root.iterdir()):
        if not (d.is_dir() and d.name.startswith("step-")):
            continue
        if d.name.endswith(".replaced"):
            final = root / d.name.removesuffix(".replaced")
            if not (final / MANIFEST).is_file():
                if final.exists():
                    shutil.rmtree(final)
                d.rename(final)
                continue
        elif not d.name.endswith(".tmp"):
            continue
        shutil.rmtree(d)
        removed.append(d)
    return removed


def set_aside(root: Path, step: int, reason: str) -> Path:
    """Rename a complete step that failed verification to `step-N.corrupt`.

    Kept for inspection rather than deleted, and out of the way: it is never read again,
    retention does not count it among the newest steps, and the step number can be
    committed anew by the run that continues from an older step.
    """
    src = step_dir(root, step)
    dst = Path(root) / f"{src.name}.corrupt"
    if dst.exists():
        shutil.rmtree(dst)
    src.rename(dst)
    (dst / "CORRUPT.txt").write_text(reason + "\n")
    fsync_dir(Path(root))
    return dst
