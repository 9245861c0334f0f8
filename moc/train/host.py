"""The rank host: what torchrun starts for each rank under `moc train --recovery in-job`.

    torchrun agent (one per node)
      rank host (one per rank; torchrun's worker, never dies of a fault)
        training process (`python -m moc.train`), replaced when it dies or hangs
        standby (`--spares 1`): a training process already imported, waiting for its turn

torchrun's agent tears every worker of the job down when one of them fails, and its
re-rendezvous makes every other node's agent restart theirs: the restart that costs a
fault 7-9 s here and a minute on a GPU cluster. The host stands between: a training
process that dies is replaced by its host in place, the job moves to the next generation
of its membership (`moc.injob.membership`), and the survivors, whose collectives fail,
re-form their process groups with the newcomer without leaving their processes.

A hang is a fault too. The training process writes a heartbeat every 0.1 s (`injob`);
the host SIGKILLs it, and replaces it, when the heartbeats stop (SIGSTOP, a frozen
process) or when its step stops advancing while it is training, or leaving a lost
generation, and not waiting in a collective (an endless loop in user code; an abandon
held by a device wait), for the hang timeout: `--hang-timeout`, by
default HANG_FACTOR times the median step time the process reports, at least
HANG_FLOOR_S (START_HANG_S before any step was timed).

How the host ends: with its training process's status when that process exits on its
own (0: done; 2: a bad argument; 128 + n: preempted by signal n), and 1 after more than
`--max-replacements` replacements, which hands the job to torchrun's restart (if
--max-restarts allows). A SIGTERM or SIGINT is passed on to the training process (it
stops at a step boundary with a final checkpoint, `moc.Preemption`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from moc.checkpoint.twolevel.persist import prestart
from moc.checkpoint.twolevel.persist.forking import Forked
from moc.injob.machines import (
    ENV_JOIN,
    JOB_FINISHED,
    LOST_S,
    NAMESPACE,
    Claims,
    Identity,
    Lease,
    LeaseWatch,
    lease_gen,
    training_world,
)
from moc.injob.membership import (
    ENV_FD,
    ENV_GEN,
    ENV_PRESTART,
    ENV_STANDBY,
    ENV_STORE,
    FINISHED,
    PREFIX,
    REJOIN_STATUS,
    gen_key,
    next_generation,
)
from moc.train import forked
from moc.train.nodes import die_with_parent

HANG_FACTOR = 10.0
HANG_FLOOR_S = 5.0
PROGRESS_FLOOR_S = 60.0
"""A live process that makes no step while none of its threads waits for a peer (an
endless loop in user code) is hung only after this long at least: a checkpoint's first
touch of its memory, a slow persist under --persist-policy wait or a data loader's
stall are legitimate pauses that a frozen process's silence is not."""
START_HANG_S = 120.0
"""Before the training process has timed a step: start-up, the restore, the first step."""
STEPPING = ("train", "leave")
"""Phases in which a process that neither advances nor waits for a peer hangs: training
(an endless loop in user code), and leaving a lost generation (its groups dropped, its
engine abandoned: a snapshot thread that waits on the device behind a kernel no abort
ended holds the abandon for ever). Start-up, the restore, a rejoin's wait for its
generation's ranks (a replacement machine may take minutes) are watched for heartbeats
only."""
POLL_S = 0.02
TAKEOVER_DRILL_ENV = "MOC_TAKEOVER_DRILL"
"""Fault injection for drills and tests: the first spare node to reach this point of a
takeover stops there (says so, then sleeps until it is killed) so that a test can lose
it at that very moment: `claimed` (its claim on the lost node made, no word yet to its
hosts), `adopting` (the word given, its process not woken), `woken` (its process woken
as the lost rank, no lease renewed for it yet)."""
TAKEOVER_POINTS = ("claimed", "adopting", "woken")
BOOT = """\
import importlib.util, os, runpy, sys
name = "moc.checkpoint.twolevel.persist.prestart"
spec = importlib.util.spec_from_file_location(name, sys.argv[1])
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module
spec.loader.exec_module(module)
if os.environ.get("MOC_INJOB_PRESTART") and os.environ.get("LOCAL_RANK", "0") == "0":
    module.prestart()
sys.argv = ["moc.train", *sys.argv[2:]]
runpy.run_module("moc.train", run_name="__main__", alter_sys=True)
"""
BOOT_SCRIPT = """\
import sys
from moc.train.forked import run_script
run_script(sys.argv[1], sys.argv[2:])
"""
"""A user's script's first lines (`moc run`, new interpreters: MOC_INJOB_START=spawn)."""
"""A training process's first lines: a node's leader starts its persist process ahead
(`twolevel.persist.prestart`, stdlib only, loaded by its path before anything imports torch), so
that its import runs beside the training process's own; then `python -m moc.train`."""


