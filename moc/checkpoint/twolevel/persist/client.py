"""A training rank's end of its node's persist process (`twolevel.persist.server`).

    PersistClient    the process (a node's leader starts it, and restarts it when it
                     dies), the connection (every rank reconnects to a restarted one),
                     liveness (a stopped or hung process is killed:
                     `twolevel.persist.watch`)

Who may talk to the process: only holders of its secret (`twolevel.persist.channel`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection
from pathlib import Path

from moc.checkpoint import codec
from moc.checkpoint.errors import CheckpointError
from moc.checkpoint.store.storage import Storage
from moc.checkpoint.twolevel.memory.jobdir import secure_job_dir
from moc.checkpoint.twolevel.persist import prestart
from moc.checkpoint.twolevel.persist.channel import read_secret, socket_path, write_secret
from moc.checkpoint.twolevel.persist.protocol import (
    MAX_DONE_BYTES,
    MAX_RESTARTS,
    PERSIST_GONE,
    PERSIST_KILLED,
    Done,
    Hello,
    Persist,
    Stop,
)
from moc.checkpoint.twolevel.persist.watch import LOOK_S, PersistWatch, process_state

log = logging.getLogger(__name__)
CONNECT_TIMEOUT_S = 60.0
"""How long a rank waits for its node's persist process to listen (an interpreter's
start: it listens before its import of torch ends, `prestart.LISTEN_FIRST`). Rank 0
stops waiting as soon as the process exits."""
CONNECT_POLL_S = 0.01
"""Between tries to connect: a process that listens within tens of milliseconds is
found within one more (an engine built in a recovery waited 50 ms per miss)."""
STOP_TIMEOUT_S = 60.0
"""How long close() lets the persist process finish and exit before killing it (a
stopped one is killed at once: it can neither finish nor exit)."""

class PersistClient:
    """A training rank's connection to its node's persist process; rank 0's also owns the
    process itself (it starts, restarts and stops it, and notices when it is gone).

    `generation` counts the persist processes rank 0 has started in this job (0: the
    first); a rank other than 0 connects to the one of the generation it is given (None:
    whichever rank 0 recorded last) and `reconnect`s when rank 0 shares a newer one.

    A leader watches its process (`watch`, `twolevel.persist.watch`): one found stopped or hung
    while it is polled, waited for or checked is killed, and `restart` replaces it.

    Owners: `send` may be called from the caller's and the snapshot thread (a lock keeps
    messages whole); `receive`, `alive`, `process`, `check` and `restart` belong to rank
    0's thread that holds the engine's plan lock, `reconnect` to a plan.
    """

    def __init__(self, job: str, storage: Storage, rank: int,
                 generation: int | None = None, leader: bool | None = None,
                 watch: PersistWatch | None = None) -> None:
        self.job, self.storage, self.rank = job, storage, rank
        self.leader = rank == 0 if leader is None else leader
        """Whether this rank runs its node's persist process (its local rank 0)."""
        self.jdir = secure_job_dir(job)
        self.alive = True
        """Rank 0's view: False once the process is found gone (or hung and killed)."""
        self.process: subprocess.Popen | None = None
        self.generation = 0 if generation is None else generation
        self.restarts = 0
        """Rank 0: persist processes started after the first (at most MAX_RESTARTS)."""
        self.watch = watch or PersistWatch()
        """A leader's: what it has seen of its process (stopped? a persist unanswered?)."""
        self.lost = PERSIST_GONE
        """The outcome of a persist lost with the process: why it is gone."""
        self._lock = threading.Lock()
        self._conn: Connection | None = None
        self._spawner: ThreadPoolExecutor | None = None
        if self.leader:
            # Persist processes are started from a thread made now, on the caller's
            # thread, in its scheduling class: a restart is asked for on the snapshot
            # thread, whose SCHED_IDLE a child would inherit and could never leave (its
            # start-up, a new interpreter, would then wait for idle cores).
            self._spawner = ThreadPoolExecutor(1, thread_name_prefix="moc-persist-spawn")
            self._spawner.submit(lambda: None).result()
            self._start()
        else:
            self._join(generation)

    def _start(self) -> None:
        """Rank 0: start the persist process of `self.generation` with a new secret and
        connect to it. Raises CheckpointError within seconds when the process dies
        before it listens (its own error is on stderr), and never leaves it running
        when the connection fails."""
        secret = write_secret(self.jdir, self.generation)
        assert self._spawner is not None
        # On the spawner's thread, whose scheduling class a new process inherits (the
        # prestarted one taken is replaced there too).
        process = self._spawner.submit(
            lambda: prestart.take() or prestart.spawn()).result()
        self.process = process
        try:
            assert process.stdin is not None
            # What to serve goes on stdin: argv and the environment of a process are
            # readable by others, and a prestarted process learns it only now.
            order = {"job": self.job, "root": self.storage.name, "parent": os.getpid(),
                     "secret": secret.hex(), "dir": str(self.jdir)}
            with contextlib.suppress(BrokenPipeError):  # it died: _connect says so
                process.stdin.write(json.dumps(order).encode() + b"\n")
                process.stdin.close()
            self._conn = _connect(self.jdir, lambda: secret, process)
        except BaseException:
            process.kill()
            process.wait()
            raise
        self.send(Hello(0))

    def _join(self, generation: int | None) -> None:
        self._conn = _connect(self.jdir, lambda: read_secret(self.jdir, generation))
        self.send(Hello(self.rank))

    def send(self, msg: object) -> None:
        """Send one message; a dead persist process is not an error here (rank 0
        notices it in `receive` or `check`, and every rank learns it from rank 0). A
        Persist starts the watch's clock."""
        data = codec.encode(msg)
        if isinstance(msg, Persist) and self.leader:
            self.watch.sent(msg.step)
        with self._lock, contextlib.suppress(OSError):
            if self._conn is not None:
                self._conn.send_bytes(data)

    def receive(self, step: int, block: bool) -> list[Done]:
        """A leader: the results that have arrived while the persist of `step` is in
        flight; with `block`, waiting for that one (sent by `send`, whose clock the watch
        keeps: the hang limit bounds the wait), looking at the process every LOOK_S.
        A closed connection, or a process the watch finds stopped or hung (killed then:
        it must never commit late), ends the persist as failed (`lost`)."""
        out: list[Done] = []
        conn = self._conn
        while conn is not None:
            try:
                if not conn.poll(LOOK_S if block else 0):
                    why = self._look()
                    if why is not None:
                        out.append(self._gone(step, why))
                    if why is not None or not block:
                        break
                    continue
                msg = codec.decode(conn.recv_bytes(MAX_DONE_BYTES))
                if not isinstance(msg, Done):
                    raise codec.CodecError(f"expected a Done, got {type(msg).__name__}")
            except (EOFError, OSError, codec.CodecError):
                msg = self._gone(step)
            else:
                self.watch.answered(msg.step, msg.ok)
            out.append(msg)
            if msg.step == step:
                break
        if conn is None and block:
            out.append(self._gone(step))
        return out

    def _look(self) -> str | None:
        """The watch's verdict on the running process (None: none runs, or it is fine)."""
        if not self.alive or not self._running():
            return None
        assert self.process is not None
        return self.watch.verdict(self.process.pid)

    def _gone(self, step: int, why: str | None = None) -> Done:
        """The process is gone, or killed now for `why`: the persist of `step` with it."""
        self._kill(why)
        return Done(step, False, self.lost)

    def _kill(self, why: str | None) -> None:
        """Rank 0's view: the process is lost (killed for `why`, when the watch says so:
        a stopped one never answers, a hung one must never commit late)."""
        if not self.alive:
            return
        self.alive = False
        self.lost = PERSIST_GONE if why is None else PERSIST_KILLED.format(why)
        self.watch.replaced()  # nothing more of it will be answered or seen
        if self.process is not None:
            pid = self.process.pid
            self.process.kill()
            code = self.process.wait()
            if why is not None:
                log.warning("the persist process (pid %d) was %s: killed; a new one takes "
                            "the next persist", pid, why)
            else:
                log.warning("the persist process (pid %d) is gone (exit code %s); a new "
                            "one takes the next persist", pid, code)

    def check(self, block: bool = False) -> bool:
        """A leader: whether the persist process is alive, noticing an exit even when no
        persist is in flight (an idle process can die too), and killing one the watch
        finds stopped or hung. `block` (training waits for the process anyway): a
        stopped process is given STOPPED_S to go on, no longer."""
        why = self._look()
        while why is None and block and self.watch.stopped and self._running():
            time.sleep(LOOK_S)
            why = self._look()
        if why is not None or not self._running():
            self._kill(why)
        return self.alive

    def _running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def restart(self) -> bool:
        """Rank 0: start a new persist process (generation + 1, a new secret) after the
        last one died or was killed; False when MAX_RESTARTS are used up or it would
        not start. The other ranks `reconnect` when they learn the generation (at
        the next plan)."""
        if self.alive:
            return True
        while self.restarts < MAX_RESTARTS:
            self.restarts += 1
            self._close()
            if self.process is not None and self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            self.generation += 1
            try:
                self._start()
            except CheckpointError as e:
                print(f"moc: restart {self.restarts} of the persist process failed: {e}",
                      file=sys.stderr)
                continue
            self.alive = True
            self.watch.replaced()
            return True
        return False

    def reconnect(self, generation: int) -> None:
        """A rank other than 0: connect to rank 0's new persist process of `generation`."""
        self._close()
        self._join(generation)
        self.generation = generation

    def _close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def abandon(self) -> None:
        """The job's process groups are gone (in-job recovery): `stop` at once."""
        self.stop(at_once=True)

    def stop(self, at_once: bool = False) -> None:
        """A leader: ask the process to stop and wait for it (killing it after
        STOP_TIMEOUT_S), or with `at_once` kill it now (what it was persisting is
        abandoned: an uncommitted step is never read, and the next process tidies what
        it left); every rank: close the connection."""
        try:
            if self.leader and self.process is not None:
                if not at_once:
                    self.send(Stop())
                _wait_or_kill(self.process, 0 if at_once else STOP_TIMEOUT_S)
        finally:
            self._close()
            if self._spawner is not None:
                self._spawner.shutdown(wait=False)


