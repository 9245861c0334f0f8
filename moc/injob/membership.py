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
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
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
COLLECTIVE_FLOOR_S = 60.0
COLLECTIVE_FACTOR = 10.0
"""On NCCL, a collective times out after max(COLLECTIVE_FLOOR_S, COLLECTIVE_FACTOR x the
median step time), COLLECTIVE_TIMEOUT before any step was timed (start-up, the restore
and the first step, CUDA's start included). The floor is the host's for a step that
does not come (`moc.train.host.PROGRESS_FLOOR_S`): a checkpoint's first touch of its
memory, a persist under --persist-policy wait, a data loader's stall are pauses a peer
waits through on the device. What the timeout bounds is a fault no host sees, every
process alive and waiting (a network fault): the watchdog aborts, every rank leaves,
and the same processes re-form the next generation. gloo keeps COLLECTIVE_TIMEOUT: a
dead peer's sockets close, and its collectives fail at once."""
NCCL_SETTINGS = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
    "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "1000",
}
"""What an in-job training process on NCCL sets before its first process group, unless
it was given (`nccl_settings`); from torch's ProcessGroupNCCL.cpp:

- ASYNC_ERROR_HANDLING 2 (CleanUpOnly): on a collective's error or timeout the
  watchdog aborts the communicators (a kernel waiting on a dead peer returns) and
  leaves the process alive, its next collective raising "NCCL communicator was
  aborted": a lost peer, and this process rejoins. 1 (TearDown, torchrun's default for
  its workers) and 3 (SkipCleanUp, torch's) end the process instead: every survivor of
  one fault would be replaced (a watchdog that saw the peer's death first ends its
  process ~60 s later, whether it re-formed meanwhile or not). 0 aborts nothing: a
  network fault no host sees would hang the job.
- DUMP_ON_TIMEOUT 0: a watchdog's error writes a dump signal under the store's root key
  (every prefix stripped: the job's store), which every later generation's heartbeat
  monitor would read and answer by ending its process 480 s later
  (TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC).
- WAIT_TIMEOUT_DUMP_MILSEC 1000: after an error the watchdog sleeps 4 x this (60 s by
  default) before it acts, and a process group's destructor joins the watchdog: the
  rejoin of a survivor whose watchdog saw the fault first would wait that long."""

_GLOO_LOST = (r"Connection (closed|reset|refused)|Broken pipe|Socket Timeout|"
              r"Timed out waiting|connectFullMesh|Read error|Write error|"
              r"wait timeout|failed to connect")
_NCCL_LOST = (
    # torch's NCCLComm::getNcclComm (NCCLUtils.cpp): any use of an aborted communicator,
    # by the watchdog (a timeout or an error, TORCH_NCCL_ASYNC_ERROR_HANDLING=2) or by
    # `Membership` (the job moved on); and checkForNCCLErrorsInternal's, a reason set.
    r"NCCL communicator was aborted|NCCL communicator encountered error set by|"
    # WorkNCCL::checkTimeout: the watchdog's timeout, raised by a later wait().
    r"Watchdog caught collective operation timeout|timed out in blocking wait|"
    # getNcclErrorDetailStr and ncclGetErrorString (NCCL's own text) of the two results
    # a peer's death or the network gives; not ncclInvalidUsage, ncclInvalidArgument,
    # ncclInternalError or ncclUnhandledCudaError (a bug, or this device's fault: a
    # re-formed job would meet it again).
    r"ncclRemoteError|remote process exited or there was a network error|"
    r"ncclSystemError|unhandled system error|"
    # A non-blocking communicator's (TORCH_NCCL_USE_COMM_NONBLOCKING) init or call.
    r"NCCL timeout in")
_LOST = re.compile(f"{_GLOO_LOST}|{_NCCL_LOST}")


class PeerLost(RuntimeError):
    """Raised on the training thread by `Membership.check`: the job moved past this
    process's generation while the thread waited on the device, and the heartbeat
    thread aborted its NCCL communicators to free it; what it computed since is void."""


