"""The snapshot thread of one rank: a plan, then a copy into a slot, behind forward and
backward.

    worker = SnapshotWorker()
    handle = SnapshotHandle(worker, store, step, plan, ready)   # returns at once
    ...                                                         # forward, backward
    header = handle.wait()     # blocks until the copy is done: right before optimizer.step()

The copy releases the GIL (tensor copies, the digest), so it overlaps the next forward
and backward. `plan` decides what to copy and where; it may run collectives of its own
(on the side group: see `moc.checkpoint.dist` for why that is safe on this thread).
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
from moc.checkpoint.twolevel.slots import SnapshotHeader, SnapshotStore

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
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]
    sizing: dict[str, torch.Tensor] | None = None
    """The whole state the slot is laid out for (default: `tensors`)."""
    on_done: Callable[[SnapshotHeader], None] | None = None
    """Called on the snapshot thread once the snapshot is complete."""
    on_error: Callable[[BaseException], None] | None = None
    """Called on the snapshot thread if the copy fails (before wait() raises it)."""
    outcome: Any = None
    """What the plan decided that the caller reports (read after `wait()`)."""


class SnapshotHandle:
    """A snapshot being taken on the worker's thread: first `plan` decides what to copy
    and where (it may run collectives of its own), then the copy.

    Both run behind the next forward and backward pass, so deciding costs training no
    more than copying: the caller pays for handing the work over, and for waiting in
    `wait()` only when the two together outlast the window. The fields are written by
    the worker's thread and read by the caller only after `wait()`.
    """

    def __init__(self, worker: SnapshotWorker, store: SnapshotStore, step: int,
                 plan: Callable[[], SnapshotJob], ready: Any = None) -> None:
        """`ready`: a CUDA event recorded on the training stream when the checkpoint was
        requested; the copy waits for it (the state is final once the work queued before
        it is done)."""
        self.step = step
        self.job: SnapshotJob | None = None
        """The plan's decision (None until it is made, or if it failed)."""
        self.plan_s = 0.0
        """Time the plan took, before the copy started."""
        self.seconds = 0.0
        """Time the snapshot took after the plan: reserving memory (the first time),
        the copy and its checksums, the header."""
        self.phases = Phases()
        """Where the plan's and the snapshot's time went, wall and CPU ("plan",
        "reserve", "copy", "checksum", "header": `SnapshotStore.write`)."""
        self.nbytes = 0
        """Bytes copied."""
        self.header: SnapshotHeader | None = None
        self.replica: Future | None = None
        """This rank's replica round of the snapshot, across nodes (`Snapshotter.stage`)."""
        self._error: BaseException | None = None

        def run() -> None:
            t0 = time.perf_counter()
            try:
                with self.phases("plan"):
                    job = plan()
            except BaseException as e:  # re-raised as it is by wait()
                self._error = e
                return
            self.job = job
            t1 = time.perf_counter()
            self.plan_s = t1 - t0
            try:
                self.header = store.write(job.slot, step, job.tensors, job.meta, ready,
                                          job.sizing, self.phases)
                self.seconds = time.perf_counter() - t1
                self.nbytes = sum(t.numel() * t.element_size() for t in job.tensors.values())
                if job.on_done is not None:
                    job.on_done(self.header)
            except BaseException as e:  # re-raised by wait() on the caller's thread
                self._error = e
                self.seconds = time.perf_counter() - t1
                if job.on_error is not None:
                    with contextlib.suppress(Exception):  # the copy's error is the report
                        job.on_error(e)

        self._future = worker.submit(run)

    @property
    def slot(self) -> int | None:
        return self.job.slot if self.job is not None else None

    def wait(self) -> SnapshotHeader:
        """Blocks until the copy is complete; raises what the plan or the copy raised
        (a failed plan, e.g. a peer lost in its collective, as it is)."""
        self._future.result()  # run() keeps its own errors: this only waits
        if self._error is not None:
            if self.job is None:  # the plan failed
                raise self._error
            raise CheckpointError(f"snapshot of step {self.step} failed: {self._error}"
                                  ) from self._error
        assert self.header is not None
        return self.header

    @property
    def copy_s(self) -> float:
        """The copy's own time, checksums included, without the one-time reservation
        of the slots' memory (which made a first snapshot look ten times slower)."""
        return self.phases.wall.get("copy", 0.0) + self.phases.wall.get("checksum", 0.0)

    @property
    def copy_Bps(self) -> float | None:
        """The copy's bandwidth, checksums included (None before it is done)."""
        return self.nbytes / self.copy_s if self.header is not None and self.copy_s else None
