"""Where a rank finds its node's persist process: the job's socket and the secret
that admits it (both in the job's 0700 directory; `twolevel.persist.client` connects,
`twolevel.persist.server` listens)."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

from moc.checkpoint.twolevel.memory.jobdir import write_private
from moc.checkpoint.twolevel.persist.protocol import (
    SECRET_BYTES,
)

SUN_PATH_MAX = 107
"""The longest path a Unix socket's address holds (`sun_path`: 108 bytes, NUL included)."""
_dir_fds: dict[str, int] = {}


def socket_path(jdir: Path) -> str:
    """The job's socket, `<job dir>/persist.sock`, or, when that path is too long for a
    socket address (a deep job directory: "AF_UNIX path too long"), the same file
    reached through a descriptor of the job directory that this process keeps open,
    `/proc/self/fd/<n>/persist.sock`, which Linux resolves for bind and connect alike."""
    path = str(jdir / "persist.sock")
    if len(os.fsencode(path)) <= SUN_PATH_MAX or not os.path.isdir("/proc/self/fd"):
        return path
    fd = _dir_fds.get(str(jdir))
    if fd is not None:  # still that directory? (a job directory made again is another)
        now, held = os.stat(jdir), os.fstat(fd)
        if (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
            os.close(fd)
            fd = None
    if fd is None:
        fd = _dir_fds[str(jdir)] = os.open(jdir, os.O_PATH | os.O_DIRECTORY)
    return f"/proc/self/fd/{fd}/persist.sock"


def secret_path(jdir: Path) -> Path:
    return jdir / "persist.key"


def write_secret(jdir: Path, generation: int) -> bytes:
    """Rank 0: a new random secret for the persist process of `generation`, stored 0600
    for the other ranks; returned for the process itself."""
    secret = secrets.token_bytes(SECRET_BYTES)
    write_private(secret_path(jdir), json.dumps({"generation": generation,
                                                 "secret": secret.hex()}))
    return secret


def read_secret(jdir: Path, generation: int | None) -> bytes | None:
    """The secret of the persist process of `generation` (None: whichever is recorded);
    None while it is not recorded yet."""
    try:
        record = json.loads(secret_path(jdir).read_text())
    except (OSError, ValueError):
        return None
    if generation is not None and record.get("generation") != generation:
        return None
    return bytes.fromhex(record["secret"])