@dataclass
class Child:
    """One training process and what its heartbeats said."""

    process: subprocess.Popen | Forked
    pipe: int
    """The read end of its heartbeat pipe."""
    started: float = field(default_factory=time.monotonic)
    beat: float | None = None
    """When the last heartbeat came (None: none yet)."""
    progress: float = field(default_factory=time.monotonic)
    """When its step last advanced, or it last waited on its peers, or was not training."""
    last: dict[str, Any] = field(default_factory=dict)
    """Its last heartbeat."""
    buffer: bytes = b""
    joined: int = 0
    """The generation it was started in (its heartbeats say where it is now)."""

    @property
    def gen(self) -> int:
        """The generation it is in, as far as its heartbeats tell."""
        return int(self.last.get("gen", self.joined))

    def read(self) -> None:
        """Take in the heartbeats that arrived."""
        while select.select([self.pipe], [], [], 0)[0]:
            chunk = os.read(self.pipe, 65536)
            if not chunk:  # it exited: its last lines are still taken in below
                break
            self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        now = time.monotonic()
        for line in lines:
            beat = json.loads(line)
            if (beat.get("step") != self.last.get("step") or beat.get("waiting")
                    or beat.get("phase") != self.last.get("phase")
                    or beat.get("phase") not in STEPPING):
                self.progress = now
            self.beat, self.last = now, beat

    def hung(self, timeout_s: float | None) -> str | None:
        """Why this process counts as hung now (None: it does not)."""
        now = time.monotonic()
        step_s = self.last.get("step_s")
        limit = timeout_s or (max(HANG_FLOOR_S, HANG_FACTOR * step_s) if step_s
                              else START_HANG_S)
        silent = now - (self.beat or self.started)
        # Before its first heartbeat a process is starting (an interpreter, imports).
        if silent > (limit if self.beat is not None else max(limit, START_HANG_S)):
            return f"no heartbeat for {silent:.1f}s"
        stalled = now - self.progress
        phase = self.last.get("phase")
        if phase in STEPPING and stalled > max(limit, PROGRESS_FLOOR_S):
            what = "no step" if phase == "train" else "no progress leaving its generation"
            return (f"{what} for {stalled:.1f}s (at step {self.last.get('step')}, not "
                    "waiting for a peer)")
        return None

    def fault(self, code: int) -> str | None:
        """Why its exit with status `code` is a fault, to be replaced (None: it ended by
        itself, with its own status; or it died after its last heartbeat said its work
        was done and durable, as a C++ destructor's abort at exit does: a newcomer then
        would wait for peers who are gone). Call after the last `read`."""
        if code == REJOIN_STATUS:
            return f"process {self.process.pid} lost a peer while it started"
        if code >= 0 or self.last.get("phase") == "done":
            return None
        return f"process {self.process.pid} died ({_signal_name(-code)})"

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.pipe)


