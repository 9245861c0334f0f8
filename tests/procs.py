"""Processes for the attack tests: a pid that is gone, and another PID namespace."""

from __future__ import annotations

import functools
import subprocess
import sys

UNSHARE_PIDS = ("unshare", "-Urpf", "--mount-proc")
"""A command prefix that runs its command in a new user and PID namespace, as in a
container: the pids outside are not visible inside."""


@functools.cache
def can_unshare_pids() -> bool:
    """Whether `UNSHARE_PIDS` works here (util-linux, unprivileged user namespaces)."""
    try:
        return subprocess.run([*UNSHARE_PIDS, "true"], capture_output=True,
                              timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def dead_pid() -> int:
    """The pid of a process that has exited (and was reaped)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid
