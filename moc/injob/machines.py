"""Lost machines, in-job: a rank host's lease in the job's store, and the standby node
that takes over every rank of a machine whose leases stopped.

When a machine is lost, its torchrun agent, rank hosts, training and persist processes
die together: no host is left to replace anything, and torchrun's agents on the other
machines notice nothing (each watches only its own workers). So every host that hosts
a training rank renews a lease in the job's store (`Lease`, every LEASE_S), and a
standby node (`moc train --nodes N --spare-nodes S`: S more torchrun agents whose hosts
hold no rank, each with a training process imported and waiting) watches them:

    every lease of node n unchanged for LOST_S (as this host's clock sees it: no clock is
    shared between machines)
      -> the standby node's leader claims node n (compare-and-set on a key named by the
         lost leader's lease, so a later loss of the same node is a new claim; a claim
         whose claimant died before it renewed the node's leases is replaced, `Claims`),
         and tells its other hosts (`adopt/<its node>`)
      -> each of its hosts takes the rank of its own local rank on node n: moves the job
         past the generation the lost rank was in, marks it replaced, and wakes its
         waiting process with that rank's identity (RANK, GROUP_RANK: the node it now
         stands for); it restores from the peer replicas the other nodes keep of node n.

The survivors' collectives fail at once (the lost ranks' sockets close with their
machine) and they wait in the next generation, in their own processes and memory.

Without a standby node, a machine started again takes the lost one's place the same
way: its hosts start outside torchrun's rendezvous (ENV_JOIN), hold no rank, and adopt
the machine whose leases stopped (`moc train --machine-restart-s S` simulates the
scheduler's restart).

The store must outlive the machine: `moc train --nodes` serves it in its launcher, as
a cluster's rendezvous endpoint would (docs/guide/multi-node.md).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

LEASE_S = 0.2
"""How often a rank's host renews its lease."""
LOST_S = 2.0
"""A node whose every lease stood still this long is lost (ten renewals missed: a host
is a small process that does little else, so a pause this long is a dead machine)."""
ENV_NODES = "MOC_TRAIN_NODES"
"""The training nodes of the job (`--nodes`); torchrun's world has the spare nodes too."""
ENV_JOIN = "MOC_INJOB_JOIN"
"""Set for the rank hosts of a machine started again outside torchrun's rendezvous (a
scheduler's restart of a lost machine, `moc train --machine-restart-s`): they hold no
rank, read the round's namespace from the job's store (NAMESPACE), and adopt a lost
machine's ranks as a spare node's hosts do. Joining torchrun's rendezvous instead
would make every agent restart its workers, the survivors' included."""
NAMESPACE = "moc/injob/namespace"
"""The current round's namespace, published in the job's store by rank 0's host (where
the job's store is not the round's own: MOC_JOB_STORE), for hosts that join later."""
JOB_FINISHED = "moc/injob/finished"
"""Set in the job's store (outside any round's namespace: a finished job has no next
round) by rank 0's host when its training process finished: the spare nodes' hosts then
end, and the launcher knows the job is done."""


