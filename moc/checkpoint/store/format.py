"""The bytes of a tensor file: standard safetensors, with a checksum of every tensor
that covers its dtype, shape and bytes.

Files are written by `write_safetensors` rather than `safetensors.torch.save_file`: it
streams each tensor's bytes straight from memory (views into one storage are fine, no
copy), computes the checksum of each tensor on the way (XXH3, below), and fsyncs. The
result is a standard safetensors file (the tests load them with the safetensors library).

Reading is `TensorReader`'s, not the safetensors library's: a checkpoint directory is
untrusted input, and the library maps the file and copies whatever range a header
declares before anything can be checked. This reader parses the header itself under
strict limits (its length, every tensor's declared size against its dtype and shape,
against the file, against the manifest) and only then reads exactly the tensor's own
bytes with `os.preadv`, so a tampered header costs an error message, not the memory
it declares.

Checksums (docs/FORMAT.md, "Checksums"): a manifest of format version 4 records

    checksum = XXH3_64(descriptor(dtype, shape), seed=XXH3_64(bytes))

the 64-bit XXH3 of the bytes, then of a canonical "dtype [shape]" descriptor seeded with
it. A change of dtype or shape (in the header and the manifest alike) fails it, and a
digest of the bytes taken earlier (the two-level snapshot takes them in shared memory,
while it copies) is extended without reading the bytes again (`checksum`). XXH3, not
CRC32C (version 3): the `xxhash` package runs it at 87 GB/s on bytes in cache here,
against 32 GB/s for the CPU's CRC32C instruction, and a snapshot every step hashes every
byte of the state while it copies it (fused copy + digest: 18.0 GB/s against 12.9, with
a memcpy at 21.9; docs/DECISIONS.md, issue 15). Both release the GIL. Entries that
version 3 (CRC32C, `algo` "crc32c") and version 2 (zlib's CRC32, "crc32") wrote are
read, and carried into new manifests, as they are. Version 1 recorded the CRC32 of the
bytes alone; `moc.checkpoint.store.manifest` converts those on load.

The system calls that put the bytes on a local disk (writev batches, O_DIRECT) are
`disk`'s, imported from here too.

Object stores (`store.backend.ObjectPath`): the same bytes are streamed into one object,
whose size is confirmed with the store after the upload; the reader makes the same
checks over ranged reads of the object instead of `preadv`.
"""

from __future__ import annotations

import json
import os
import stat
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
import xxhash

from moc.checkpoint.errors import CorruptCheckpointError
from moc.checkpoint.phases import Phases
from moc.checkpoint.store.backend import ObjectPath
from moc.checkpoint.store.disk import WRITE_BUFFERS as WRITE_BUFFERS
from moc.checkpoint.store.disk import WRITE_BYTES as WRITE_BYTES
from moc.checkpoint.store.disk import DirectWriter, write_all

DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
"""torch dtype -> safetensors dtype name: the dtypes a checkpoint can hold."""
TORCH_DTYPES = {name: dtype for dtype, name in DTYPES.items()}
ITEM_SIZES = {name: torch.empty((), dtype=dtype).element_size()
              for dtype, name in DTYPES.items()}
ALIGN = 8
"""safetensors pads its JSON header so the data section starts 8-byte aligned."""
MAX_HEADER_BYTES = 100 * 2**20
"""The largest JSON header read. safetensors itself refuses headers over 100 MB; a
header describes tensors, not holds them: a million keys take a few tens of MB."""
READ_CHUNK = 1 << 30
"""Bytes per `preadv` call: Linux transfers at most 2 GiB - 4 KiB in one."""


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU tensor, without a copy when it is contiguous."""
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.contiguous().view(torch.uint8).numpy())


XXH3 = "xxh3"
"""XXH3_64bits (seed 0): the checksum of everything moc writes (format version 4,
snapshots, replicas)."""
CRC32C = "crc32c"
"""CRC32C (Castagnoli): the checksums of format version 3, still read."""
CRC32 = "crc32"
"""zlib's CRC32: the checksums of format versions 1 and 2, still read."""
CHECKSUM = XXH3
"""The algorithm of every checksum moc writes."""
ALGORITHMS = (XXH3, CRC32C, CRC32)
BITS = {XXH3: 64, CRC32C: 32, CRC32: 32}
"""Width of each algorithm's values: a recorded value must be below 2**bits."""


