"""Where a rank finds its node's persist process: the job's socket (`socket_path`, from
`twolevel.persist.address`, which has no import but the standard library's) and the
secret that admits it, both in the job's 0700 directory; `twolevel.persist.client`
connects, `twolevel.persist.server` listens."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

from moc.checkpoint.twolevel.memory.jobdir import write_private
from moc.checkpoint.twolevel.persist.address import SUN_PATH_MAX, socket_path
from moc.checkpoint.twolevel.persist.protocol import (
    SECRET_BYTES,
)


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


__all__ = ["SUN_PATH_MAX", "read_secret", "secret_path", "socket_path", "write_secret"]
