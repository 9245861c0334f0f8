"""Where a checkpoint directory lives: a local path, or a prefix in an object store.

    root = open_root("ckpt/")                 # a pathlib.Path: today's code paths
    root = open_root("s3://bucket/prefix")    # an ObjectPath over fsspec
    root = open_root("file:///abs/ckpt")      # a pathlib.Path as well

The store layer (steps, format, manifest, retention, lock, identity) takes either kind of
root; each of its functions keeps its local code as it was and branches to an object
store variant when handed an `ObjectPath`. `ObjectPath` offers the few pathlib
operations the store and the tools use (`/`, `name`, `is_file`, `is_dir`, `exists`,
`stat().st_size`, `iterdir`, `relative_to`, `read_bytes`), and the object operations
the commit protocol needs (`write_confirmed`, `unlink`, `remove_tree`, `listing`).

It has no `__fspath__` on purpose: `open(path)` or `Path(path)` on an object raises
TypeError rather than quietly creating a local directory called `s3:`.

Every write is confirmed (docs/FORMAT.md, "Object storage"): after an object is
closed, its size is read back from the store and compared with the bytes written;
a mismatch or any error of the store is an OSError naming the object. Nothing is
swallowed: PyTorch's FsspecWriter lost data silently on S3 and GCS (pytorch#183878)
because a failed upload did not surface.

The fsspec file system is created lazily, once per process and protocol, from the
standard environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_DEFAULT_REGION for s3; GOOGLE_APPLICATION_CREDENTIALS for gs): an ObjectPath pickles
as its URL only, so a persist process builds its own client with its own credentials.
fsspec is imported only here and only for a URL: local-only users do not need it.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Any

URL_RE = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://(.*)$")
"""A directory string with a scheme: `s3://bucket/prefix`, `memory://x`, `file:///abs`."""
FS_OPTIONS: dict[str, dict[str, Any]] = {
    # The listings cache would let a listing taken before a write answer after it:
    # every question moc asks the store must be answered by the store.
    "s3": {"use_listings_cache": False, "skip_instance_cache": True,
           "config_kwargs": {"connect_timeout": 10, "read_timeout": 60,
                             "retries": {"max_attempts": 3}}},
    "gs": {"use_listings_cache": False, "skip_instance_cache": True},
}
"""fsspec options per protocol; credentials and endpoints come from the environment."""
READ_BLOCK = 8 << 20
"""Read-ahead of a tensor file opened for reading: tensors are read in file order, so
one ranged GET fetches several small tensors; large ones are read in a few requests."""
CONDITIONAL_PUT = ("s3",)
"""Protocols whose store refuses a put over an existing object (If-None-Match: *)."""

CLIENT_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_PROFILE",
              "AWS_DEFAULT_REGION", "GOOGLE_APPLICATION_CREDENTIALS")
"""The environment a client is built from: a change makes a new client (tests point one
process at several endpoints)."""

_fs: dict[tuple[Any, ...], Any] = {}
_fs_mutex = threading.Lock()


def is_url(directory: object) -> bool:
    return isinstance(directory, str) and URL_RE.match(directory) is not None


def open_root(directory: str | Path | ObjectPath) -> Path | ObjectPath:
    """The root a checkpoint directory string names: a `Path` for a local directory
    (`file://` included), an `ObjectPath` for any other URL. ValueError for a URL whose
    protocol fsspec does not know, or whose client library is not installed."""
    if isinstance(directory, (Path, ObjectPath)):
        return directory
    m = URL_RE.match(str(directory))
    if m is None:
        return Path(directory)
    protocol, rest = m.group(1).lower(), m.group(2).strip("/")
    if protocol == "file":
        return Path("/" + rest)
    if not rest:
        raise ValueError(f"checkpoint directory {directory!r} names no bucket or prefix; "
                         f"expected {protocol}://bucket/prefix")
    filesystem(protocol)  # fails now, with what to install, rather than at the first save
    return ObjectPath(protocol, rest)


def filesystem(protocol: str) -> Any:
    """This process's fsspec file system for `protocol` (created on first use)."""
    # A forked child must not share its parent's client (its event loop and sockets).
    key = (os.getpid(), protocol, *(os.environ.get(k) for k in CLIENT_ENV))
    with _fs_mutex:
        fs = _fs.get(key)
        if fs is None:
            try:
                import fsspec
            except ImportError:
                raise ValueError(f"a {protocol}:// checkpoint directory needs fsspec: "
                                 "pip install 's3fs>=2024.6' (moc's s3 extra)") from None
            try:
                fs = fsspec.filesystem(protocol, **FS_OPTIONS.get(protocol, {}))
            except (ImportError, ValueError) as e:
                extra = "pip install 's3fs>=2024.6' (moc's s3 extra)" if protocol == "s3" else (
                    f"install the fsspec implementation of {protocol}://")
                raise ValueError(f"cannot open a {protocol}:// checkpoint directory ({e}); "
                                 f"{extra}") from None
            _fs[key] = fs
        return fs