class RankHost:
    """One rank's host (see the module docstring). Owner: its main thread."""

    def __init__(self, argv: list[str], spares: int, hang_timeout_s: float | None,
                 max_replacements: int, prestart: bool = False,
                 script: str | None = None) -> None:
        self.argv = argv
        self.script = script
        """A user's training script (`moc run`), run with `argv`; None: `moc.train`."""
        self.prestart = prestart
        """Whether a node leader's training process starts its persist process ahead."""
        self.refill_due = False
        """A spare was used: start the next once the newcomer trains (not before: its
        start-up would slow the restore and the first steps, on the same cores)."""
        world, per_node = training_world()
        slot = int(os.environ["RANK"])  # torchrun's, in a world with the spare nodes
        self.identity = Identity(slot, world, per_node) if slot < world else None
        """The rank this host trains (None: a spare node's host, until it adopts one)."""
        self.spares = spares
        self.hang_timeout_s = hang_timeout_s
        self.max_replacements = max_replacements
        self.replacements = 0
        self.round_store, self.job_store, self.store = _serve_store()
        """The round's store (served here on rank 0 across nodes: kept while the host
        lives), the job's, and the job's in this round's namespace."""
        self.lease = Lease(self.store, slot) if self.identity is not None else None
        self.fork = forked.forking()
        """Training processes are forked from this host (`moc.train.forked`)."""
        if self.fork:
            forked.preload(script)
        self.standby: Child | None = None
        self.signal: int | None = None
        self.child: Child | None = None
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, self._forward)

    @property
    def rank(self) -> int | str:
        return self.identity.rank if self.identity is not None else "spare"

    def run(self) -> int:
        if self.identity is None:  # a spare node's host: until it adopts a lost rank
            adopted = self._stand_by()
            if isinstance(adopted, int):
                return adopted
            self.child = adopted
        else:
            self.child = self._start(gen=None)
            self._refill()
        while True:
            why, code = self._watch(self.child)
            if why is None:
                self._end_standby()
                if code == 0 and self.rank == 0:
                    self.job_store.set(JOB_FINISHED, "1")  # the spare nodes may go
                    self.store.set(FINISHED, "1")  # and a newcomer still gathering
                return code
            if self.signal is not None:  # stopping anyway: no replacement
                self._end_standby()
                return 128 + self.signal
            if self.replacements >= self.max_replacements:
                self._say(f"{why}; {self.replacements} replacements already "
                          "(--max-replacements): giving up")
                self._end_standby()
                return 1
            self.replacements += 1
            self.child = self._replace(why, self.child)

    # -- faults --------------------------------------------------------------------------

    def _watch(self, child: Child) -> tuple[str | None, int]:
        """Until the process ends or hangs: (None, its status) when it exited by itself,
        else (why it is a fault, its status)."""
        while True:
            child.read()
            assert self.lease is not None
            self.lease.renew(child.gen)
            code = child.process.poll()
            if code is not None:
                child.read()
                child.close()
                why = child.fault(code)
                if why is not None:
                    return why, code
                if code < 0:  # a death after its work was done and durable
                    self._say(f"process {child.process.pid} died ({_signal_name(-code)}) "
                              "after its training finished and its engine closed; not "
                              "replaced")
                    return None, 128 + self.signal if self.signal is not None else 0
                return None, code
            if self.refill_due and child.last.get("trained", 0) >= 1:
                self.refill_due = False
                self._refill()
            hung = child.hung(self.hang_timeout_s) if self.signal is None else None
            if hung is not None:
                child.process.kill()
                child.process.wait()
                child.close()
                return f"process {child.process.pid} hung ({hung}); killed", -9
            time.sleep(POLL_S)

    def _replace(self, why: str, lost: Child) -> Child:
        """Move the job past the generation the lost process was in (unless a survivor
        already did) and start, or wake, this rank's newcomer in the next one."""
        gen = next_generation(self.store, lost.gen)
        self.store.set(f"{gen_key(gen)}/replaced/{self.rank}", why)
        child, spare = (self.standby, True) if self.standby is not None else (None, False)
        if child is not None:
            self.standby = None
            self._wake(child, gen)
        else:
            child = self._start(gen)
        self._say(f"{why}; replaced by {'its spare, ' if spare else ''}process "
                  f"{child.process.pid} in generation {gen}")
        self.refill_due = bool(self.spares)
        return child

    # -- a spare node's host -------------------------------------------------------------

    def _stand_by(self) -> Child | int:
        """A spare node's host: a training process imported and waiting, until this
        node adopts a lost node (`moc.injob.machines`); the woken process, or the exit
        status when the job finished (0) or a signal came first."""
        world, per_node = training_world()
        spare = int(os.environ.get("GROUP_RANK", "0"))  # torchrun's: this machine
        leader = int(os.environ.get("LOCAL_RANK", "0")) == 0
        watch = LeaseWatch(self.store, world, per_node)
        claims = Claims(self.store, spare)
        self.standby = self._start(None, standby=True)
        while self.signal is None and not self.job_store.check([JOB_FINISHED]):
            if leader and (lost := watch.lost_node()) is not None:
                node, leases = lost
                watch.forget(node)
                if claims.claim(node, leases):
                    self._drill("claimed", node)
                    self.store.set(f"adopt/{spare}", json.dumps(
                        {"node": node, "leases": leases}))
            if self.store.check([f"adopt/{spare}"]):
                return self._adopt(json.loads(self.store.get(f"adopt/{spare}")), per_node,
                                   world)
            time.sleep(POLL_S * 2.5)
        self._end_standby()
        return 128 + self.signal if self.signal is not None else 0

    def _adopt(self, word: dict[str, Any], per_node: int, world: int) -> Child:
        """Take the rank of this host's local rank on the lost node: move the job past
        the generation its process was in, and wake the waiting process as that rank."""
        node = word["node"]
        self._drill("adopting", node)
        rank = node * per_node + int(os.environ.get("LOCAL_RANK", "0"))
        lost = word["leases"][str(rank)]
        self.identity = Identity(rank, world, per_node)
        self.lease = Lease(self.store, rank)
        gen = next_generation(self.store, lease_gen(lost))
        why = f"node {node} lost (no lease renewed for {LOST_S:g}s)"
        self.store.set(f"{gen_key(gen)}/replaced/{rank}", why)
        child, self.standby = self.standby, None
        assert child is not None
        self._wake(child, gen, self.identity.env())
        by = "node started again" if os.environ.get(ENV_JOIN) else "spare node"
        self._say(f"{why}; adopted by {by} {os.environ.get('GROUP_RANK')}, process "
                  f"{child.process.pid} in generation {gen}")
        self._drill("woken", node)
        self.refill_due = bool(self.spares)
        return child

    def _drill(self, point: str, node: int) -> None:
        """TAKEOVER_DRILL_ENV: stop at `point` of this spare's takeover of `node`, if it
        is the drill's point and this spare node the first to reach it."""
        if os.environ.get(TAKEOVER_DRILL_ENV) != point:
            return
        spare = os.environ.get("GROUP_RANK", "0")
        if self.store.compare_set(f"drill/takeover/{point}", "", spare).decode() != spare:
            return
        self._say(f"drill: spare node {spare} stops at '{point}' in its takeover of "
                  f"node {node}")
        deadline = time.monotonic() + 600  # a drill nobody ends still ends
        while self.signal is None and time.monotonic() < deadline:
            time.sleep(POLL_S * 10)

    # -- processes -----------------------------------------------------------------------

    def _start(self, gen: int | None, standby: bool = False) -> Child:
        read, write = os.pipe()
        env = dict(os.environ)
        env[ENV_FD] = str(write)
        if gen is not None:
            env[ENV_GEN] = str(gen)
        if standby:
            env[ENV_STANDBY] = "1"
        if self.prestart:
            env[ENV_PRESTART] = "1"
        if self.identity is not None:
            env.update(self.identity.env())
        process: subprocess.Popen | Forked
        if self.fork and self.script is not None:
            process = forked.fork_script(self.script, self.argv, env, write, stdin=standby,
                                         on_fork=die_with_parent())
        elif self.fork:
            process = forked.fork(self.argv, env, write, stdin=standby,
                                  on_fork=die_with_parent())
        else:
            boot = ([BOOT_SCRIPT, self.script] if self.script is not None
                    else [BOOT, prestart.__file__])
            process = subprocess.Popen(
                [sys.executable, "-c", *boot, *self.argv], env=env,
                pass_fds=(write,),
                stdin=subprocess.PIPE if standby else subprocess.DEVNULL,
                preexec_fn=die_with_parent())
        os.close(write)
        return Child(process, read, joined=gen or 0)

    def _refill(self) -> None:
        """With --spares: a standby, imported and waiting, for the next fault."""
        if self.spares and self.standby is None:
            self.standby = self._start(None, standby=True)

    def _wake(self, child: Child, gen: int, env: dict[str, str] | None = None) -> None:
        """Start a waiting process in generation `gen`, as the rank `env` says (a spare
        node's, which waited as none)."""
        assert child.process.stdin is not None
        word = {"gen": gen, "env": env or {}}
        child.process.stdin.write(json.dumps(word).encode() + b"\n")
        child.process.stdin.close()
        child.started = child.progress = time.monotonic()
        child.joined = gen

    def _end_standby(self) -> None:
        if self.standby is not None:
            with contextlib.suppress(OSError):
                assert self.standby.process.stdin is not None
                self.standby.process.stdin.close()  # EOF: it exits
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.standby.process.wait(timeout=5)
            if self.standby.process.poll() is None:
                self.standby.process.kill()
                self.standby.process.wait()
            self.standby.close()
            self.standby = None

    def _forward(self, signum: int, frame: object) -> None:
        self.signal = self.signal or signum
        if self.child is not None and self.child.process.poll() is None:
            self.child.process.send_signal(signum)

    def _say(self, line: str) -> None:
        command = "moc run" if self.script is not None else "moc train"
        print(f"{command}: rank {self.rank}: {line}", file=sys.stderr, flush=True)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _serve_store() -> Any:
    """The job's store, in the namespace every host of this torchrun round agreed on
    (`agree_namespace`, put in the environment its training processes inherit).

    Where it lives: $MOC_JOB_STORE when set (`moc train --nodes` serves it in its
    launcher, as a cluster's rendezvous endpoint would: no training node's loss takes
    it), else the round's own store, MASTER_ADDR:MASTER_PORT: the agent's shared store
    on one node, or across nodes a store of each rendezvous round served by rank 0's
    host (never by a training process, which may die). Losing the node that serves it
    ends in-job recovery: the survivors' store calls fail, they exit, and torchrun's
    restart (or the scheduler's) resumes the job from what memory and storage hold."""
    import torch.distributed as dist

    from moc.injob.membership import ENV_NS, connect, namespace
    from moc.topology import COLLECTIVE_TIMEOUT

    if os.environ.get(ENV_JOIN):  # a machine started again: outside torchrun's round
        store = connect()
        os.environ[ENV_NS] = store.get(NAMESPACE).decode()
        return store, store, dist.PrefixStore(namespace(), store)
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    rank = int(os.environ["RANK"])
    round_store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]) if not agent and rank == 0 else None,
        is_master=not agent and rank == 0, timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False)
    os.environ[ENV_NS] = agree_namespace(round_store, rank, agent)
    store = round_store if not os.environ.get(ENV_STORE) else connect()
    if rank == 0 and os.environ.get(ENV_STORE):  # for a machine that joins later
        store.set(NAMESPACE, os.environ[ENV_NS])
    return round_store, store, dist.PrefixStore(namespace(), store)


