"""Simulated nodes: `moc train --nodes N` runs N torchrun agents on this host, one per
pretend machine, joined by a c10d rendezvous on 127.0.0.1.

Each agent gets its own node-local memory root (MOC_SHM_ROOT, under one private
directory made for the run), so what moc keeps "in the node's memory" is really per
simulated node: a node fault (`--fault-kind node --fault-node J`) wipes only node J's.
The run's simulated machines, and their memory, are gone when the launcher returns: it
removes the directory. With CUDA, node i sees only its own GPUs (CUDA_VISIBLE_DEVICES),
so that no two ranks of the job share a device.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

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


def sim_root() -> Path:
    """A fresh directory only this user can enter (0700), for the nodes' memory: under
    $MOC_SHM_ROOT if set, else /dev/shm (tmpfs, as a node's snapshots are), else the
    temporary directory."""
    base = os.environ.get("MOC_SHM_ROOT") or ("/dev/shm" if os.path.isdir("/dev/shm")
                                              else None)
    return Path(tempfile.mkdtemp(prefix="moc-nodes-", dir=base))


def agent_argv(nodes: int, nproc: int, max_restarts: int, endpoint: str, run_id: str,
               worker: list[str]) -> list[str]:
    """The torchrun command line of one simulated node (the same for every node: c10d
    gives each its node rank)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes),
            "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
            "--max-restarts", str(max_restarts), "--module", "moc.train", *worker]


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
              gpus: int = 0) -> int:
    """Start `nodes` torchrun agents of `nproc` ranks each running `moc.train worker`;
    wait for all. 0 only if every agent exits 0. When one fails the others get GRACE_S
    to end on their own, then are terminated; Ctrl-C terminates all. `gpus`: GPUs per
    node to hand out (0: the CPU)."""
    root = sim_root()
    endpoint = f"127.0.0.1:{free_port()}"
    run_id = f"moc-{uuid.uuid4().hex[:12]}"
    agents: list[subprocess.Popen] = []
    # SIGTERM (a scheduler stopping the job) stops the nodes as Ctrl-C does.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        for node in range(nodes):
            (root / f"node-{node}").mkdir(mode=0o700)
            agents.append(subprocess.Popen(
                agent_argv(nodes, nproc, max_restarts, endpoint, run_id, worker),
                env=node_env(root, node, nproc, gpus)))
        codes = _wait(agents)
    except KeyboardInterrupt:
        _terminate(agents)
        print("moc train: interrupted; every simulated node stopped", file=sys.stderr)
        return 130
    finally:
        _terminate(agents)  # a no-op once all have exited
        shutil.rmtree(root, ignore_errors=True)
        signal.signal(signal.SIGTERM, previous)
    failed = [f"node {i}: exit {c}" for i, c in enumerate(codes) if c != 0]
    if failed:
        print(f"moc train: error: simulated nodes failed ({'; '.join(failed)})",
              file=sys.stderr)
        return 1
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _wait(agents: list[subprocess.Popen]) -> list[int]:
    """Every agent's exit status; after the first failure the rest have GRACE_S."""
    deadline = None
    while any(a.poll() is None for a in agents):
        if deadline is None and any(a.poll() not in (None, 0) for a in agents):
            deadline = time.monotonic() + GRACE_S
        if deadline is not None and time.monotonic() > deadline:
            _terminate(agents)
            break
        time.sleep(POLL_S)
    return [a.wait() for a in agents]


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