def lost_peer(error: BaseException | None) -> bool:
    """Whether `error` means a peer is gone: gloo's broken or refused connections and
    its timeouts, NCCL's aborted communicators, watchdog timeouts and remote or system
    errors (`_NCCL_LOST`), raised by a collective or by a checkpoint whose collective
    met one (the cause, or the message an engine's agreed error carries), and the
    store's (a `DistStoreError` wait timeout: a rendezvous whose peer died before it
    wrote its key; a `DistNetworkError`: a store whose server is gone). A watchdog that
    ends its process (TORCH_NCCL_ASYNC_ERROR_HANDLING 1 or 3, or its heartbeat monitor)
    raises nothing here: the process dies, and its host replaces it."""
    seen = 0
    while error is not None and seen < 10:
        if isinstance(error, PeerLost):
            return True
        if (isinstance(error, RuntimeError | OSError) or type(error).__name__.endswith(
                "CheckpointError")) and _LOST.search(str(error)):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def enabled() -> bool:
    """Whether this process runs under a rank host (`moc train --recovery in-job`)."""
    return ENV_FD in os.environ


def prestarts() -> bool:
    """Whether this training process keeps a persist process started ahead: a node's
    leader (local rank 0, the only rank that starts one) when its host asks
    (ENV_PRESTART). Another rank's would be an interpreter importing torch beside the
    first steps, never used."""
    return bool(os.environ.get(ENV_PRESTART)) and os.environ.get("LOCAL_RANK", "0") == "0"


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
    process groups of that generation (`Communicators`), and its heartbeat to its host.
    Owner: the training loop's thread; the heartbeat thread only reads `step`, `phase`,
    `gen` and the step times, and on NCCL frees the training thread from a device wait
    on a peer that is gone (`Communicators.free`)."""

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
        self.groups = Communicators(self._say)
        """This generation's process groups (its lock orders `leave` and `free`)."""
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
                self.groups.drop()
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
        300 s); the collectives then get the job's usual timeout (`Communicators.form`)."""
        limit = datetime.timedelta(seconds=self.form_timeout_s() * 2 ** min(tries, 4))
        client = connect(limit)
        self.groups.form(backend, dist.PrefixStore(
            f"{namespace()}/{gen_key(self.gen)}/pg", client), self.rank, self.world, limit,
            self.step_s())
        client.set_timeout(COLLECTIVE_TIMEOUT)

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
        """After a failed collective: drop every process group (gloo: destroyed, closing
        this rank's connections, so that a survivor blocked on this one fails too; NCCL:
        aborted) and move the job to the next generation; the generation to join. The
        step time goes into the store, for the replacement's form and hang timeouts.
        Under the groups' lock: the heartbeat thread frees only the generation it saw."""
        with self.groups.lock:
            self.groups.drop()  # a no-op after a failed rejoin that had dropped them
            if self.step_times:
                self.store.set("step_s", str(statistics.median(self.step_times)))
            self.gen = next_generation(self.store, self.gen)
        return self.gen

    def check(self) -> None:
        """Raise `PeerLost` when the heartbeat thread aborted this generation's NCCL
        communicators (the job moved past it): a value the training thread read since
        (a loss after `.item()`) came from a collective cut short, and is not reported.
        Cheap: one comparison, on every step."""
        if self.groups.aborted == self.gen:
            raise PeerLost(f"the job moved past generation {self.gen} while rank "
                           f"{self.rank} waited on the device: its NCCL communicators "
                           "were aborted")

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
        if self.trained in (1, STEP_WINDOW):  # every group made; the window's median
            self.groups.set_timeout(self.step_s())
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
        """When the job moved past this process's generation: on NCCL, free a training
        thread waiting on the device at once (`Communicators.free`); and on any backend
        end this process if it has not followed within twice the form timeout: it is
        blocked in a wait on a peer that died after the generation formed (a collective
        or a store wait of its rejoin or start, which only the store's 300 s would end,
        or an abort that hangs). Its host starts it again, and the newcomer restores
        from this node's memory. When the job is at its generation: None; else since
        when it is behind."""
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
        self.groups.free(self.gen, current, lambda: self.gen)
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


