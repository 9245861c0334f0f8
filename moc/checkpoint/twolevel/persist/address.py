"""Where a node's persist process listens, and its listener: the standard library only,
so that a persist process started on demand binds its socket and admits the ranks
before it imports torch (`twolevel.persist.prestart.LISTEN_FIRST` loads this file by
its path).

    socket_path(jdir)           the job's socket (`<job dir>/persist.sock`)
    Listener(path, secret)      bound now; accepts (the HMAC challenge both ways) on a
                                thread of its own, the connections queued for the
                                server (`twolevel.persist.server`) to read

Why accept before the import: a rank's `_connect` returns only once the process has
answered its challenge, and rank 0 builds its engine around that connection. An
interpreter that imports torch first kept `TwoLevelCheckpointer(...)` waiting 1.5-2.7 s
(issue 48); listening first, the wait is an interpreter's start, and the import runs
beside whatever the rank does next. Messages sent meanwhile wait in the socket's buffer
until the server reads them.
"""

from __future__ import annotations

import contextlib
import os
import threading
from multiprocessing import AuthenticationError
from multiprocessing import connection as mpc
from pathlib import Path
from queue import Queue

SUN_PATH_MAX = 107
"""The longest path a Unix socket's address holds (`sun_path`: 108 bytes, NUL included)."""
_dir_fds: dict[str, int] = {}


def socket_path(jdir: Path | str) -> str:
    """The job's socket, `<job dir>/persist.sock`, or, when that path is too long for a
    socket address (a deep job directory: "AF_UNIX path too long"), the same file
    reached through a descriptor of the job directory that this process keeps open,
    `/proc/self/fd/<n>/persist.sock`, which Linux resolves for bind and connect alike."""
    path = os.path.join(str(jdir), "persist.sock")
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


class Listener:
    """The persist process's socket in job directory `jdir`, bound at construction (a
    socket file left by an earlier process is replaced: the directory is the job's own,
    0700, checked by rank 0 before it started this process), admitting only holders of
    `secret`. Connections that pass the challenge wait in `accepted`; None there means
    the listener was closed.

    The socket file is never removed by this process, at close or at exit: by then the
    path may be the next persist process's. multiprocessing's listener unlinks its path
    when closed or when the interpreter exits, and a persist process that outlived its
    rank by a moment (it notices its parent's death by polling) removed the socket of
    the process that had replaced it, which then listened on a name nobody could reach:
    the new rank 0's engine waited 60 s and the job failed (issue 49, a spare taking
    over rank 0 on 2 simulated nodes, about one run in four). A dead process's socket
    file is replaced by the next bind, and goes with the job's directory."""

    def __init__(self, jdir: Path | str, secret: bytes) -> None:
        self.jdir = str(jdir)
        path = socket_path(jdir)
        if os.path.lexists(path):
            os.unlink(path)
        self._listener = mpc.Listener(path, family="AF_UNIX", authkey=secret)
        unlink = getattr(self._listener._listener, "_unlink", None)  # util.Finalize
        if unlink is not None:
            unlink.cancel()
            self._listener._listener._unlink = None
        self.accepted: Queue[mpc.Connection | None] = Queue()
        threading.Thread(target=self._accept, daemon=True, name="moc-persist-accept").start()

    def _accept(self) -> None:
        while True:
            try:
                conn = self._listener.accept()  # runs the HMAC challenge both ways
            except (AuthenticationError, EOFError, ConnectionError):
                continue  # a client without the secret (or gone mid-handshake)
            except OSError:
                self.accepted.put(None)
                return
            self.accepted.put(conn)

    def close(self) -> None:
        """Stop listening (its socket may be gone with the node's memory already: a node
        fault wipes it)."""
        with contextlib.suppress(OSError):
            self._listener.close()
