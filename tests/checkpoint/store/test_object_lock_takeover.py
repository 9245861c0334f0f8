"""Two jobs taking over one stale object-store lock at once: exactly one holds it.

The attack (issue 29, item 5): two restarts of a job on the same host both find the lock
of their dead predecessor, both judge it stale, and both take it over. A takeover that
deletes the lock without a condition deletes the other taker's new lock as well, and
both jobs then hold the directory. Real processes against a real S3 API server (moto),
with the delay between the judgement and the delete injected by
MOC_LOCK_TAKEOVER_STALL_S.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from moc.checkpoint.liveness import ProcessId
from moc.checkpoint.store.backend import open_root
from moc.checkpoint.store.lock import LOCK_FILE, TAKEOVER_STALL_ENV
from tests.procs import dead_pid

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # a real S3 server: test-slow

TAKER = textwrap.dedent("""
    import logging, os, sys
    from moc.checkpoint.store.lock import (TAKEOVER_STALL_ENV, DirectoryInUseError,
                                           DirectoryLock)

    class Judged(logging.Handler):  # counts the takeovers this process decided on
        n = 0
        def emit(self, record):
            Judged.n += "taking the lock over" in record.getMessage()

    logging.getLogger("moc.checkpoint.store.lock").addHandler(Judged())
    print("ready", flush=True)
    for line in sys.stdin:
        command, stall = line.split()
        if command != "go":
            break
        os.environ[TAKEOVER_STALL_ENV] = stall
        before = Judged.n
        try:
            lock = DirectoryLock.acquire(sys.argv[1])
        except DirectoryInUseError:
            lock, outcome = None, "refused"
        except Exception as e:
            lock, outcome = None, f"error:{type(e).__name__}"
        else:
            outcome = "holds"
        print(outcome, Judged.n - before, flush=True)
        sys.stdin.readline()  # the trial is judged: release for the next one
        if lock is not None:
            lock.release()
""")

STALL_S = 0.5
"""Every taker waits this long between its judgement and its delete: long enough that
both have judged the stale lock before either deletes it."""
LATE_S = (0.1, 0.2, 0.4)
"""How much later the second taker acts. moto's server checks a conditional put and
stores the object in two steps, so two puts in the same millisecond can both succeed
there (measured: 3 in 300 with six concurrent clients), which S3 does not allow; the
takers act at least 0.1 s apart so that what is tested is moc's takeover, not moto."""
TRIALS = 12


def _plant_stale_lock(url: str, trial: int) -> None:
    """The lock of a job of this host, boot and PID namespace whose process is gone."""
    info = {"host": socket.gethostname(), "user": "u", "since": "then",
            "command": "moc train", **ProcessId.of(os.getpid()).to_json(),
            "pid": dead_pid(), "token": f"dead-{trial}"}
    (open_root(url) / LOCK_FILE).write_confirmed(json.dumps(info).encode())


def test_two_takers_of_one_stale_lock_never_both_hold_it(s3_url):
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    env.pop(TAKEOVER_STALL_ENV, None)
    takers = [subprocess.Popen([sys.executable, "-c", TAKER, s3_url], env=env, text=True,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE)
              for _ in range(2)]
    lock = open_root(s3_url) / LOCK_FILE
    try:
        for t in takers:
            assert t.stdout.readline().strip() == "ready"
        for trial in range(TRIALS):
            _plant_stale_lock(s3_url, trial)
            late = trial % 2  # each taker is the slow one in turn
            stalls = [STALL_S, STALL_S]
            stalls[late] += LATE_S[trial // 2 % len(LATE_S)]
            for t, stall in zip(takers, stalls, strict=True):
                t.stdin.write(f"go {stall}\n")
                t.stdin.flush()
            results = [t.stdout.readline().split() for t in takers]
            outcomes = sorted(r[0] for r in results if r)
            # Both judged the same dead holder gone: the race took place.
            assert [r[1] for r in results] == ["1", "1"], (trial, results)
            assert outcomes == ["holds", "refused"], (trial, stalls, results)
            holder = takers[[r[0] for r in results].index("holds")]
            assert json.loads(lock.read_text())["pid"] == holder.pid, trial
            for t in takers:
                t.stdin.write("next 0\n")
                t.stdin.flush()
    finally:
        for t in takers:
            t.stdin.close()
        for t in takers:
            t.wait(timeout=60)