@dataclass(frozen=True)
class Identity:
    """Who a training process is, as the training job counts (not torchrun, whose world
    holds the spare nodes too): its rank, the world, its node among the training nodes."""

    rank: int
    world: int
    per_node: int

    @property
    def node(self) -> int:
        return self.rank // self.per_node

    def env(self) -> dict[str, str]:
        """What a training process of this rank finds in its environment."""
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world),
                "GROUP_RANK": str(self.node),
                "GROUP_WORLD_SIZE": str(self.world // self.per_node)}


def training_world() -> tuple[int, int]:
    """(ranks that train, ranks per node): torchrun's world less the spare nodes."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    nodes = os.environ.get(ENV_NODES)
    world = int(nodes) * per_node if nodes else int(os.environ["WORLD_SIZE"])
    return world, per_node


@dataclass
class Lease:
    """A rank host's lease: `<token>:<count>:<generation>`, renewed every LEASE_S. The
    token names this host (a successor's is new); the generation is its process's, the
    one a successor moves the job past."""

    store: Any
    rank: int
    token: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    count: int = 0
    renewed: float = 0.0

    def renew(self, gen: int) -> None:
        now = time.monotonic()
        if now - self.renewed >= LEASE_S:
            self.count += 1
            self.store.set(f"lease/{self.rank}", f"{self.token}:{self.count}:{gen}")
            self.renewed = now


class LeaseWatch:
    """A standby node's view of every training rank's lease: when each last changed,
    by this host's clock."""

    def __init__(self, store: Any, world: int, per_node: int) -> None:
        self.store, self.world, self.per_node = store, world, per_node
        self.seen: dict[int, tuple[str, float]] = {}

    def lost_node(self) -> tuple[int, dict[int, str]] | None:
        """A node all of whose leases stood still for LOST_S: (the node, its ranks'
        last leases); None while every node lives."""
        now = time.monotonic()
        for rank in range(self.world):
            key = f"lease/{rank}"
            if not self.store.check([key]):
                continue
            value = self.store.get(key).decode()
            if self.seen.get(rank, ("", 0.0))[0] != value:
                self.seen[rank] = (value, now)
        for node in range(self.world // self.per_node):
            ranks = range(node * self.per_node, (node + 1) * self.per_node)
            if all(r in self.seen and now - self.seen[r][1] > LOST_S for r in ranks):
                return node, {r: self.seen[r][0] for r in ranks}
        return None

    def forget(self, node: int) -> None:
        """`node` was taken over: its ranks' next leases are its successors'."""
        for r in range(node * self.per_node, (node + 1) * self.per_node):
            self.seen.pop(r, None)


class Claims:
    """A spare node leader's claims on lost nodes. Owner: the spare host's main thread.

    A claim is a compare-and-set on `takeover/<node>/<lost leader's token>` whose value
    names this claimant and attempt (`<spare>:<token>`). A claimant that dies before its
    hosts renew the node's leases leaves the node looking lost: whoever finds it lost
    again, LOST_S after it saw that same claim, replaces the claim (a compare-and-set
    from the dead claim's value, so one of several spares wins). Before, the key alone
    decided, and a claimant lost before its first renewal held the node for ever: the
    job waited for its ranks every 30 s, and the other spare never adopted (issue 47)."""

    def __init__(self, store: Any, spare: int) -> None:
        self.store, self.spare = store, spare
        self.seen: dict[str, str] = {}
        """Per takeover key: the claim this leader last found there (not its own)."""

    def claim(self, node: int, leases: dict[int, str]) -> bool:
        """Whether this spare node won lost `node` (its ranks' last `leases`)."""
        leader = leases[min(leases)].split(":")[0]
        key = f"takeover/{node}/{leader}"
        mine = f"{self.spare}:{uuid.uuid4().hex[:12]}"
        current = self.store.compare_set(key, "", mine).decode()
        if current != mine and self.seen.get(key) == current:
            # The node is still lost a full LOST_S after that claim: its claimant died.
            current = self.store.compare_set(key, current, mine).decode()
        if current == mine:
            return True
        self.seen[key] = current
        return False


def lease_gen(lease: str) -> int:
    """The generation a lease's process was in."""
    return int(lease.rsplit(":", 1)[1])


def machine_pids(agent: int) -> list[int]:
    """`agent` and every process below it (a simulated machine: its torchrun agent and
    all it started), read from /proc, agent first."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [agent]
    while todo:
        pid = todo.pop(0)
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def lose_machine() -> None:
    """`--fault-kind machine`, from one of the machine's training processes: wipe the
    simulated machine's memory (its MOC_SHM_ROOT) and SIGKILL every process of it, its
    torchrun agent (this process's host's parent) first, so that nothing restarts."""
    root = os.environ.get("MOC_SHM_ROOT")
    if root:
        for entry in os.listdir(root):
            shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
    agent = parent_of(parent_of(os.getpid()))
    for pid in machine_pids(agent):
        if pid != os.getpid():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])