def agree_namespace(round_store: Any, rank: int, agent: bool) -> str:
    """A name for this torchrun round that every host agrees on: made by rank 0's host
    and read from the round's own store, which is fresh every round. Not torchrun's
    restart count: each agent counts only its own workers' failures, so after one node's
    restart rank 0 had 0 and rank 1 had 1, and the ranks never met again.

    The agent's shared store outlives rounds, so a name in it could be last round's:
    on one node (one agent, one count) the restart count serves; across nodes moc needs
    a store per round (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, as `moc train --nodes` and
    the multi-node guide set), and says so."""
    from moc.topology import restart_count

    if agent:
        nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
        if nodes > 1:
            raise SystemExit(
                "moc train: error: in-job recovery across nodes needs a store per "
                "rendezvous round; set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun "
                "on every node (docs/guide/multi-node.md)")
        return f"attempt-{restart_count()}"
    key = f"{PREFIX}/namespace"
    if rank == 0:
        round_store.set(key, f"round-{uuid.uuid4().hex[:12]}")
    return round_store.get(key).decode()


def main(argv: list[str] | None = None) -> int:
    """`moc.train.host [moc train's options]`: the host of a `moc.train` process, which
    gets the same options; `moc.train.host --script PATH [host options] -- [args]`
    (`moc run`): the host of a user's script, which gets `args`."""
    argv = sys.argv[1:] if argv is None else argv
    script = None
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--spares", type=int, default=0)
    parser.add_argument("--hang-timeout", type=float)
    parser.add_argument("--max-replacements", type=int, default=100)
    parser.add_argument("--ckpt-mode", default="moc")
    parser.add_argument("--ckpt-dir")
    if argv[:1] == ["--script"]:
        script, ours = argv[1], argv[2:argv.index("--")]
        known = parser.parse_args(ours)
        argv = argv[argv.index("--") + 1:]
    else:
        known, _ = parser.parse_known_args(argv)
    import torch.distributed as dist

    try:
        return RankHost(argv, known.spares, known.hang_timeout, known.max_replacements,
                        # A script's engines are its own: its processes fork one each
                        # (cheap), and spawn more once an engine asked for one.
                        prestart=(script is not None or (known.ckpt_mode == "moc"
                                                         and known.ckpt_dir is not None)),
                        script=script).run()
    except dist.DistError as e:
        # The job's store is gone: its launcher (or the machine serving it) died, and
        # with it in-job recovery. One line, not a traceback from a lease renewal; the
        # training process goes with this host (`die_with_parent`), and the run started
        # again finds what this node's memory and storage hold (issue 47).
        from moc.injob.membership import first_line

        print(f"moc train: rank {os.environ.get('RANK', '?')}: the job's store is gone "
              f"({first_line(e)}): its launcher, or the machine serving it, died; this "
              "rank stops (started again, the run resumes from memory and storage)",
              file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    status = main()
    # Leave at once, as a training process does (`moc.train.__main__`): torchrun SIGTERMs
    # the other hosts as soon as one exits with an error, and Python's teardown (the
    # round's store served here, the forked children's pipes) puts the default handlers
    # back first, under which a host that had its own status was reported killed (-15).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