@dataclass(frozen=True)
class Stat:
    st_size: int


@contextlib.contextmanager
def storage_errors(what: str) -> Iterator[None]:
    """Every failure of the store as an OSError saying what was being done: callers
    catch OSError for storage problems (a full disk locally), so a client's own
    exception types (botocore's, aiohttp's) must not slip past them."""
    try:
        yield
    except OSError as e:
        if what in str(e):
            raise
        # The kinds callers tell apart keep their type; a client's own OSError
        # subclasses (aiohttp's) may not take (errno, message), so they become OSError.
        kind = next((k for k in (FileNotFoundError, PermissionError, FileExistsError)
                     if isinstance(e, k)), OSError)
        raise kind(e.errno, f"{what}: {e.strerror or e}") if e.errno else kind(
            f"{what}: {e}") from e
    except Exception as e:
        raise OSError(f"{what}: {type(e).__name__}: {e}") from e


@dataclass(frozen=True)
class ObjectPath:
    """A key (or a prefix) in an object store, e.g. ObjectPath("s3", "bucket/run/step-1").

    Immutable and hashable, like a Path; `str()` is the URL. "Directories" are prefixes:
    one exists while some object lies under it."""

    protocol: str
    key: str
    """bucket/prefix/..., without a leading or trailing slash."""

    def __str__(self) -> str:
        return f"{self.protocol}://{self.key}"

    def __repr__(self) -> str:
        return f"ObjectPath({str(self)!r})"

    def __truediv__(self, name: str) -> ObjectPath:
        name = str(name).strip("/")
        return ObjectPath(self.protocol, f"{self.key}/{name}" if name else self.key)

    def __reduce__(self) -> tuple[Any, ...]:  # the URL only: never a client
        return (ObjectPath, (self.protocol, self.key))

    @property
    def fs(self) -> Any:
        return filesystem(self.protocol)

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    @property
    def parent(self) -> ObjectPath:
        return ObjectPath(self.protocol, self.key.rsplit("/", 1)[0])

    @property
    def fs_key(self) -> str:
        """The key as the fsspec implementation expects it (memory:// is rooted at /)."""
        return "/" + self.key if self.protocol == "memory" else self.key

    def relative_to(self, other: ObjectPath) -> PurePosixPath:
        if not (self.protocol == other.protocol and self.key.startswith(other.key + "/")):
            raise ValueError(f"{self} is not under {other}")
        return PurePosixPath(self.key[len(other.key) + 1:])

    # -- questions ------------------------------------------------------------------------

    def _info(self) -> dict[str, Any] | None:
        with storage_errors(f"cannot stat {self}"):
            self.fs.invalidate_cache(self.fs_key)
            try:
                return self.fs.info(self.fs_key)
            except FileNotFoundError:
                return None

    def is_file(self) -> bool:
        info = self._info()
        return info is not None and info.get("type") == "file"

    def stat(self) -> Stat:
        info = self._info()
        if info is None or info.get("type") != "file":
            raise FileNotFoundError(2, f"{self}: no such object")
        return Stat(int(info["size"]))

    def listing(self) -> dict[str, int]:
        """Every object under this prefix, by key relative to it, with its size: one
        listing request per 1000 objects, the one consistent view a plan is made from."""
        with storage_errors(f"cannot list {self}"):
            self.fs.invalidate_cache(self.fs_key)
            try:
                found = self.fs.find(self.fs_key, detail=True)
            except FileNotFoundError:
                return {}
        base = self.fs_key + "/"
        return {k[len(base):]: int(v.get("size") or 0) for k, v in found.items()
                if k.startswith(base) and v.get("type", "file") == "file"}

    def is_dir(self) -> bool:
        """Whether any object lies under this prefix (a bucket alone counts when it
        exists: an empty prefix in it is a fresh checkpoint directory)."""
        with storage_errors(f"cannot reach {self}"):
            if "/" not in self.key:
                return bool(self.fs.exists(self.fs_key))
            self.fs.invalidate_cache(self.fs_key)
            try:  # one delimited listing request, not a listing of every object
                return bool(self.fs.ls(self.fs_key, detail=False))
            except FileNotFoundError:
                return False

    def exists(self) -> bool:
        return self.is_file() or self.is_dir()

    def iterdir(self) -> Iterator[ObjectPath]:
        """The immediate children of this prefix (objects and sub-prefixes)."""
        names = sorted({k.split("/", 1)[0] for k in self.listing()})
        return iter([self / n for n in names])

    # -- reading ----------------------------------------------------------------------------

    def read_bytes(self, limit: int | None = None) -> bytes:
        """The object's bytes; at most `limit` + 1 of them, so a caller can tell an
        object over its limit without reading all of it."""
        with storage_errors(f"cannot read {self}"):
            if limit is None:
                return self.fs.cat_file(self.fs_key)
            with self.fs.open(self.fs_key, "rb") as f:
                return f.read(limit + 1)

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def open_read(self) -> IO[bytes]:
        """A seekable file object over the object (ranged reads, READ_BLOCK ahead)."""
        with storage_errors(f"cannot open {self}"):
            return self.fs.open(self.fs_key, "rb", block_size=READ_BLOCK,
                                cache_type="readahead")

    # -- writing ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def open_write(self) -> Iterator[IO[bytes]]:
        """A file object whose bytes become this object when the block ends, confirmed:
        the size the store reports must be what was written (OSError otherwise)."""
        what = f"could not write {self}"
        with storage_errors(what):
            f = self.fs.open(self.fs_key, "wb")
        counter = _Counting(f, what)
        try:
            yield counter  # type: ignore[misc]
        except BaseException:
            discard = getattr(f, "discard", None)  # abort a multipart upload: no object
            if discard is not None:
                with contextlib.suppress(Exception):
                    discard()
            raise
        with storage_errors(what):
            f.close()  # blocks until the last part is uploaded: its errors raise here
        self.confirm(counter.n)

    def confirm(self, nbytes: int) -> None:
        """Raise OSError unless the store holds this object with exactly `nbytes`."""
        info = self._info()
        if info is None:
            raise OSError(f"{self}: written ({nbytes} bytes) but the store does not have "
                          "it; the write was lost: check the store and retry")
        if int(info["size"]) != nbytes:
            raise OSError(f"{self}: {nbytes} bytes written but the store holds "
                          f"{info['size']}; the write was cut short: check the store and "
                          "retry")

    def write_confirmed(self, data: bytes) -> None:
        with self.open_write() as f:
            f.write(data)

    def create_exclusive(self, data: bytes) -> bool:
        """Write the object only if none exists; False when one does. Atomic where the
        store has conditional puts (s3: If-None-Match); elsewhere a check then a write,
        which two writers can race (docs/THREAT_MODEL.md)."""
        if self.protocol in CONDITIONAL_PUT:
            bucket, _, key = self.key.partition("/")
            with storage_errors(f"could not create {self}"):
                try:
                    self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data,
                                    IfNoneMatch="*")
                except FileExistsError:  # 412 Precondition Failed
                    return False
            self.confirm(len(data))
            return True
        if self.is_file():
            return False
        self.write_confirmed(data)
        return True

    def unlink(self, missing_ok: bool = False) -> None:
        with storage_errors(f"could not delete {self}"):
            try:
                self.fs.rm_file(self.fs_key)
            except FileNotFoundError:
                if not missing_ok:
                    raise
        if self.is_file():
            raise OSError(f"{self}: deleted, but the store still lists it")

    def remove_tree(self, keep: tuple[str, ...] = ()) -> None:
        """Delete every object under this prefix except the names in `keep` (relative
        keys), in one batched request per 1000 objects where the store has them."""
        doomed = [f"{self.fs_key}/{k}" for k in self.listing() if k not in keep]
        if doomed:
            with storage_errors(f"could not delete the objects under {self}"):
                self.fs.rm(doomed)

    def copy_to(self, dst: ObjectPath) -> None:
        """A server-side copy, confirmed by size."""
        size = self.stat().st_size
        with storage_errors(f"could not copy {self} to {dst}"):
            self.fs.copy(self.fs_key, dst.fs_key)
        dst.confirm(size)


class _Counting:
    """A write-only file that counts the bytes passed through it; the store's errors
    (a part upload fails inside `write`) are OSErrors saying what was being written,
    the caller's own errors pass unchanged."""

    def __init__(self, f: IO[bytes], what: str) -> None:
        self.f, self.n, self.what = f, 0, what

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        with storage_errors(self.what):
            self.f.write(data)
        self.n += n
        return n

    def flush(self) -> None:
        with storage_errors(self.what):
            self.f.flush()
