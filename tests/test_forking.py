"""`moc.checkpoint.twolevel.persist.forking`: children forked from an interpreter that imported
what they run. Real forks: a child's status, its death by a signal, what it keeps of its
parent's descriptors, its stdin pipe, and its signal handlers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from moc.checkpoint.twolevel.persist.forking import fork


def test_a_child_exits_with_what_it_returns_raises_or_exits_with():
    assert fork(lambda: 3).wait(timeout=30) == 3
    assert fork(lambda: None).wait(timeout=30) == 0
    assert fork(lambda: sys.exit(5)).wait(timeout=30) == 5
    assert fork(lambda: 1 // 0).wait(timeout=30) == 1  # the traceback goes to stderr


def test_a_child_killed_by_a_signal_reads_as_popen_says_it():
    child = fork(lambda: signal.pause(), stdin=True)
    assert child.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.05)
    child.kill()
    assert child.wait(timeout=30) == -signal.SIGKILL and child.returncode == -9
    child.kill()  # a dead child: nothing, no error


def test_a_child_keeps_only_the_descriptors_it_was_given_and_reads_its_own_stdin(tmp_path):
    """The parent's other descriptors (a store's socket, other children's pipes) are
    closed in the child, which must never write to them."""
    kept_r, kept_w = os.pipe()
    other_r, other_w = os.pipe()
    out = tmp_path / "out"

    def run() -> int:
        line = sys.stdin.readline().strip()
        fds = sorted(int(f) for f in os.listdir("/proc/self/fd"))
        os.write(kept_w, f"{line} {kept_w in fds} {other_w in fds}".encode())
        handler = signal.getsignal(signal.SIGTERM)
        out.write_text(str(handler == signal.SIG_DFL))
        return 0

    previous = signal.signal(signal.SIGTERM, lambda *_: None)  # the parent's own handler
    try:
        child = fork(run, stdin=True, keep=(kept_w,))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert child.stdin is not None
    child.stdin.write(b"word\n")
    child.stdin.close()
    assert child.wait(timeout=30) == 0
    os.close(kept_w)
    assert os.read(kept_r, 100).decode() == "word True False"
    assert out.read_text() == "True"  # the parent's handlers are not the child's
    for fd in (kept_r, other_r, other_w):
        os.close(fd)