class Digest:
    """The digest of bytes fed a piece at a time (`update`); the same value whatever the
    pieces (`digest` of them joined). XXH3 keeps a streaming state; the CRCs continue
    from their value."""

    __slots__ = ("_crc", "_xxh", "algo")

    def __init__(self, algo: str = CHECKSUM) -> None:
        if algo not in ALGORITHMS:
            raise ValueError(f"unknown checksum algorithm {algo!r}, expected one of "
                             f"{ALGORITHMS}")
        self.algo = algo
        self._xxh = xxhash.xxh3_64() if algo == XXH3 else None
        self._crc = 0

    def update(self, data: memoryview | bytes) -> None:
        if self._xxh is not None:
            self._xxh.update(data)
        elif self.algo == CRC32C:
            self._crc = _crc32c().crc32c(data, self._crc)
        else:
            self._crc = zlib.crc32(data, self._crc)

    @property
    def value(self) -> int:
        return self._xxh.intdigest() if self._xxh is not None else self._crc


def _crc32c() -> Any:
    """The `crc32c` package, imported when a format-3 checkpoint is read, not with moc:
    nothing moc writes needs it, and a machine without it (a lent GPU with only torch)
    must still import moc and take checkpoints. ImportError in one line when a
    checkpoint that needs it is read without it."""
    try:
        import crc32c
    except ImportError:
        raise ImportError("this checkpoint's checksums are CRC32C (format version 3, "
                          "written by moc before XXH3): reading it needs the crc32c "
                          "package (pip install crc32c)") from None
    return crc32c


def digest(data: memoryview | bytes, algo: str = CHECKSUM) -> int:
    """The digest of `data` by `algo`, in one call."""
    if algo == XXH3:
        return xxhash.xxh3_64_intdigest(data)
    d = Digest(algo)
    d.update(data)
    return d.value


def descriptor(dtype: str, shape: tuple[int, ...]) -> bytes:
    """The canonical "dtype [d0,d1,...]" a checksum covers after the bytes."""
    return f"{dtype} [{','.join(str(d) for d in shape)}]".encode()


def checksum(dtype: str, shape: tuple[int, ...], data_digest: int, algo: str = CHECKSUM
             ) -> int:
    """A tensor's checksum from the digest of its bytes alone (see the module doc): a
    CRC continued over the descriptor, or the XXH3 of the descriptor seeded with it."""
    if algo == XXH3:
        return xxhash.xxh3_64_intdigest(descriptor(dtype, shape), seed=data_digest)
    if algo == CRC32C:
        return _crc32c().crc32c(descriptor(dtype, shape), data_digest)
    if algo == CRC32:
        return zlib.crc32(descriptor(dtype, shape), data_digest)
    raise ValueError(f"unknown checksum algorithm {algo!r}, expected one of {ALGORITHMS}")


def tensor_checksum(t: torch.Tensor, algo: str = CHECKSUM) -> int:
    """The checksum of a CPU tensor (dtype, shape and bytes)."""
    return checksum(DTYPES[t.dtype], tuple(t.shape), digest(tensor_bytes(t), algo), algo)


@dataclass(frozen=True)
class TensorRecord:
    """What a manifest records of one tensor, and what a read must find."""

    dtype: str
    """safetensors dtype name (F32, BF16, ...)."""
    shape: tuple[int, ...]
    crc: int
    """The checksum (`checksum`): dtype, shape and bytes. (Named `crc` since version 1;
    by `algo` it is an XXH3 now.)"""
    algo: str = CHECKSUM
    """Which algorithm `crc` is: XXH3, or CRC32C / CRC32 for a tensor that format
    version 3 / 2 wrote."""


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor],
                      metadata: dict[str, str] | None = None,
                      crcs: dict[str, int] | None = None,
                      phases: Phases | None = None,
                      direct: DirectWriter | None = None) -> dict[str, TensorRecord]:
    """Write `tensors` (CPU) as one safetensors file, fsync it, return per-key records
    (with XXH3 checksums). `crcs`: digests (XXH3) of each tensor's bytes alone, already known
    (taken with a snapshot), extended over dtype and shape instead of being computed
    again: the bytes are then read once, by the write. `direct`: write a local file
    with O_DIRECT through its aligned buffer (`DirectWriter`). `phases` gets "write"
    and "fsync" (a local file) or "upload" (an object)."""
    phases = phases if phases is not None else Phases()
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
    records: dict[str, TensorRecord] = {}
    chunks: list[memoryview | bytes] = [struct.pack("<Q", len(blob)), blob]
    for key, t in tensors.items():
        data = tensor_bytes(t.cpu())
        chunks.append(data)
        data_digest = crcs[key] if crcs is not None else digest(data)
        dtype, shape = DTYPES[t.dtype], tuple(t.shape)
        records[key] = TensorRecord(dtype, shape, checksum(dtype, shape, data_digest))

    if isinstance(path, ObjectPath):
        with phases("upload"), path.open_write() as f:  # blocks until uploaded, confirmed
            for data in chunks:
                f.write(data)
        return records
    if direct is not None and direct.write(path, chunks, phases):
        return records
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
    try:
        with phases("write"):
            write_all(fd, chunks)
        with phases("fsync"):
            os.fsync(fd)  # blocks until the bytes are on disk, not in the page cache
    finally:
        os.close(fd)
    return records


