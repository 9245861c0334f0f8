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

REJOIN_STATUS = 75
"""The exit status of a training process that lost a peer while it started (its Trainer
half made cannot rejoin by itself): its host starts it again, as it would a dead one."""
FINISHED = "finished"
"""Set (in the round's namespace) by rank 0's host when rank 0 ended its training with
0: the job is complete, and a process still gathering a generation has nothing to do."""
ENV_FD = "MOC_INJOB_FD"
"""The heartbeat pipe's file descriptor, set by the host (absent: not in-job)."""
ENV_GEN = "MOC_INJOB_GEN"
"""The generation a new training process joins."""
ENV_STANDBY = "MOC_INJOB_STANDBY"
"""Set on a spare: it waits, imported, for its host's word before it starts."""
ENV_PRESTART = "MOC_INJOB_PRESTART"
"""Set when a node leader keeps a persist process started ahead (two-level engine)."""
ENV_NS = "MOC_INJOB_NS"
"""The job's namespace in its store, agreed by every host of a torchrun round (the host
sets it for its training processes: `moc.train.host.agree_namespace`)."""
ENV_STORE = "MOC_JOB_STORE"
"""`host:port` of a store that outlives any one node (`moc train --nodes` serves one in
its launcher); absent: the round's store, torchrun's MASTER_ADDR:MASTER_PORT."""
HEARTBEAT_S = 0.1
FORM_POLL_S = 0.005
STRANDED_EVERY = 5
"""Every this many heartbeats, a process checks whether the job left it behind."""
FORM_FLOOR_S = 5.0
FORM_FACTOR = 10.0
"""Once every rank of a generation is a member, their process group forms within
max(FORM_FLOOR_S, FORM_FACTOR x the job's median step time), doubled at each failed try
in a row: a member that died or froze meanwhile costs one more generation, not the
store's 300 s wait (the hang timeout's rule: `moc.train.host`)."""
FORM_REPORT_S = 30.0
"""While a generation waits for ranks (a replacement starting, a lost machine's
successor), who is missing is said this often. The wait itself has no end: a job is
never given up for a rank that may still come."""
PREFIX = "moc/injob"
STEP_WINDOW = 20
"""Step times the heartbeat's median is taken over."""

_LOST = re.compile(r"Connection (closed|reset|refused)|Broken pipe|Socket Timeout|"
                   r"Timed out waiting|connectFullMesh|Read error|Write error|"
                   r"wait timeout|failed to connect")


def lost_peer(error: BaseException | None) -> bool:
    """Whether `error` means a peer is gone: gloo's broken or refused connections and
    its timeouts, raised by a collective or by a checkpoint whose collective met one
    (the cause, or the message an engine's agreed error carries), and the store's (a
    `DistStoreError` wait timeout: a rendezvous whose peer died before it wrote its key;
    a `DistNetworkError`: a store whose server is gone)."""
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


def store_address() -> tuple[str, int]:
    """Where the job's store is: $MOC_JOB_STORE (a store that outlives any node), else
    the torchrun round's (MASTER_ADDR:MASTER_PORT)."""
    address = os.environ.get(ENV_STORE)
    if address:
        host, _, port = address.rpartition(":")
        return host, int(port)
    return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])


def connect(timeout: datetime.timedelta = COLLECTIVE_TIMEOUT) -> dist.TCPStore:
    """A new client of the job's store, unprefixed."""
    host, port = store_address()
    return dist.TCPStore(host, port, is_master=False, timeout=timeout,
                         wait_for_workers=False)


def namespace() -> str:
    """The job's keys in its store start with this: the namespace every host of this
    torchrun round agreed on (ENV_NS), else, outside a host (a test), torchrun's restart
    count."""
    return f"{PREFIX}/{os.environ.get(ENV_NS) or f'attempt-{restart_count()}'}"


