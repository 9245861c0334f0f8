"""Simulated nodes: `moc train --nodes N` runs N torchrun agents on this host, one per
pretend machine, joined by a c10d rendezvous on 127.0.0.1.

Each agent gets its own node-local memory root (MOC_SHM_ROOT, under one private
directory made for the run), so what moc keeps "in the node's memory" is really per
simulated node: a node fault (`--fault-kind node --fault-node J`) wipes only node J's.
The run's simulated machines, and their memory, are gone when the launcher returns: it
removes the directory. With CUDA, node i sees only its own GPUs (CUDA_VISIBLE_DEVICES),
so that no two ranks of the job share a device.

The directory (`moc-nodes-*`, beside jobs' `moc-*` directories) records the launcher as
its owner, as a job's directory does, so another job's clean-up of stale shared memory
leaves it alone while the launcher runs, however long, and removes it once the launcher
is gone. The agents die with the launcher, even by SIGKILL (`die_with_parent`): a node
never trains on unsupervised.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from moc.checkpoint.errors import CheckpointError
from moc.checkpoint.twolevel.memory.jobdir import read_owner, record_owner, secure_dir
from moc.injob.machines import ENV_NODES, JOB_FINISHED
from moc.train.agent import TORCHRUN_SHUTDOWN_S

ENV_STORE = "MOC_JOB_STORE"  # moc.injob.membership.ENV_STORE (that module imports torch)

GRACE_S = 30.0
"""After one agent fails, how long the others get to notice (their workers lose a peer
and exit, the agents report it) before they are terminated: long enough for gloo's
broken-connection error and torchrun's shutdown, short enough not to hang a failed run."""
TERMINATE_S = 10.0
"""After SIGTERM, how long an agent gets to stop its workers before SIGKILL."""
POLL_S = 0.2


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the rendezvous endpoint)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sim_root(key: str | None = None) -> Path:
    """A directory only this user can enter (0700), for the nodes' memory: under
    $MOC_SHM_ROOT if set, else /dev/shm (tmpfs, as a node's snapshots are), else the
    temporary directory. This process is recorded as its owner (`slots.record_owner`):
    without that record another job's `remove_stale_jobs` would take it for abandoned
    an hour after its creation (its mtime never changes) and delete the nodes' memory
    under the running job. OSError when the record cannot be written (a directory made
    here is removed then).

    `key` (the checkpoint directory's job id) names it `moc-nodes-<key>`, so that the
    same command started again after its launcher and every process of it died (a
    SIGKILL of the whole job) finds the dead job's memory, as a machine's own /dev/shm
    would be found, and restores from it (issue 47: it made a fresh root and resumed
    from storage, losing tokens, with the snapshots left beside it). A dead launcher's
    root is taken over; a live one's, or one this user does not own alone, never is:
    a fresh root is made instead."""
    base = os.environ.get("MOC_SHM_ROOT") or ("/dev/shm" if os.path.isdir("/dev/shm")
                                              else None)
    if key is not None:
        root = Path(base or tempfile.gettempdir()) / f"moc-nodes-{key}"
        try:
            secure_dir(root)
            owner = read_owner(root)
            if owner is None or owner.gone(this_machine=True) is True:
                record_owner(root, os.getpid())
                return root
        except CheckpointError as e:
            print(f"moc train: warning: {e}; the simulated nodes' memory goes to a fresh "
                  "directory instead", file=sys.stderr)
    root = Path(tempfile.mkdtemp(prefix="moc-nodes-", dir=base))
    try:
        record_owner(root, os.getpid())
    except OSError:
        shutil.rmtree(root, ignore_errors=True)
        raise
    return root


PR_SET_PDEATHSIG = 1
"""prctl(2): the signal a process gets when its parent (the thread that forked it) dies."""