def _wait_or_kill(process: subprocess.Popen, timeout_s: float) -> None:
    """Wait for `process` to exit, `timeout_s` at most, then kill it; a stopped process
    (SIGSTOP) is killed at once: it can neither finish nor exit."""
    deadline = time.monotonic() + timeout_s
    while process.poll() is None:
        if time.monotonic() >= deadline or process_state(process.pid) == "T":
            process.kill()
            break
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=min(LOOK_S, max(0.0, deadline - time.monotonic())))
    process.wait()


def _connect(jdir: Path, secret: Callable[[], bytes | None],
             process: subprocess.Popen | None = None) -> Connection:
    """Connect to the job's persist process, retrying while it starts (no socket yet, no
    secret recorded yet, or a secret of an older process). `process` (rank 0): stop as
    soon as it has exited. Raises CheckpointError with what to do."""
    path = socket_path(jdir)
    timeout_s = CONNECT_TIMEOUT_S
    deadline = time.monotonic() + timeout_s
    while True:
        if process is not None and process.poll() is not None:
            raise CheckpointError(
                f"the persist process exited with code {process.returncode} as it started, "
                f"before rank 0 connected to {jdir / 'persist.sock'} (its error is above, on "
                "this job's stderr); "
                "checkpoints cannot reach storage: fix that error and restart the job")
        key = secret()
        if key is not None:
            try:
                return Client(path, family="AF_UNIX", authkey=key)
            except (FileNotFoundError, ConnectionRefusedError, AuthenticationError,
                    EOFError, ConnectionResetError, BrokenPipeError):
                pass  # not listening yet, or gone mid-handshake: the loop looks again
        if time.monotonic() > deadline:
            raise CheckpointError(
                f"no persist process answered on {jdir / 'persist.sock'} within "
                f"{timeout_s:.0f} s; rank 0 starts it: look for rank 0's error, or a "
                "second job using the same checkpoint directory")
        time.sleep(CONNECT_POLL_S)
