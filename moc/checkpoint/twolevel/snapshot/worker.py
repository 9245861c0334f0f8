"""The snapshot thread of one rank: a plan, then the capture into a slot behind forward
and backward, then the seal.

    worker = SnapshotWorker()
    handle = SnapshotHandle(worker, store, copier, step, plan, ready)   # returns at once
    ...                                                  # forward, backward
    handle.wait()          # blocks until captured: right before optimizer.step()
    header = handle.wait_sealed()   # a recovery source (flush, restore, close)

The copies and the checksums release the GIL (one native call each), so they overlap the
next forward and backward. `plan` decides what to copy and where; it may run collectives
of its own (on the side group: see `moc.checkpoint.dist` for why that is safe on this
thread). The thread runs its jobs in order, so a slot is never reused before its seal.
"""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from moc.checkpoint.errors import CheckpointError
from moc.checkpoint.phases import Phases
from moc.checkpoint.twolevel.memory.slots import SnapshotHeader, SnapshotStore
from moc.checkpoint.twolevel.snapshot.capture import Copier, capture, seal
from moc.checkpoint.twolevel.snapshot.tensors import SnapshotTensors

PRIORITY_ENV = "MOC_CKPT_PRIORITY"
"""How checkpoint work is scheduled: "idle" (the default: the snapshot thread in
SCHED_IDLE, the persist process at niceness 19), "nice" (both at niceness 10: moc's
scheduling up to 0.3.0), "normal" (as training). Read by the snapshot thread and by the persist
process (which inherits the environment)."""
PRIORITIES = ("idle", "nice", "normal")
NICENESS = {"idle": 19, "nice": 10}
"""Niceness of the persist process, and of the snapshot thread where SCHED_IDLE is not
to be had."""


def background_priority() -> str:
    """The PRIORITY_ENV setting; ValueError for a value it does not know (checked when
    an engine is made, not on a background thread)."""
    value = os.environ.get(PRIORITY_ENV, "idle")
    if value not in PRIORITIES:
        raise ValueError(f"{PRIORITY_ENV}={value!r}: expected one of "
                         f"{', '.join(PRIORITIES)} (default idle)")
    return value


def lower_thread_priority() -> None:
    """The snapshot thread: SCHED_IDLE (Linux: scheduling is per thread, and the threads
    it starts inherit it), else niceness 19; per PRIORITY_ENV.

    On a machine whose cores training keeps busy, checkpoint work should run in the gaps
    (ranks waiting on each other in collectives) and give the core back the moment a
    training thread wakes. A SCHED_IDLE thread is preempted at once when a normal thread
    wakes, where a niced one keeps its slice; measured against itself (`moc bench
    overhead --paired 5`, docs/BENCHMARKS.md), a checkpoint every step cost 0.912-0.924
    of the throughput at niceness 10 and 0.927-0.966 in SCHED_IDLE. The kernel still
    gives it a minimum share (weight 3, against 1024 for niceness 0), and a training
    thread that waits for its snapshot leaves the core to it. Not undone: an unprivileged
    thread cannot leave SCHED_IDLE, so whatever must start at training's priority (a
    new persist process) is started from another thread (`PersistClient`).

    Elsewhere than Linux a thread's priority cannot be set apart from its process's
    (the training thread's), and the snapshot thread is left as it is.
    """
    mode = background_priority()
    if mode == "normal" or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    if mode == "idle":
        with contextlib.suppress(AttributeError, OSError):
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            return
    _renice(tid, NICENESS[mode])