def die_with_parent() -> Callable[[], None] | None:
    """A `preexec_fn` that makes the child get SIGTERM when this process dies, however
    it dies (SIGKILL included, where no handler of ours runs): torchrun stops its
    workers on SIGTERM, so no simulated node trains on without its launcher. None where
    prctl is not there (not Linux): then only a launcher that exits normally or on
    SIGINT/SIGTERM stops its agents.

    The signal follows the thread that started the child, so agents are started from
    the launcher's main thread, which lives as long as it does. A launcher that died
    between the fork and the prctl would never send it: the child checks that its parent
    is still the launcher and exits otherwise."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the launcher is already gone: no signal will come
            os._exit(1)
    return preexec


def agent_argv(nodes: int, nproc: int, max_restarts: int, endpoint: str, run_id: str,
               worker: list[str], shutdown_s: int | None = None, module: str = "moc.train",
               served: bool = False) -> list[str]:
    """The torchrun command line of one simulated node (the same for every node: c10d
    gives each its node rank), run by `moc.train.agent` (torchrun, ending in one line).
    `shutdown_s`: how long it gives its workers, once it forwarded a signal to them,
    before it kills them (`--shutdown-timeout`); None: torchrun's own
    TORCHRUN_SHUTDOWN_S, and no option (torch before 2.12 has none)."""
    shutdown = [] if shutdown_s is None else ["--shutdown-timeout", str(shutdown_s)]
    if served:  # the launcher serves the rendezvous' store: no agent takes it down
        shutdown += ["--rdzv-conf", "is_host=false"]
    return [sys.executable, "-m", "moc.train.agent", "--nnodes", str(nodes),
            "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
            "--max-restarts", str(max_restarts), *shutdown, "--module", module, *worker]


def node_env(root: Path, node: int, nproc: int, gpus: int) -> dict[str, str]:
    """Environment of simulated node `node`: its own memory root, and with `gpus` > 0
    its own `nproc` of them."""
    env = dict(os.environ)
    env["MOC_SHM_ROOT"] = str(root / f"node-{node}")
    # A fresh store per rendezvous round: the agents' restart counts may differ, so the
    # shared store's namespace by restart count would mix attempts (moc.topology).
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(node * nproc + i) for i in range(nproc))
    return env


def run_nodes(nodes: int, nproc: int, max_restarts: int, worker: list[str],
              gpus: int = 0, shutdown_s: int | None = None, module: str = "moc.train",
              spare_nodes: int = 0, machine_restart_s: float | None = None,
              memory_key: str | None = None, command: str = "moc train") -> int:
    """Start `nodes` torchrun agents of `nproc` ranks each running `moc.train worker`;
    wait for all. 0 only if every agent exits 0. When one fails the others get GRACE_S
    to end on their own, then are terminated. `gpus`: GPUs per node to hand out (0: the
    CPU).

    A SIGTERM or SIGINT of the launcher (a scheduler, Ctrl-C) is forwarded once to every
    agent, which forwards it to its workers: they stop at a step boundary with a final
    checkpoint (`moc.Preemption`), and get `shutdown_s` for it (None: torchrun's own
    TORCHRUN_SHUTDOWN_S) before the agents kill them, and the launcher then kills what
    is left; it exits with 128 + the signal's
    number. A second signal kills everything at once. The agents run in sessions of
    their own, so a terminal's Ctrl-C reaches them through the launcher alone (twice
    would read as "again: at once"), and die with the launcher however it dies
    (`die_with_parent`).

    In-job recovery (`module` moc.train.host): the launcher serves the rendezvous' store
    and the job's (MOC_JOB_STORE), as a cluster's rendezvous endpoint would, so that a
    lost machine takes neither with it; `spare_nodes` more agents start, whose hosts
    stand by to adopt a lost machine's ranks (`moc.injob.machines`). An agent SIGKILLed
    then is a machine lost, up to `spare_nodes` of them: no failure while a spare takes
    its place, and the survivors, whose exit barrier waits for the lost agent for
    torch's 300 s, are ended once the job's store says the training finished. With
    `machine_restart_s`, a lost machine is started again that many seconds later, as a
    scheduler would: its rank hosts start outside torchrun's rendezvous and adopt the
    lost machine's ranks (`moc.injob.machines`, ENV_JOIN). `memory_key`: see `sim_root`.
    `command` begins the launcher's messages (`moc train`, `moc run`)."""
    in_job = module == "moc.train.host"
    try:
        root = sim_root(memory_key)
    except OSError as e:
        print(f"{command}: error: cannot make the simulated nodes' memory under "
              f"{os.environ.get('MOC_SHM_ROOT') or '/dev/shm'}: {e.strerror or e}; free "
              "some, or point MOC_SHM_ROOT at a larger tmpfs", file=sys.stderr)
        return 1
    port = free_port()
    endpoint = f"127.0.0.1:{port}"
    run_id = f"moc-{uuid.uuid4().hex[:12]}"
    store = serve_store(port) if in_job else None
    agents: list[subprocess.Popen] = []
    waited: _Wait | None = None
    signals = _Signals()
    previous = {s: signal.signal(s, signals.handle) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for node in range(nodes + spare_nodes):
            (root / f"node-{node}").mkdir(mode=0o700, exist_ok=True)  # a dead job's: kept
            env = node_env(root, node, nproc, gpus)
            if in_job:
                env[ENV_STORE], env[ENV_NODES] = endpoint, str(nodes)
            agents.append(subprocess.Popen(
                agent_argv(nodes + spare_nodes, nproc, max_restarts, endpoint, run_id,
                           worker, shutdown_s, module, served=store is not None),
                env=env, preexec_fn=die_with_parent(), start_new_session=True))
        def restart(lost: int, node: int) -> list[subprocess.Popen]:
            """Machine `lost` started again, as simulated node `node`: its hosts."""
            (root / f"node-{node}").mkdir(mode=0o700, exist_ok=True)
            env = node_env(root, node, nproc, 0)
            if gpus:
                env["CUDA_VISIBLE_DEVICES"] = node_env(root, lost, nproc, gpus)[
                    "CUDA_VISIBLE_DEVICES"]
            return [subprocess.Popen([sys.executable, "-u", "-m", module, *worker],
                                     env={**env, **joiner_env(endpoint, nodes, nproc, node,
                                                              local)},
                                     preexec_fn=die_with_parent(), start_new_session=True)
                    for local in range(nproc)]

        waited = _Wait(agents, signals, (TORCHRUN_SHUTDOWN_S if shutdown_s is None
                                         else shutdown_s) + TERMINATE_S,
                       spare_nodes, store, restart if machine_restart_s is not None else None,
                       machine_restart_s or 0.0, command)
        codes = waited.run()
    finally:
        _terminate(agents + (waited.joiners if waited is not None else []))
        shutil.rmtree(root, ignore_errors=True)
        for s, handler in previous.items():
            signal.signal(s, handler)
    if signals.first is not None:
        if signals.forced:
            print(f"{command}: {signals.first.name} again: every simulated node killed",
                  file=sys.stderr)
        return 128 + int(signals.first)
    failed = [f"node {i}: exit {c}" for i, c in enumerate(codes)
              if c != 0 and i not in waited.lost and not waited.finished]
    failed += [f"a machine started again: exit {p.returncode}" for p in waited.joiners
               if p.returncode not in (0, None) and not waited.finished]
    if failed:
        print(f"{command}: error: simulated nodes failed ({'; '.join(failed)})",
              file=sys.stderr)
        return 1
    return 0


class _Signals:
    """The launcher's SIGTERM and SIGINT, recorded for `_wait` (a handler that raised
    would leave the agents unforwarded mid-start)."""

    REPEAT_S = 2.0
    """A repeat within this long is the same request (moc.checkpoint.preemption)."""

    def __init__(self) -> None:
        self.first: signal.Signals | None = None
        self.forced = False
        self._at = 0.0

    def handle(self, signum: int, frame: object) -> None:
        now = time.monotonic()
        if self.first is None:
            self.first, self._at = signal.Signals(signum), now
        elif now - self._at > self.REPEAT_S:
            self.forced = True


FINISH_GRACE_S = 10.0
"""After the job's store says training finished, how long agents still running get to
end by themselves before they are terminated (with a machine lost, torchrun's exit
barrier would hold them 300 s for its agent)."""


class _Wait:
    """Every agent's exit status; after the first failure the rest have GRACE_S. A
    signal of the launcher is forwarded to every agent once; they then have `stop_s`
    (a second signal: none) before they are killed. With `spare_nodes`, an agent
    SIGKILLed is a machine lost (up to `spare_nodes`), not a failure; with `restart`
    too, and the machine is started again `restart_s` later (`restart(lost, node)`: its
    hosts, `joiners`, waited for as the agents are)."""

    def __init__(self, agents: list[subprocess.Popen], signals: _Signals, stop_s: float,
                 spare_nodes: int = 0, store: object = None,
                 restart: Callable[[int, int], list[subprocess.Popen]] | None = None,
                 restart_s: float = 0.0, command: str = "moc train") -> None:
        self.command = command
        self.agents, self.signals, self.stop_s = agents, signals, stop_s
        self.spare_nodes, self.store = spare_nodes, store
        self.restart, self.restart_s = restart, restart_s
        self.lost: set[int] = set()
        self.unsaved: set[int] = set()
        """Machines lost when no spare was left (said once)."""
        self.finished = False
        self.joiners: list[subprocess.Popen] = []
        self.restarted = 0
        self._due: list[tuple[float, int]] = []
        """(when, lost node): machines to start again."""

    def run(self) -> list[int]:
        agents, signals = self.agents, self.signals
        deadline = stop_by = finish_by = None
        forwarded = False
        while any(a.poll() is None for a in agents + self.joiners):
            now = time.monotonic()
            agents = self.agents + self.joiners
            for when, lost in [d for d in self._due if d[0] <= now and signals.first is None]:
                self._due.remove((when, lost))
                node = len(self.agents) + self.restarted
                self.restarted += 1
                print(f"{self.command}: machine {lost} started again (as simulated node {node}): "
                      "its ranks rejoin the job", file=sys.stderr, flush=True)
                self.joiners += self.restart(lost, node) if self.restart else []
            if signals.first is not None and not forwarded:
                for a in agents:
                    if a.poll() is None:
                        a.send_signal(signals.first)
                forwarded, stop_by = True, now + self.stop_s
            if signals.forced or (stop_by is not None and now > stop_by):
                for a in agents:
                    if a.poll() is None:
                        a.kill()
                break
            self._note_lost()
            if finish_by is None and self._training_finished():
                self.finished, finish_by = True, now + FINISH_GRACE_S
            if finish_by is not None and now > finish_by:
                _terminate(agents)
                break
            failed = [i for i, a in enumerate(agents)
                      if a.poll() not in (None, 0) and i not in self.lost]
            if deadline is None and failed and not self.finished:
                deadline = now + GRACE_S
            if deadline is not None and now > deadline and stop_by is None:
                _terminate(agents)
                break
            time.sleep(POLL_S)
        for p in self.joiners:
            p.wait()
        return [a.wait() for a in self.agents]

    def _note_lost(self) -> None:
        for i, a in enumerate(self.agents):
            if a.poll() != -signal.SIGKILL or i in self.lost or i in self.unsaved:
                continue
            if self.spare_nodes and self.restart is None and len(self.lost) >= self.spare_nodes:
                self.unsaved.add(i)
                print(f"{self.command}: node {i} lost (its agent SIGKILLed), and no spare node "
                      f"is left: --spare-nodes {self.spare_nodes}, all taken by earlier "
                      "losses; the job stops (give more --spare-nodes, or "
                      "--machine-restart-s to start lost machines again)",
                      file=sys.stderr, flush=True)
                continue
            if len(self.lost) < self.spare_nodes or self.restart is not None:
                self.lost.add(i)
                if len(self.lost) <= self.spare_nodes:
                    print(f"{self.command}: node {i} lost (its agent SIGKILLed): a spare node "
                          "takes its ranks", file=sys.stderr, flush=True)
                else:
                    print(f"{self.command}: node {i} lost (its agent SIGKILLed): it is started "
                          f"again in {self.restart_s:g}s", file=sys.stderr, flush=True)
                    self._due.append((time.monotonic() + self.restart_s, i))

    def _training_finished(self) -> bool:
        return bool(self.lost) and self.store is not None and self.store.check(
            [JOB_FINISHED])


def joiner_env(endpoint: str, nodes: int, nproc: int, node: int, local: int
               ) -> dict[str, str]:
    """What torchrun would give a rank host, for one of a machine started again outside
    its rendezvous: no rank of torchrun's (RANK past every training rank), the job's
    store, and ENV_JOIN (moc.injob.machines)."""
    from moc.injob.machines import ENV_JOIN

    world = nodes * nproc
    return {ENV_STORE: endpoint, ENV_NODES: str(nodes), ENV_JOIN: "1",
            "RANK": str(world + node * nproc + local), "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": str(node), "GROUP_WORLD_SIZE": str(nodes),
            "MASTER_ADDR": endpoint.rsplit(":", 1)[0], "MASTER_PORT": endpoint.rsplit(":", 1)[1],
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_RUN_ID": "moc-joined"}


def serve_store(port: int) -> object:
    """The rendezvous' and the job's store, served by this process on 127.0.0.1:`port`
    for as long as it lives (the agents are its clients)."""
    import torch.distributed as dist

    from moc.topology import COLLECTIVE_TIMEOUT

    return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                         timeout=COLLECTIVE_TIMEOUT)


def _terminate(agents: list[subprocess.Popen]) -> None:
    """SIGTERM every running agent (torchrun stops its workers on it), SIGKILL after
    TERMINATE_S."""
    for a in agents:
        if a.poll() is None:
            a.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + TERMINATE_S
    for a in agents:
        with contextlib.suppress(subprocess.TimeoutExpired):
            a.wait(timeout=max(0.0, deadline - time.monotonic()))
        if a.poll() is None:
            a.kill()
            a.wait()
