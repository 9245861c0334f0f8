"""In-job recovery, a training process's side: the job's membership by generations, and
the heartbeat its rank host watches (`moc.train.host`).

With `moc train --recovery in-job` torchrun does not start the training processes: it
starts one rank host per rank, and each host starts its training process (and, with
`--spares 1`, a standby one). A fault then never reaches torchrun, so torchrun never
tears the job down; instead:

    a rank dies (SIGKILL, a node lost) or hangs (its host sees no heartbeat, or no step
    while it is not waiting in a collective, for the hang timeout, and SIGKILLs it)
      -> its host moves the job to generation g + 1 in the job's store and starts the
         replacement (or wakes the standby), which joins generation g + 1
      -> every survivor's next collective fails (the dead peer's sockets are closed);
         it destroys its process groups (closing its own, so that survivors blocked on
         it fail too), moves to generation g + 1 as well and waits there
      -> once all W ranks are members of g + 1: new process groups (a prefix of the store
         per generation, so no stale address of g is ever read), the same model and
         optimizer rebound to them, a new checkpoint engine, and a restore: the survivors
         from their own node's memory, the newcomer from its node's memory, a peer's
         replica or storage.

The store is the one torchrun's rendezvous gave the job (MASTER_ADDR:MASTER_PORT),
served by the agent on one node and by rank 0's host across simulated nodes: never by
a training process, which may die. `Membership` is this process's view of it; the
heartbeat is one short line every `HEARTBEAT_S` on a pipe to its host, written by a
thread that reads only what the loop already keeps (its step): nothing is added to a
training step.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from moc.topology import COLLECTIVE_TIMEOUT, restart_count

ENV_FD = "MOC_INJOB_FD"
"""The heartbeat pipe's file descriptor, set by the host (absent: not in-job)."""
ENV_GEN = "MOC_INJOB_GEN"
"""The generation a new training process joins."""
ENV_STANDBY = "MOC_INJOB_STANDBY"
"""Set on a spare: it waits, imported, for its host's word before it starts."""
ENV_PRESTART = "MOC_INJOB_PRESTART"
"""Set when a node leader keeps a persist process started ahead (two-level engine)."""
HEARTBEAT_S = 0.1
FORM_POLL_S = 0.005
FORM_TIMEOUT_S = 300.0
"""How long a generation may take to gather every rank (a replacement's start-up and
its restore included) before the members give up (exit 1: torchrun's restart)."""
PREFIX = "moc/injob"
STEP_WINDOW = 20
"""Step times the heartbeat's median is taken over."""

_LOST = re.compile(r"Connection (closed|reset)|Broken pipe|Socket Timeout|"
                   r"Timed out waiting|connectFullMesh|Read error|Write error")


def lost_peer(error: BaseException | None) -> bool:
    """Whether `error` means a peer is gone: gloo's broken or refused connections and
    its timeouts, raised by a collective or by a checkpoint whose collective met one
    (the cause, or the message an engine's agreed error carries)."""
    seen = 0
    while error is not None and seen < 10:
        if (isinstance(error, RuntimeError | OSError) or type(error).__name__.endswith(
                "CheckpointError")) and _LOST.search(str(error)):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def enabled() -> bool:
    """Whether this process runs under a rank host (`moc train --recovery in-job`)."""
    return ENV_FD in os.environ


def job_store(timeout: datetime.timedelta = COLLECTIVE_TIMEOUT) -> dist.Store:
    """A client of the job's store (its host or torchrun's agent serves it), prefixed by
    torchrun's restart count when the agent's store is shared across restarts."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timeout, wait_for_workers=False)
    return dist.PrefixStore(f"{PREFIX}/attempt-{restart_count()}", store)


def generation(store: dist.Store) -> int:
    """The job's current generation (0 until a fault moved it)."""
    store.compare_set("gen", "", "0")  # the first reader sets it
    return int(store.get("gen"))


def next_generation(store: dist.Store, seen: int) -> int:
    """Move the job past generation `seen` (at most once, whoever asks first: a host that
    lost its process, or a survivor whose collective failed); the generation to join."""
    generation(store)  # a compare-and-set on a missing key sets nothing
    store.compare_set("gen", str(seen), str(seen + 1))
    return int(store.get("gen"))


