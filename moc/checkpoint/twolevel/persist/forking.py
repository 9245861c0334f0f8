"""Children forked from an interpreter that has already imported what they run.

A new interpreter pays Python's start and torch's import (1.5-2 s on the project's
2-core VM, more when its cores are busy). A child forked from a process that imported
them starts with everything imported, sharing those pages until it writes them. moc
forks two kinds of processes this way, each from a process that has imported torch but
never computed with it (no OpenMP pool, no CUDA context) and, at that moment, runs no
thread the child needs:

- a training process, from its rank host (`moc.train.forked`);
- a persist process, from a forked training process before it starts any thread
  (`moc.checkpoint.twolevel.persist.prestart.prestart(fork=True)`).

The child touches nothing its parent owns: it closes every descriptor it was not given
(the parent's store connections, other children's pipes), puts the default signal
handlers back, and always ends with `os._exit`, so that no destructor of the parent's
objects runs in it. Threads of the parent (a TCPStore server's, on rank 0's host) do
not exist in the child; glibc's fork takes the allocator's locks, and the child takes
no other lock they may hold. Stdlib only: `prestart` may load it before torch.

    fork(run, stdin=, keep=, on_fork=)    a child that runs `run()` and exits with it
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import BinaryIO


class Forked:
    """A forked child, with the part of `subprocess.Popen`'s interface moc uses (pid,
    stdin, poll, wait, kill, send_signal, returncode: -N for a death by signal N)."""

    def __init__(self, pid: int, stdin: BinaryIO | None) -> None:
        self.pid = pid
        self.stdin = stdin
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: its status is lost
                self.returncode = 1
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(0.005)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def fork(run: Callable[[], int | None], stdin: bool = False, keep: tuple[int, ...] = (),
         on_fork: Callable[[], None] | None = None) -> Forked:
    """A child that runs `run()` and exits with its status (0 for None; 1 and the
    traceback for an exception). `stdin`: a pipe to its stdin (`Forked.stdin`), else
    /dev/null; `keep`: descriptors it keeps beside 0-2; `on_fork`: run first in the
    child (a prctl, a priority)."""
    read = write = None
    if stdin:
        read, write = os.pipe()
    for stream in (sys.stdout, sys.stderr):  # nothing buffered is written twice
        with contextlib.suppress(Exception):
            stream.flush()
    pid = os.fork()
    if pid == 0:
        _child(run, read, keep, on_fork)  # never returns
    if read is not None:
        os.close(read)
    return Forked(pid, os.fdopen(write, "wb") if write is not None else None)


def _child(run: Callable[[], int | None], stdin_fd: int | None, keep: tuple[int, ...],
           on_fork: Callable[[], None] | None) -> None:
    code = 1
    try:
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, signal.SIG_DFL)
        if on_fork is not None:
            on_fork()
        os.dup2(stdin_fd if stdin_fd is not None else os.open(os.devnull, os.O_RDONLY), 0)
        kept = {0, 1, 2, *keep}
        fds = ([int(f) for f in os.listdir("/proc/self/fd")] if os.path.isdir("/proc/self/fd")
               else list(range(3, os.sysconf("SC_OPEN_MAX"))))
        for fd in fds:
            if fd not in kept:
                with contextlib.suppress(OSError):
                    os.close(fd)
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        code = run() or 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)