class Communicators:
    """This process's process groups, as in-job recovery forms, drops and frees them.
    On gloo as they always were: destroyed on a lost peer, whose closed sockets fail
    every collective waiting on it. On NCCL a survivor may instead wait on the device
    (a kernel spinning for a dead peer's data, behind `.item()` or a CUDA event), which
    no exit of the peer ends: the communicators are aborted (ncclCommAbort, made to be
    called from another thread: the kernel sees the abort flag and returns), by the
    training thread when it leaves, or by the heartbeat thread (`free`) once the job
    moved past their generation; `lock` keeps the two from racing. The collectives
    time out after `collective_timeout` of the step time, and the groups form eagerly.
    """

    def __init__(self, say: Callable[[str], None]) -> None:
        self.backend: str | None = None
        """The training backend (None until the first `form`)."""
        self.lock = threading.RLock()
        self.aborted: int | None = None
        """The generation whose NCCL communicators `free` aborted (None: none)."""
        self._say = say

    def form(self, backend: str, store: dist.Store, rank: int, world: int,
             limit: datetime.timedelta, step_s: float | None) -> None:
        """The generation's default group on `store`, formed within `limit`: on NCCL
        with its settings (`nccl_settings`) and eagerly (`form_options`: the
        communicator is built here, where `limit` and a lost member's retry apply, not
        at the first collective), its collectives then timing out after
        `collective_timeout`; on gloo after COLLECTIVE_TIMEOUT, as before."""
        self.backend = backend
        if backend == "nccl":
            os.environ.update(nccl_settings(os.environ))
        _forget_failed_groups()
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=limit, **form_options(backend, local_rank()))
        if backend == "nccl":
            self.set_timeout(step_s)
        elif hasattr(dist.distributed_c10d, "_set_pg_timeout"):
            dist.distributed_c10d._set_pg_timeout(COLLECTIVE_TIMEOUT)

    def set_timeout(self, step_s: float | None) -> None:
        """NCCL: every group's collectives time out after `collective_timeout(step_s)`
        (a subgroup made by `new_group` starts with torch's 10 minutes). On the training
        thread, with the groups made; nothing on gloo."""
        if self.backend == "nccl":
            set_nccl_timeout(live_groups(), collective_timeout(step_s))

    def drop(self) -> None:
        """Every process group gone: gloo's destroyed, as always; NCCL's aborted (a
        destroy would finalize the communicators, waiting for the very collective whose
        peer is gone). An abort that fails leaves this process unable to form again: it
        exits for its host to start it again (REJOIN_STATUS)."""
        with self.lock:
            if not dist.is_initialized():
                return
            if self.backend != "nccl":
                dist.destroy_process_group()
                return
            try:
                dist.distributed_c10d._abort_process_group()
            except Exception as e:
                self._say(f"aborting the NCCL process groups failed ({first_line(e)}); "
                          "starting again")
                os._exit(REJOIN_STATUS)

    def free(self, gen: int, current: int, member_gen: Callable[[], int]) -> None:
        """The heartbeat thread saw the job at generation `current`, past this process's
        `gen`: on NCCL, abort `gen`'s communicators once, on a thread of their own (an
        abort that hangs stops neither the heartbeat nor `_stranded`'s exit), unless
        the training thread left `gen` first (`member_gen`, read under the lock). The
        training thread's wait then returns, `check` raises, and it rejoins."""
        if not should_abort(self.backend, dist.is_initialized(), gen, current,
                            self.aborted):
            return
        self.aborted = gen  # before the abort: the freed thread's `check` must see it

        def abort() -> None:
            with self.lock:
                if member_gen() != gen or not dist.is_initialized():
                    return  # it left by itself: its `drop` aborted them
                try:
                    n = abort_nccl(live_groups())
                except Exception as e:  # `_stranded` still ends the process
                    self._say(f"aborting generation {gen}'s NCCL communicators failed "
                              f"({first_line(e)})")
                    return
            self._say(f"the job moved to generation {current} while this rank waited in "
                      f"generation {gen}: aborted its {n} NCCL communicator(s)")

        threading.Thread(target=abort, name="moc-injob-abort", daemon=True).start()


def should_abort(backend: str | None, formed: bool, gen: int, current: int,
                 aborted: int | None) -> bool:
    """Whether the heartbeat thread aborts this process's communicators now: on NCCL
    only (gloo's collectives fail by themselves once a peer's sockets close: that path
    is unchanged), while a generation's groups exist, when the job moved past it, once
    per generation."""
    return backend == "nccl" and formed and current > gen and aborted != gen


def collective_timeout(step_s: float | None) -> datetime.timedelta:
    """How long an NCCL collective may take (COLLECTIVE_FLOOR_S, COLLECTIVE_FACTOR):
    COLLECTIVE_TIMEOUT before any step was timed."""
    if not step_s:
        return COLLECTIVE_TIMEOUT
    return datetime.timedelta(seconds=max(COLLECTIVE_FLOOR_S, COLLECTIVE_FACTOR * step_s))