def job_store(timeout: datetime.timedelta = COLLECTIVE_TIMEOUT) -> dist.Store:
    """A client of the job's store, in the job's namespace."""
    return dist.PrefixStore(namespace(), connect(timeout))


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
        self.job_step_s = (float(self.store.get("step_s")) if self.store.check(["step_s"])
                           else None)
        """The job's step time, as its survivors left it (None: no fault yet)."""
        self._step = step
        self._pipe = os.fdopen(int(os.environ[ENV_FD]), "w", buffering=1)
        self._lock = threading.Lock()
        self._watch: dist.Store | None = None
        """The heartbeat thread's own client of the job's store (`_stranded`)."""
        threading.Thread(target=self._beat, name="moc-injob-heartbeat", daemon=True).start()

    # -- the process groups --------------------------------------------------------------

    def join(self, backend: str, stopping: Callable[[], None] | None = None) -> None:
        """Enter the current generation: wait until every rank is a member of it (moving
        on with the job when a later fault moved it further), then start the default
        process group on its own prefix of the store. A member lost while the group
        forms (its host moves the job on; one frozen is found by the form timeout) costs
        one more generation, never the job. `stopping`: called while waiting; it ends the
        process when a stop was requested (no final checkpoint without every rank)."""
        tries = 0
        while True:
            self._gather(stopping)
            try:
                self._form(backend, tries)
                break
            except Exception as e:
                if not lost_peer(e):
                    raise
                if dist.is_initialized():
                    dist.destroy_process_group()
                self._say(f"generation {self.gen} did not form ({first_line(e)}); "
                          "moving on")
                self.gen = next_generation(self.store, self.gen)
                tries += 1
        self.trained = 0

    def _gather(self, stopping: Callable[[], None] | None) -> None:
        """Until every rank is a member of `gen`, following the job's generation."""
        report_at = time.monotonic() + FORM_REPORT_S
        while True:
            members = gen_key(self.gen)
            self.store.set(f"{members}/member/{self.rank}", str(os.getpid()))
            keys = [f"{members}/member/{r}" for r in range(self.world)]
            while not self.store.check(keys):
                if generation(self.store) > self.gen:
                    break
                if self.store.check([FINISHED]):  # rank 0 ended it: every rank's work is done
                    self._say(f"the job finished while generation {self.gen} gathered; "
                              "nothing left to do")
                    os._exit(0)
                if stopping is not None:
                    stopping()
                if time.monotonic() > report_at:
                    missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
                    self._say(f"generation {self.gen} waits for rank(s) {missing}")
                    report_at += FORM_REPORT_S
                time.sleep(FORM_POLL_S)
            else:
                return
            self.gen = generation(self.store)

    def _form(self, backend: str, tries: int) -> None:
        """The generation's process group, on a store client whose waits end after the
        form timeout (gloo's rendezvous waits on the store for every member's address:
        a member lost after it joined would otherwise hold the others for the store's
        300 s); the collectives then get the job's usual timeout."""
        limit = datetime.timedelta(seconds=self.form_timeout_s() * 2 ** min(tries, 4))
        client = connect(limit)
        _forget_failed_groups()
        dist.init_process_group(
            backend, store=dist.PrefixStore(f"{namespace()}/{gen_key(self.gen)}/pg", client),
            rank=self.rank, world_size=self.world, timeout=limit)
        client.set_timeout(COLLECTIVE_TIMEOUT)
        if hasattr(dist.distributed_c10d, "_set_pg_timeout"):
            dist.distributed_c10d._set_pg_timeout(COLLECTIVE_TIMEOUT)

    def form_timeout_s(self) -> float:
        """How long a gathered generation's process group may take to form."""
        step_s = self.step_s()
        return max(FORM_FLOOR_S, FORM_FACTOR * step_s) if step_s else FORM_FLOOR_S

    def step_s(self) -> float | None:
        """The median step time: this process's, else the one the job's last survivors
        left in the store (a replacement has timed none yet)."""
        if self.step_times:
            return statistics.median(self.step_times)
        return self.job_step_s

    def leave(self) -> int:
        """After a failed collective: destroy every process group (closing this rank's
        connections, so that a survivor blocked on this one fails too) and move the job
        to the next generation; the generation to join. The step time goes into the
        store, for the replacement's form and hang timeouts."""
        if dist.is_initialized():  # not after a failed rejoin that had destroyed them
            dist.destroy_process_group()
        if self.step_times:
            self.store.set("step_s", str(statistics.median(self.step_times)))
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

    def done(self) -> None:
        """Training is over and the engine closed (the final checkpoint durable, the
        groups gone): told to the host at once, so that a death from here on (a C++
        destructor's abort at exit) ends this rank as finished instead of starting a
        newcomer that would wait for peers who are gone."""
        self.phase = "done"
        self._tell()

    def _beat(self) -> None:
        behind_since: float | None = None
        beats = 0
        while True:
            self._tell()
            beats += 1
            if beats % STRANDED_EVERY == 0:
                behind_since = self._stranded(behind_since)
            time.sleep(HEARTBEAT_S)

    def _stranded(self, behind_since: float | None) -> float | None:
        """End this process when the job moved past its generation and it has not
        followed within twice the form timeout: it is blocked in a wait on a peer that
        died after the generation formed (a collective or a store wait of its rejoin or
        start, which only the store's 300 s would end). Its host starts it again, and
        the newcomer restores from this node's memory. When the job is at its
        generation: None; else since when it is behind."""
        if self.phase == "done":
            return None
        try:
            if self._watch is None:
                self._watch = job_store(datetime.timedelta(seconds=10))
            current = generation(self._watch)
        except Exception:  # the store is unreachable: the training thread will see it
            return behind_since
        if current <= self.gen:
            return None
        now = time.monotonic()
        if behind_since is None:
            return now
        if now - behind_since > 2 * self.form_timeout_s():
            self._say(f"stranded in generation {self.gen} (the job is at {current}) for "
                      f"{now - behind_since:.1f}s, waiting on a peer that is gone; "
                      "starting again")
            os._exit(REJOIN_STATUS)
        return behind_since

    def _tell(self) -> None:
        """One heartbeat line (the heartbeat thread's, and `done`'s on the training
        thread: a lock keeps their lines whole)."""
        line = {"gen": self.gen, "step": self._step(), "phase": self.phase,
                "waiting": self._waiting(), "trained": self.trained,
                "step_s": self.step_s()}
        try:
            with self._lock:
                self._pipe.write(json.dumps(line) + "\n")
        except (OSError, ValueError):  # the host is gone: so is the job
            os._exit(1)

    def _say(self, line: str) -> None:
        print(f"moc train: rank {self.rank}: {line}", file=sys.stderr, flush=True)

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


def _forget_failed_groups() -> None:
    """Number the next default group 0, as in a new process. torch names a group by a
    count of the groups this process made (its keys in the store start with it), and
    only destroying the default group resets it: after an `init_process_group` that
    failed, a retry would be group 1 while a newcomer's is group 0, and the two would
    wait on different keys for ever. A private name of torch's, reached only here."""
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is not None and not dist.is_initialized():
        world.group_count = 0


def first_line(error: BaseException) -> str:
    """What a line on stderr says of `error`: its first sentence, without the source
    location gloo puts first ("[.../pair.cc:553] Connection closed by peer
    [127.0.0.1]:1961. This ..." says "Connection closed by peer [127.0.0.1]:1961")."""
    text = (str(error).splitlines() or [type(error).__name__])[0]
    text = re.sub(r"^\[[^\]]*\.\w+:\d+\]\s*", "", text)
    text = re.split(r"\.\s+(?=[A-Z])", text, maxsplit=1)[0]
    return text[:160] or type(error).__name__


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
    os.environ.update(word.get("env", {}))  # a spare node's: the rank it now is
    return word