def _renice(who: int, niceness: int) -> None:
    """At least `niceness` (a job started nicer stays as nice); `who` 0: the caller."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, who, max(niceness, os.getpriority(os.PRIO_PROCESS, who)))


def lower_process_priority() -> None:
    """The persist process, first thing: niceness 19 ("nice": 10), the whole process.
    Niceness rather than SCHED_IDLE: an I/O scheduler that takes a task's I/O class from
    its CPU policy (BFQ) would serve a SCHED_IDLE process's writes and fsyncs only when
    the disk is otherwise idle, and a busy data loader could then hold a persist past
    its timeout."""
    mode = background_priority()
    if mode != "normal":
        _renice(0, NICENESS[mode])  # Linux: this (main) thread, and those it starts


class SnapshotWorker:
    """One background thread, started at the first snapshot and kept: starting a thread
    per snapshot cost the training thread a millisecond or more inside save()
    (Thread.start waits for the new thread, which then competes for the GIL), and one
    thread also keeps snapshots in order.

    The thread is a daemon: its work may include a collective (the snapshot's plan), and
    a process leaving on an error must not wait at exit for a collective its peers will
    never enter. A snapshot cut short that way has no header, so it is never a recovery
    source. Owner: the caller's thread (submit, stop).
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue | None = None
        self.thread: threading.Thread | None = None
        """The thread, once started (its scheduling class is `lower_thread_priority`'s)."""

    def submit(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` on the thread after the work submitted before; its future."""
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            self.thread = threading.Thread(target=_serve, args=(self._jobs,),
                                           name="moc-snapshot", daemon=True)
            self.thread.start()
        future: Future = Future()
        self._jobs.put((fn, future))
        return future

    def stop(self) -> None:
        """Stop the thread after the work submitted before (blocks until then)."""
        if self._jobs is not None:
            done: Future = Future()
            self._jobs.put((None, done))
            done.result()
            self._jobs = None


def _serve(jobs: queue.SimpleQueue) -> None:
    """The snapshot thread: run jobs in order until a None job, which it acknowledges."""
    lower_thread_priority()  # once: the thread's class holds for every job it runs
    while True:
        fn, future = jobs.get()
        if fn is None:
            future.set_result(None)
            return
        try:
            future.set_result(fn())
        except BaseException as e:
            future.set_exception(e)


@dataclass
class SnapshotJob:
    """What one snapshot copies, decided on the snapshot thread (`SnapshotHandle`'s
    plan)."""

    slot: int
    tensors: dict[str, torch.Tensor] | SnapshotTensors
    """What it copies: the engine's, laid out once and cached (`twolevel.snapshot.state_cache`),
    or a plain dict (laid out at each capture)."""
    meta: dict[str, Any]
    sizing: dict[str, torch.Tensor] | None = None
    """For a dict, the whole state the slot is laid out for (default: `tensors`)."""
    on_done: Callable[[SnapshotHeader], None] | None = None
    """Called on the snapshot thread once the snapshot is sealed."""
    on_error: Callable[[BaseException], None] | None = None
    """Called on the snapshot thread if the capture or the seal fails (before the
    caller's wait raises it)."""
    outcome: Any = None
    """What the plan decided that the caller reports (read after `wait()`)."""


class SnapshotHandle:
    """A snapshot being taken on the worker's thread: first `plan` decides what to copy
    and where (it may run collectives of its own), then the capture, then the seal.

    The plan and the capture run behind the next forward and backward pass, so deciding
    costs training no more than copying: the caller pays for handing the work over, and
    for waiting in `wait()` only when the two together outlast the window. The seal runs
    behind the steps after it. Two futures, as DCP's async save has: `captured` (the
    state may change again) and `sealed` (a recovery source; its result is the header).
    When the copy took the checksums on the way (the fused CPU capture), the seal has
    only the header left to write, and `captured` waits for it too: a process killed
    after its capture then never loses that snapshot, for the price of writing a file.
    The other fields are written by the worker's thread and read by the caller only
    after the future that covers them.
    """

    def __init__(self, worker: SnapshotWorker, store: SnapshotStore, copier: Copier,
                 step: int, plan: Callable[[], SnapshotJob], ready: Any = None,
                 threads: int = 1) -> None:
        """`ready`: a CUDA event recorded on the training stream when the checkpoint was
        requested; the plan waits for it (the routing counts and param groups `save()`
        queued for the host are there then), and so does the copy (the state is final
        once the work queued before it is done). `threads`: native threads the seal
        hashes on."""
        self.step = step
        self.job: SnapshotJob | None = None
        """The plan's decision (None until it is made, or if it failed)."""
        self.plan_s = 0.0
        """Time the plan took (waiting for `ready` included), before the copy started."""
        self.capture_s = 0.0
        """Time the capture took after the plan: reserving memory (when it was not
        prepared), the copies (and, on the fused CPU path, their checksums)."""
        self.seal_s = 0.0
        """Time the seal took: the checksums the copy did not take, the header."""
        self.phases = Phases()
        """Where the plan's and the snapshot's time went, wall and CPU ("queued": behind
        the work before it on the thread, a previous seal; "plan", "reserve", "copy":
        `capture.capture`; "checksum", "header": `capture.seal`)."""
        self.nbytes = 0
        """Bytes copied."""
        self.prepared = False
        """Whether its slot was ready before the capture (`capture.Captured.prepared`)."""
        self.header: SnapshotHeader | None = None
        self.replica: Future | None = None
        """This rank's replica round of the snapshot, across nodes (`Snapshotter.stage`)."""
        self.captured: Future[None] = Future()
        submitted = time.perf_counter()
        self.sealed: Future[SnapshotHeader] = worker.submit(
            lambda: self._run(store, copier, plan, ready, threads, submitted))

    def _run(self, store: SnapshotStore, copier: Copier, plan: Callable[[], SnapshotJob],
             ready: Any, threads: int, submitted: float) -> SnapshotHeader:
        """On the snapshot thread: the plan, the capture (then `captured` is set), the
        seal; the header, or what failed, is the result of `sealed`."""
        t0 = time.perf_counter()
        self.phases.record("queued", t0 - submitted)
        try:
            with self.phases("plan"):
                if ready is not None:
                    ready.synchronize()  # sleeps (a blocking event) until it is passed
                job = plan()
        except BaseException as e:  # raised as it is by wait()
            self.captured.set_exception(e)
            raise
        self.job = job
        t1 = time.perf_counter()
        self.plan_s = t1 - t0
        try:
            got = capture(store, copier, job.slot, self.step, job.tensors, ready, job.sizing,
                          self.phases)
        except BaseException as e:
            self.capture_s = time.perf_counter() - t1
            self.captured.set_exception(self._failed(job, e))
            raise
        t2 = time.perf_counter()
        self.capture_s, self.nbytes, self.prepared = t2 - t1, got.nbytes, got.prepared
        if got.digests is None:  # the seal hashes: training need not wait for that
            self.captured.set_result(None)
        try:
            header = seal(store, got, job.meta, threads, self.phases)
            if job.on_done is not None:
                job.on_done(header)
        except BaseException as e:
            failed = self._failed(job, e)
            if not self.captured.done():
                self.captured.set_exception(failed)
            raise failed from e
        finally:
            self.seal_s = time.perf_counter() - t2
        self.header = header
        if not self.captured.done():
            self.captured.set_result(None)
        return header

    def _failed(self, job: SnapshotJob, error: BaseException) -> CheckpointError:
        """A capture or seal that failed: the plan's `on_error` is told (on this thread),
        and the error the caller's wait raises is made."""
        if job.on_error is not None:
            with contextlib.suppress(Exception):  # the copy's error is the report
                job.on_error(error)
        failed = CheckpointError(f"snapshot of step {self.step} failed: {error}")
        failed.__cause__ = error
        return failed

    @property
    def slot(self) -> int | None:
        return self.job.slot if self.job is not None else None

    @property
    def seconds(self) -> float:
        """Time the snapshot took after the plan: its capture and its seal."""
        return self.capture_s + self.seal_s

    def wait(self) -> None:
        """Blocks until captured; raises what the plan or the capture raised (a failed
        plan, e.g. a peer lost in its collective, as it is)."""
        self.captured.result()

    def wait_sealed(self) -> SnapshotHeader:
        """Blocks until sealed: the header published. Raises what `wait` raises, or what
        the seal met."""
        self.captured.result()
        return self.sealed.result()

    @property
    def copy_s(self) -> float:
        """The copy's own time (the capture's, without the one-time reservation of the
        slots' memory, which made a first snapshot look ten times slower)."""
        return self.phases.wall.get("copy", 0.0)

    @property
    def copy_Bps(self) -> float | None:
        """The capture's bandwidth (None before it is done)."""
        return self.nbytes / self.copy_s if self.captured.done() and self.copy_s else None