def nccl_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """The NCCL_SETTINGS this process applies: each one not given. An asynchronous error
    handling of 1 counts as not given: torchrun sets it for every worker it starts
    (unless its own environment has one), so a user's 1 cannot be told from it, and 1
    would end every survivor of a fault; 0 and 3 given are kept, as the user's choice
    (NCCL_ASYNC_ERROR_HANDLING, torch's older name, too)."""
    out = {}
    for name, value in NCCL_SETTINGS.items():
        given = environ.get(name)
        if name == "TORCH_NCCL_ASYNC_ERROR_HANDLING":
            given = given or environ.get("NCCL_ASYNC_ERROR_HANDLING")
            given = None if given == "1" else given
        if not given:
            out[name] = value
    return out


def form_options(backend: str, local: int) -> dict[str, Any]:
    """`init_process_group`'s options beyond the store: on NCCL the device, which makes
    torch (>= 2.3) build the communicator inside `init_process_group` (ncclCommInitRank
    now, not at the first collective) and its subgroups split from it."""
    return {"device_id": torch.device("cuda", local)} if backend == "nccl" else {}


def local_rank() -> int:
    """This process's device on its node (torchrun's LOCAL_RANK)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def live_groups() -> list[Any]:
    """This process's registered process groups (none before a group formed). A copy:
    the training thread may add one meanwhile."""
    world = getattr(dist.distributed_c10d, "_world", None)
    return list(world.pg_map) if world is not None and dist.is_initialized() else []


def nccl_backends(groups: Iterable[Any]) -> list[Any]:
    """The NCCL backends of `groups`; a group without one (gloo's) is skipped."""
    found = []
    for group in groups:
        try:
            backend = group._get_backend(torch.device("cuda"))
        except RuntimeError:  # no backend for cuda tensors in this group
            continue
        if backend.name() == "nccl":
            found.append(backend)
    return found


def abort_nccl(groups: Iterable[Any]) -> int:
    """Abort the NCCL communicators of `groups`, leaving their registration to `drop`;
    how many backends. In one NCCL group, as torch's `_abort_process_group` does: with
    several communicators on a device NCCL expects their aborts grouped (pytorch
    #119797). A backend's abort raises once its timeout passed; an ncclCommAbort that
    hangs still holds this thread (`Membership._stranded` bounds the process)."""
    backends = nccl_backends(groups)
    if not backends:
        return 0
    grouped = hasattr(backends[0], "_group_start")
    if grouped:
        backends[0]._group_start()
    try:
        for backend in backends:
            backend.abort()
    finally:
        if grouped:
            backends[0]._group_end()
    return len(backends)


def set_nccl_timeout(groups: Iterable[Any], timeout: datetime.timedelta) -> int:
    """Give the NCCL backends of `groups` `timeout` for their next collectives (what
    torch's `_set_pg_timeout` does, backend by backend); how many."""
    backends = nccl_backends(groups)
    for backend in backends:
        backend._set_default_timeout(timeout)
    return len(backends)


def nccl_note(device: str, rank: int, gen: int) -> str | None:
    """The one line rank 0's first training process prints when in-job recovery runs on
    NCCL, which no run on GPUs has shown yet (None: nothing to say)."""
    if device != "cuda" or rank != 0 or gen != 0:
        return None
    return ("moc train: in-job recovery on NCCL (--device cuda) is not yet verified on "
            "GPUs: a survivor aborts its communicators and re-forms, but no run on two "
            "GPUs has shown it; --recovery restart is the verified way")


def first_line(error: BaseException) -> str:
    """What a line on stderr says of `error`: its first sentence, without the source
    location gloo and torch's NCCL checks put first ("[.../pair.cc:553] Connection closed
    by peer [127.0.0.1]:1961. This ..." says "Connection closed by peer
    [127.0.0.1]:1961")."""
    text = (str(error).splitlines() or [type(error).__name__])[0]
    text = re.sub(r"^\[[^\]]*\.\w+:\d+\]\s*", "", text)
    text = re.sub(r"^NCCL error in: \S+:\d+, ", "NCCL error: ", text)  # torch's C10D_NCCL_CHECK
    text = re.split(r"\.\s+(?=[A-Z])", text, maxsplit=1)[0].strip().removesuffix(".")
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