@dataclass(frozen=True)
class _Declared:
    """One tensor as a file's header declares it, already checked for consistency."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    """Offset of the first byte from the start of the file."""
    nbytes: int


class TensorReader:
    """Reads tensors from one safetensors file of a checkpoint, checking each against
    what the manifest records (`TensorRecord`) before and after reading its bytes.

    Opening parses and checks the whole header (every error is CorruptCheckpointError
    naming the file); the file is kept open, so each `read` costs one `preadv` of
    exactly that tensor's bytes. A symbolic link is refused (O_NOFOLLOW): a checkpoint's
    files are its own.
    """

    def __init__(self, path: Path | ObjectPath) -> None:
        self._fd = -1
        self._object: IO[bytes] | None = None
        if isinstance(path, ObjectPath):
            self.path: Path | ObjectPath = path
            try:
                self._object = path.open_read()
            except FileNotFoundError:
                raise CorruptCheckpointError(f"{path}: object is missing") from None
            except OSError as e:
                raise CorruptCheckpointError(f"{path}: cannot open ({e})") from None
            try:
                self._tensors = self._parse_header()
            except BaseException:
                self.close()
                raise
            return
        self.path = Path(path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{path}: file is missing") from None
        except OSError as e:
            if os.path.islink(self.path):
                raise CorruptCheckpointError(
                    f"{path}: is a symbolic link (to {os.readlink(self.path)}); a "
                    "checkpoint's tensor files must be real files inside its step "
                    "directory") from None
            raise CorruptCheckpointError(f"{path}: cannot open ({e.strerror})") from None
        try:
            self._tensors = self._parse_header()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        obj, self._object = getattr(self, "_object", None), None
        if obj is not None:
            obj.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        self.close()

    def _corrupt(self, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self.path}: {what}; the file is corrupt or not a "
                                      "safetensors file written by moc")

    def _pread(self, n: int, offset: int) -> bytes:
        data = (self._object_read(n, offset) if self._object is not None
                else os.pread(self._fd, n, offset))
        if len(data) != n:
            raise self._corrupt(f"ends at byte {offset + len(data)}, {n} bytes expected "
                                f"from byte {offset}")
        return data

    def _object_read(self, n: int, offset: int) -> bytes:
        assert self._object is not None
        try:
            self._object.seek(offset)
            return self._object.read(n)
        except OSError as e:
            raise CorruptCheckpointError(f"{self.path}: cannot read ({e})") from None
        except Exception as e:  # the client's own errors (connection, ...): never lost
            raise CorruptCheckpointError(f"{self.path}: cannot read ({type(e).__name__}: "
                                         f"{e})") from None

    def _parse_header(self) -> dict[str, _Declared]:
        if self._object is not None:
            size = int(self._object.size)  # type: ignore[attr-defined]
        else:
            st = os.fstat(self._fd)
            if not stat.S_ISREG(st.st_mode):
                raise self._corrupt("not a regular file")
            size = st.st_size
        if size < 8:
            raise self._corrupt(f"{size} bytes, shorter than a safetensors header length")
        (n,) = struct.unpack("<Q", self._pread(8, 0))
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise self._corrupt(f"header length {n} exceeds the file ({size} bytes) or "
                                f"the limit of {MAX_HEADER_BYTES} bytes")
        try:
            header = json.loads(self._pread(n, 8), object_pairs_hook=no_duplicate_keys)
        except (ValueError, UnicodeDecodeError) as e:
            raise self._corrupt(f"header is not valid JSON ({e})") from None
        if not isinstance(header, dict):
            raise self._corrupt("header is not a JSON object")
        start, data_size = 8 + n, size - 8 - n
        spans: list[tuple[int, int, str]] = []
        out: dict[str, _Declared] = {}
        for key, d in header.items():
            if key == "__metadata__":
                if not (isinstance(d, dict) and all(isinstance(v, str) for v in d.values())):
                    raise self._corrupt("__metadata__ is not a map of strings")
                continue
            out[key] = self._declared(key, d, start, data_size)
            spans.append((out[key].begin - start, out[key].begin - start + out[key].nbytes,
                          key))
        # As the safetensors library requires: the tensors tile the data section, in
        # order, with neither gaps nor overlaps.
        at = 0
        for begin, end, key in sorted(spans):
            if begin != at:
                raise self._corrupt(f"tensor {key!r} starts at data byte {begin}, expected "
                                    f"{at} (tensors overlap or leave a gap)")
            at = end
        if at != data_size:
            raise self._corrupt(f"the tensors cover {at} bytes of a {data_size}-byte data "
                                "section")
        return out

    def _declared(self, key: str, d: Any, start: int, data_size: int) -> _Declared:
        if not isinstance(d, dict) or set(d) != {"dtype", "shape", "data_offsets"}:
            raise self._corrupt(f"header entry of {key!r} is not {{dtype, shape, "
                                "data_offsets}")
        dtype, shape, offsets = d["dtype"], d["shape"], d["data_offsets"]
        if dtype not in ITEM_SIZES:
            raise self._corrupt(f"tensor {key!r} has dtype {dtype!r}, expected one of "
                                f"{', '.join(ITEM_SIZES)}")
        if not (isinstance(shape, list) and all(_is_uint(x) for x in shape)):
            raise self._corrupt(f"tensor {key!r} has shape {shape!r}, expected a list of "
                                "non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(_is_uint(x) for x in offsets) and offsets[0] <= offsets[1]):
            raise self._corrupt(f"tensor {key!r} has data_offsets {offsets!r}, expected "
                                "[begin, end] with 0 <= begin <= end")
        numel = 1
        for x in shape:
            numel *= x
        nbytes = numel * ITEM_SIZES[dtype]
        if offsets[1] - offsets[0] != nbytes:
            raise self._corrupt(f"tensor {key!r} is {dtype} {tuple(shape)} ({nbytes} bytes) "
                                f"but its data_offsets span {offsets[1] - offsets[0]}")
        if offsets[1] > data_size:
            raise self._corrupt(f"tensor {key!r} ends at data byte {offsets[1]}, beyond the "
                                f"{data_size}-byte data section")
        return _Declared(dtype, tuple(shape), start + offsets[0], nbytes)

    def read(self, key: str, expected: TensorRecord) -> torch.Tensor:
        """The tensor `key`, which must have the dtype, shape and checksum the manifest
        records (`expected`); CorruptCheckpointError naming the file and key otherwise.
        Dtype and shape are compared before any byte is read."""
        d = self._tensors.get(key)
        if d is None:
            raise CorruptCheckpointError(f"{self.path}: no key {key!r} in the file; the "
                                         "manifest says it is here")
        if (d.dtype, d.shape) != (expected.dtype, tuple(expected.shape)):
            raise CorruptCheckpointError(
                f"{self.path}: key {key!r} is {d.dtype} {d.shape} in the file's header, "
                f"the manifest records {expected.dtype} {tuple(expected.shape)}; the file "
                "or the manifest is corrupt")
        buf = torch.empty(d.nbytes, dtype=torch.uint8)
        view = memoryview(buf.numpy())
        done = 0
        if self._object is not None and d.nbytes:
            view[:] = self._pread(d.nbytes, d.begin)  # blocks until the bytes are read
            done = d.nbytes
        while done < d.nbytes:  # blocks until this tensor's bytes are read
            n = os.preadv(self._fd, [view[done:done + READ_CHUNK]], d.begin + done)
            if n <= 0:
                raise self._corrupt(f"key {key!r}: the file ends inside its data")
            done += n
        if checksum(d.dtype, d.shape, digest(view, expected.algo), expected.algo) != expected.crc:
            raise CorruptCheckpointError(
                f"{self.path}: checksum mismatch for key {key!r} ({d.dtype} {d.shape}); "
                "the file is corrupt")
        return buf.view(TORCH_DTYPES[d.dtype]).reshape(d.shape)


def _is_uint(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """`json.loads` object_pairs_hook for files read from storage (headers, manifests):
    a key given twice is ambiguous (readers disagree on which one wins), so it is
    refused rather than read either way."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out