class Membership:
    """This training process's membership of the job: the generation it is in, the
    process groups of that generation, and its heartbeat to its host. Owner: the
    training loop's thread; the heartbeat thread only reads `step`, `phase`, `gen` and
    the step times."""

    def __init__(self, rank: int, world: int, step: Callable[[], int]) -> None:
        self.rank, self.world = rank, world
        self.store = job_store()
        self.gen = int(os.environ.get(ENV_GEN, "0"))
        self.phase = "start"
        """"train" while steps are expected to follow each other; anything else (start,
        restore, validation, close) is watched for liveness only."""
        self.step_times: list[float] = []
        self.trained = 0
        """Steps done since this process last joined a generation."""
        self._step = step
        self._pipe = os.fdopen(int(os.environ[ENV_FD]), "w", buffering=1)
        threading.Thread(target=self._beat, name="moc-injob-heartbeat", daemon=True).start()

    # -- the process groups --------------------------------------------------------------

    def join(self, backend: str) -> None:
        """Enter the current generation: wait until every rank is a member of it (moving
        on with the job when a later fault moved it further), then start the default
        process group on its own prefix of the store."""
        deadline = time.monotonic() + FORM_TIMEOUT_S
        while True:
            members = gen_key(self.gen)
            self.store.set(f"{members}/member/{self.rank}", str(os.getpid()))
            keys = [f"{members}/member/{r}" for r in range(self.world)]
            while not self.store.check(keys):
                if generation(self.store) > self.gen:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"in-job recovery: generation {self.gen} did not gather its "
                        f"{self.world} ranks within {FORM_TIMEOUT_S:.0f}s")
                time.sleep(FORM_POLL_S)
            else:
                break
            self.gen = generation(self.store)
        dist.init_process_group(
            backend, store=dist.PrefixStore(f"{members}/pg", self.store), rank=self.rank,
            world_size=self.world, timeout=COLLECTIVE_TIMEOUT)
        self.trained = 0

    def leave(self) -> int:
        """After a failed collective: destroy every process group (closing this rank's
        connections, so that a survivor blocked on this one fails too) and move the job
        to the next generation; the generation to join."""
        dist.destroy_process_group()
        self.gen = next_generation(self.store, self.gen)
        return self.gen

    def replaced(self) -> list[int]:
        """The ranks whose hosts started a new process for this generation."""
        keys = [f"{gen_key(self.gen)}/replaced/{r}" for r in range(self.world)]
        return [r for r, k in enumerate(keys) if self.store.check([k])]

    # -- the heartbeat -------------------------------------------------------------------

    def stepped(self, seconds: float) -> bool:
        """A training step took `seconds` (its time sets the host's hang timeout);
        whether it was the first since this process joined its generation: training is
        back, and what a recovery used up may be made again in the background (a
        prestarted persist process; the host's spare, when it hears of it)."""
        self.step_times.append(seconds)
        if len(self.step_times) > STEP_WINDOW:
            del self.step_times[0]
        self.trained += 1
        return self.trained == 1

    def _beat(self) -> None:
        while True:
            times = self.step_times
            line = {"gen": self.gen, "step": self._step(), "phase": self.phase,
                    "waiting": self._waiting(), "trained": self.trained,
                    "step_s": statistics.median(times) if times else None}
            try:
                self._pipe.write(json.dumps(line) + "\n")
            except (OSError, ValueError):  # the host is gone: so is the job
                os._exit(1)
            time.sleep(HEARTBEAT_S)

    @staticmethod
    def _waiting() -> bool:
        """Whether a thread of this process is inside torch.distributed now, waiting for
        its peers: the training thread in a collective, or the snapshot thread in a
        plan's while the training thread waits for it. A stall then is another rank's,
        not this one's."""
        for frame in sys._current_frames().values():
            depth = 0
            while frame is not None and depth < 200:
                if "torch/distributed" in frame.f_code.co_filename:
                    return True
                frame, depth = frame.f_back, depth + 1
        return False


def gen_key(gen: int) -> str:
    """The store's keys of generation `gen` start with this."""
    return f"gen-{gen}"


def is_standby() -> bool:
    """Whether this process is a spare, to wait for its host's word (`standby_wait`)."""
    return bool(os.environ.get(ENV_STANDBY))


def standby_wait() -> dict[str, Any]:
    """A spare: block until its host's word (a JSON line on stdin: the generation to
    join) and put it in the environment; exit quietly when the host ends it unused
    (EOF)."""
    line = sys.stdin.readline()
    if not line:
        os._exit(0)
    word = json.loads(line)
    os.environ[ENV_GEN] = str(word["gen"])
    return word
