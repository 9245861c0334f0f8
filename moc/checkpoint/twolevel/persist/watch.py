"""A node leader's watch over its own persist process: stopped or hung, it is killed (and
then replaced, `PersistClient.restart`), as the rank host kills and replaces a training
process whose heartbeats stop (`moc.train.host`).

    watch = PersistWatch()
    watch.sent(step)               # a Persist went to the process: its clock starts
    watch.answered(step, ok)       # its Done came back (an ok one is timed)
    why = watch.verdict(pid)       # None, or why the process must be killed now
    watch.replaced()               # it is gone (killed, or a new one serves): its
                                   # persists in flight and sightings go

Before this watch (issue 40), a persist process stopped by SIGSTOP went unnoticed: with
the "skip" policy every later checkpoint skipped its persist, storage stayed where it
was, and `close()` waited PERSIST_TIMEOUT_S for an answer that could not come.

Two faults, two rules, both read from outside the process (no heartbeat message: a
heartbeat thread of the process would go on beating while its writer hangs):
- stopped: the kernel says so (state T in /proc/<pid>/stat, a SIGSTOP or SIGTSTP) at
  looks STOPPED_S apart. Nothing it was asked will be answered until someone resumes
  it, and nobody will. A process a debugger holds (state t) is left to the next rule.
- hung: a persist in flight with no answer for the hang limit (`limit`): HANG_FACTOR
  times the longest of the last HANG_WINDOW persists it answered (the time from the
  request to its answer, snapshot included), at least HANG_FLOOR_S; PERSIST_TIMEOUT_S
  before any was timed. The limit doubles for each process replaced as hung in a row:
  a store that does not answer (an outage) hangs every new process too, and should cost
  a few restarts, not one per limit.

The looks come from the leader's own calls: rank 0 at every step while a persist is in
flight (`drain_completed` polls), every leader at every plan's exchange, and every
0.2 s while training waits for a persist (a final save, flush, close, the "wait"
policy). So a stopped process is found within STOPPED_S plus one step, and a final
checkpoint, or `close()`, waits STOPPED_S at most for one, never PERSIST_TIMEOUT_S.

Owner: the leader's thread that holds the engine's plan lock (as `PersistClient.receive`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from moc.checkpoint.twolevel.persist.protocol import PERSIST_TIMEOUT_S

STOPPED_S = 5.0
"""How long a persist process may be seen stopped before it is killed. A SIGSTOP and
SIGCONT pair from a tool lasts less (a job suspender stops training too, which then
looks at nothing); next to a checkpoint interval, 5 s of a persist is little."""
HANG_FACTOR = 10.0
"""The hang limit, in the longest recent persists: the rank host's factor on step times."""
HANG_FLOOR_S = 120.0
"""The hang limit's floor. A slow store is no fault of the process, and a new one would
wait for the same store: object stores pause for a minute (this project's outage drill
stops one for 60 s) without a persist being lost."""
HANG_WINDOW = 8
"""How many answered persists the hang limit is taken over."""
LOOK_S = 0.2
"""How often a leader that waits for its persist process looks at it."""


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of process `pid` (R, S, D, T, t, Z, ...); None where
    /proc does not say (another OS, the process gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # "pid (comm) S ...": the name may hold spaces and parentheses; the state follows the
    # last ")".
    rest = stat[stat.rfind(b")") + 1:].split()
    return rest[0].decode() if rest else None


class PersistWatch:
    """What a leader has seen of its persist process (see the module docstring).
    `patience` scales the hang limit: node 0's process waits for every other node's part
    before it answers, so across nodes its leader gives it twice as long, and another
    node's hung process is found by its own leader first."""

    def __init__(self, patience: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 state: Callable[[int], str | None] = process_state) -> None:
        self.patience, self.clock, self.state = patience, clock, state
        self._sent: dict[int, float] = {}  # steps asked for and not answered -> when
        self._took: deque[float] = deque(maxlen=HANG_WINDOW)  # answered persists' times
        self._stopped_at: float | None = None  # first look that saw it stopped
        self._hung_in_row = 0  # processes replaced as hung since a persist was answered

    def sent(self, step: int) -> None:
        """A Persist of `step` went to the process."""
        self._sent.setdefault(step, self.clock())

    def answered(self, step: int, ok: bool) -> None:
        """The process answered the persist of `step` (an older one unanswered never will
        be: it runs them in order). An ok answer is timed, and ends a run of hung ones."""
        sent = self._sent.pop(step, None)
        for old in [s for s in self._sent if s < step]:
            del self._sent[old]
        if ok and sent is not None:
            self._took.append(self.clock() - sent)
            self._hung_in_row = 0

    def replaced(self) -> None:
        """The process is gone or a new one serves: nothing is in flight on it, nothing
        of it was seen (the count of hung ones in a row stays)."""
        self._sent.clear()
        self._stopped_at = None

    @property
    def stopped(self) -> bool:
        """Whether the last look saw the process stopped."""
        return self._stopped_at is not None

    def limit(self) -> float:
        """Seconds a persist may go unanswered before its process counts as hung."""
        base = (max(HANG_FLOOR_S, HANG_FACTOR * max(self._took)) if self._took
                else PERSIST_TIMEOUT_S)
        return base * self.patience * 2 ** self._hung_in_row

    def verdict(self, pid: int) -> str | None:
        """Look at process `pid`: why it must be killed now (None: it need not). A
        verdict is acted on: the caller kills the process and, later, replaces it."""
        now = self.clock()
        if self.state(pid) == "T":
            if self._stopped_at is None:
                self._stopped_at = now
            if now - self._stopped_at >= STOPPED_S:
                return f"stopped (SIGSTOP) for {now - self._stopped_at:.1f} s at least"
        else:
            self._stopped_at = None
        if self._sent:
            step = min(self._sent)
            waited, limit = now - self._sent[step], self.limit()
            if waited > limit:
                self._hung_in_row += 1
                return (f"no answer to the persist of step {step} in {waited:.0f} s, past "
                        f"the hang limit of {limit:.0f} s")
        return None
