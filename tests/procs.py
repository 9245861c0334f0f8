"""Processes for the attack tests: a pid that is gone, and another PID namespace; and
the `moc` command run in the test's own process, for checks made before anything
starts."""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest

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


def moc_here(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """`moc ARGV` in this process (`moc.cli.main`, as `python -m moc` runs it): its exit
    status and what it wrote to stderr. For options refused before anything starts: a
    new interpreter costs about 3 s of CI per case (torch's import), and one test per
    refusal path still runs the real process."""
    from moc import cli

    capsys.readouterr()  # what came before is not this command's
    try:
        code = cli.main(list(argv))
    except SystemExit as e:  # argparse's own errors
        code = e.code if isinstance(e.code, int) else 1
    return code, capsys.readouterr().err
