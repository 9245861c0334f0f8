"""Preemption: SIGTERM or SIGINT stops training at the next step boundary, every rank at the
same one, with a final checkpoint; a second signal, or the grace period, ends it at once.

    preemption = moc.Preemption(grace_s=30)        # main thread, before the loop
    for step in range(start + 1, steps + 1):
        train_step()
        stop = preemption.should_stop()             # every rank, every step: agreed
        ckpt.maybe_save(step, extra_state=..., final=stop or step == steps)
        if stop:
            break
    ckpt.close()                                    # the final checkpoint is durable
    preemption.close()

Slurm, Kubernetes and cloud spot reclaims send SIGTERM, then SIGKILL after a grace period
(Kubernetes: 30 s by default). Without a handler the signal kills the process where it
stands and every step since the last checkpoint is lost; with Python's default SIGINT
handler a KeyboardInterrupt unwinds each rank from wherever it was, mid-collective.

The handler here only records the signal. The ranks agree on it at the step boundary,
where `should_stop()` is called by every rank: the signal reaches the ranks at different
moments (Slurm signals every task, torchrun forwards it to its workers), so one rank's
own flag is not enough; a rank that stopped alone would leave the others waiting in the
next collective. Agreement costs no wait on ordinary steps: each call posts an
asynchronous all-reduce of the ranks' flags on a gloo group of its own and reads the
result of the one posted at the previous call, long finished by then. So a signal is
acted on one step after the step boundary that first saw it, by every rank at the same
step.

Forced exits (`os._exit`, after one line on stderr; what is durable stays so, and a
snapshot in shared memory stays for a restart to resume from):
- a second signal, more than `REPEAT_S` after the first (a signal delivered twice at once,
  to the process group by a terminal and again by torchrun, is one request);
- the grace period (`grace_s` from the first signal) running out before `close()`.
The exit status is 128 + the signal's number, as a shell reports a process the signal
killed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

REPEAT_S = 2.0
"""A signal within this long of the first is the same request delivered twice (Ctrl-C
reaches every process of the terminal's process group, and torchrun then forwards it to
its workers): only a later one forces the exit."""
DEFAULT_GRACE_S = 30.0
"""Kubernetes' default terminationGracePeriodSeconds, and torchrun's shutdown timeout:
the time between SIGTERM and SIGKILL most schedulers give."""
SIGNALS = (signal.SIGTERM, signal.SIGINT)
_UNSET = object()


class Preemption:
    """Catches SIGTERM and SIGINT (`signals`) and tells every rank, at the same step
    boundary, that training must stop (`should_stop`). Owner: the main thread, which
    makes it (signal handlers are the main thread's) and calls `should_stop`.

    `groups`: the ranks that agree (`moc.ParallelGroups`, or None: the default process
    group when one is initialised, else this process alone). It may be made before the
    process group is, to catch signals from the start: its first `should_stop` makes
    its own gloo group (collectively). `grace_s`: how long after the first signal the
    process may take to finish (None: no limit; the scheduler's SIGKILL then decides)."""

    def __init__(self, groups: Any = None, *, grace_s: float | None = DEFAULT_GRACE_S,
                 signals: tuple[signal.Signals, ...] = SIGNALS) -> None:
        if grace_s is not None and not grace_s > 0:
            raise ValueError(f"grace_s must be > 0 seconds (or None: no limit), got "
                             f"{grace_s!r}")
        if threading.current_thread() is not threading.main_thread():
            raise ValueError("Preemption must be made on the main thread: only it can "
                             "catch signals")
        self.grace_s = grace_s
        self.received: signal.Signals | None = None
        """The first signal this process received (None: none yet)."""
        self.agreed: signal.Signals | None = None
        """The signal every rank stopped for, once `should_stop` said so (another rank's,
        when this one received none)."""
        self._at: float | None = None
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._groups = groups
        self._group: Any = _UNSET
        self._bufs = [torch.zeros(1, dtype=torch.int64) for _ in range(2)]
        self._work: Any = None
        self._calls = 0
        self._previous = {s: signal.signal(s, self._handle) for s in signals}

    @property
    def signalled(self) -> bool:
        """Whether this process received a signal (not agreed: `should_stop` is)."""
        return self.received is not None

    def should_stop(self) -> bool:
        """Whether training must stop now: True on every rank at the same call once any
        rank received a signal (one call after the first that saw it). Collective:
        every rank calls it once per step, at the same place in the loop."""
        mine = int(self.received) if self.received is not None else 0
        if self._group is _UNSET:
            self._group = _agreement_group(self._groups)
        if self._group is None:
            self.agreed = self.received
            return bool(mine)
        prev, self._work = self._work, None
        agreed = 0
        if prev is not None:
            prev.wait()  # posted a step ago: done long since
            agreed = int(self._bufs[(self._calls - 1) % 2].item())
        buf = self._bufs[self._calls % 2]
        buf.fill_(mine)
        # The largest signal number any rank received (0: none): the same on every rank.
        work = dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        self._calls += 1
        if agreed:
            work.wait()  # every rank posted this one too: leave nothing in flight
            self.agreed = signal.Signals(agreed)
        else:
            self._work = work
        return bool(agreed)

    def regroup(self) -> None:
        """The process groups were rebuilt (in-job recovery): the agreement starts over
        on a group of the new ones, made at the next `should_stop` (collectively). The
        round in flight on the old group is dropped: a signal it carried is still in
        `received` and goes into the next round."""
        self._group, self._work, self._calls = _UNSET, None, 0

    def settle(self) -> None:
        """Finish the agreement round in flight (every rank posted it at its last
        `should_stop`): call it before the process groups are destroyed. Signals are
        still caught: a process that is about to exit by itself need not be killed by
        one (torchrun signals the other workers when one exits with a signal's
        status)."""
        if self._work is not None:
            with contextlib.suppress(RuntimeError):  # a peer gone: nothing to wait for
                self._work.wait()
            self._work = None

    def close(self) -> None:
        """`settle`, put the previous signal handlers back and cancel the grace period:
        the job is finishing by itself. Idempotent."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        self.settle()
        if self._group not in (None, _UNSET) and dist.is_initialized():
            # Its own group goes with it: left to the interpreter's exit, a gloo group
            # destroyed after torch.distributed.tensor was imported aborted the process
            # ("terminate called without an active exception", exit -6).
            with contextlib.suppress(Exception):
                dist.destroy_process_group(self._group)
            self._group = None  # closed: no more agreement rounds
        if threading.current_thread() is threading.main_thread():
            for s, handler in self._previous.items():
                signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    def leave_now(self, why: str) -> None:
        """End the process at once for the signal received (its exit status), with one
        line: where no final checkpoint can be taken (the ranks are not all there, as
        while in-job recovery re-forms the job), waiting out the grace period would only
        end in its untrue line."""
        assert self.received is not None
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
        _exit(self.received, why)

    # -- the signal's side -----------------------------------------------------------------

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        """The signal handler (main thread, between two bytecodes): record, never raise."""
        sig = signal.Signals(signum)
        now = time.monotonic()
        if self.received is None:
            self.received, self._at = sig, now
            if self.grace_s is not None:
                with self._lock:
                    self._timer = threading.Timer(self.grace_s, self._grace_over)
                    self._timer.daemon = True
                    self._timer.start()
            return
        assert self._at is not None
        if now - self._at > REPEAT_S:
            _exit(sig, f"{sig.name} again: exiting at once, without a final checkpoint; "
                       "what is already durable stays so")

    def _grace_over(self) -> None:
        assert self.received is not None
        _exit(self.received, f"the grace period ({self.grace_s:g} s after "
                             f"{self.received.name}) ran out before the final checkpoint "
                             "was durable: exiting; the newest durable checkpoint stays")


def exit_status(sig: signal.Signals) -> int:
    """The exit status of a process stopped by `sig`: 128 + its number, as shells report."""
    return 128 + int(sig)


def _exit(sig: signal.Signals, why: str) -> None:
    """Leave now: one line on stderr, no unwinding (a rank may be inside a collective that
    will never complete), nothing of Python's own teardown."""
    rank = os.environ.get("RANK")
    with contextlib.suppress(Exception):  # a closed stdout or stderr: leave all the same
        sys.stderr.write(f"moc: {'rank ' + rank + ': ' if rank else ''}{why}\n")
        sys.stderr.flush()
        sys.stdout.flush()
    os._exit(exit_status(sig))


def _agreement_group(groups: Any) -> Any:
    """A gloo group of every rank, for the flags alone (None: one process). Its own
    group: the checkpoint's side group carries the snapshot thread's collectives, and two
    threads' collectives on one group could pair up differently on different ranks."""
    if groups is not None and not getattr(groups, "distributed", False):
        return None
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    return dist.new_group(backend="gloo")
