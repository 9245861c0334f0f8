"""Progress bars are drawn for a human at a terminal and for no one else: a log, a pipe
or CI sees a plain line every few seconds instead, and nothing from a short command."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import select
import struct
import termios

import pytest

from moc.progress import progress, wanted
from moc.train.metrics import StepProgress


@pytest.fixture(params=[24, 0], ids=["24x100", "0x100"])
def terminal(request, monkeypatch):
    """A real pseudo-terminal: (the stream a program writes to, a reader of what the
    terminal received). CI is unset, as on a developer's machine. 100 columns, and 24
    rows or none: `script` and some containers report a height of 0."""
    monkeypatch.delenv("CI", raising=False)
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", request.param, 100, 0, 0))
    stream = open(slave, "w", buffering=1, closefd=True)  # noqa: SIM115 - closed below

    def received() -> str:
        stream.flush()
        chunks = []
        while select.select([master], [], [], 0.2)[0]:
            chunks.append(os.read(master, 65536))
        return b"".join(chunks).decode(errors="replace")

    yield stream, received
    stream.close()
    os.close(master)


class Clock:
    """`time.monotonic` for moc.progress, moved by the test: no test waits or depends on
    how fast the machine is."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_progress_without_a_terminal_is_silent_for_a_short_command(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setattr("moc.progress.time.monotonic", clock := Clock())
    out = io.StringIO()
    with progress(5, "bench size", "run", stream=out) as bar:
        assert not bar.active
        for name in "abcde":
            bar.note(name)
            clock.now += 0.5
            bar.update()
    assert out.getvalue() == ""


def test_progress_without_a_terminal_is_a_line_every_few_seconds(monkeypatch):
    """Issue 50: `moc bench size` piped into a file printed nothing for 1 min 41 s."""
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setattr("moc.progress.time.monotonic", clock := Clock())
    out = io.StringIO()
    with progress(8, "bench size", "run", stream=out, disable=True) as bar:
        for i, name in enumerate(["blocking", "pec-k1", "pec-k2", "pec-k4"]):
            bar.note(name)  # 12 s a run: a line as each one ends
            clock.now += 12
            bar.update(2)
            assert out.getvalue().count("\n") == i + 1
    lines = out.getvalue().splitlines()
    assert lines == ["bench size: 2/8 run, 12 s, about 36 s left (blocking)",
                     "bench size: 4/8 run, 24 s, about 24 s left (pec-k1)",
                     "bench size: 6/8 run, 36 s, about 12 s left (pec-k2)",
                     "bench size: 8/8 run, 48 s (pec-k4)"]


def test_progress_write_is_a_plain_line_without_a_terminal(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    out = io.StringIO()
    with progress(2, "bench accuracy", "run", stream=out) as bar:
        bar.write("no-fault: val loss 2.3")
    assert out.getvalue() == "no-fault: val loss 2.3\n"


def test_progress_on_a_terminal_shows_a_bar_with_the_count_and_the_eta(terminal):
    stream, received = terminal
    with progress(4, "bench size", "run", stream=stream) as bar:
        assert bar.active
        bar.note("pec-k1 (sharded)")
        bar.update()
        bar.write("a line above the bar")
        bar.update(3)
    shown = received()
    assert "bench size" in shown and "1/4" in shown and "4/4" in shown
    assert "<" in shown and "run/s" in shown  # elapsed<remaining, the rate: the ETA
    assert "pec-k1 (sharded)" in shown and "a line above the bar" in shown


def test_progress_is_off_on_a_terminal_under_ci_or_when_disabled(terminal, monkeypatch):
    stream, received = terminal
    assert wanted(stream)
    assert not wanted(stream, disable=True)  # --no-progress
    monkeypatch.setenv("CI", "true")
    assert not wanted(stream)
    with progress(3, "train", "step", stream=stream) as bar:
        bar.update(3)
    assert received() == ""


def test_training_progress_without_a_terminal_is_a_line_every_tenth_of_the_run():
    """The first step, then every 10%: the lines `moc train` has always logged."""
    out = io.StringIO()
    p = StepProgress(20, stream=out)
    for step in range(1, 21):
        p.update(step, 2.5, " ckpt" if step == 10 else "")
    p.message("summary")
    lines = out.getvalue().splitlines()
    assert [line.split()[1] for line in lines[:-1]] == ["1/20"] + [f"{s}/20"
                                                                   for s in range(2, 21, 2)]
    assert lines[5].startswith("step     10/20  loss  2.5000") and lines[5].endswith("ckpt")
    assert lines[-1] == "summary"


def test_training_progress_on_a_terminal_is_a_bar_from_the_resumed_step(terminal):
    stream, received = terminal
    p = StepProgress(20, start=10, stream=stream)
    p.message("resumed from checkpoint step 10")
    for step in range(11, 21):
        p.update(step, 2.5)
    p.message("summary")
    shown = received()
    assert "train" in shown and "20/20" in shown and "loss 2.5000" in shown
    assert "step     12/20" not in shown  # the bar instead of the log lines
    assert shown.index("resumed from") < shown.index("20/20") < shown.index("summary")


def test_training_progress_with_no_bar_keeps_the_log_lines_on_a_terminal(terminal):
    stream, received = terminal
    p = StepProgress(10, stream=stream, bar=False)  # --no-progress
    for step in range(1, 11):
        p.update(step, 1.0)
    assert received().replace("\r\n", "\n").count("\n") == 10
