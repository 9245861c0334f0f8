"""The messages between the training ranks of a node and its persist process.

One Unix socket per job (`<job dir>/persist.sock`, in the job's 0700 directory); each
training rank holds one connection; messages are these frozen dataclasses.

Wire format (why it cannot run code): `multiprocessing.connection` frames the bytes and
authenticates both ends with its HMAC challenge, keyed by a random secret of this
persist process (`persist.key`, 0600 in the job directory: written by rank 0 before it
starts the process, handed to the process on its stdin, read by the other ranks). The
payload of each frame is `moc.checkpoint.codec`'s JSON, never a pickle
(`send_bytes`/`recv_bytes`, never `send`/`recv`): a message can only decode to plain
data and to the classes below (registered with the codec at the end of this module,
which `codec.CLASSES` must list), and anything else is refused. The secret is regenerated
each time rank 0 starts a persist process (`generation`), so a process that read an
older one cannot speak to the new one.

    rank r -> persist    Hello(rank)                  once, after connecting
    rank r -> persist    Ready(rank, step, slot, write, held)
                                                      its snapshot of `step` is complete
                                                      in `slot`; it writes the keys `write`
                                                      and holds the keys `held`
    rank r -> persist    Failed(rank, step, error)    its snapshot of `step` failed: the
                                                      persist of `step` must not wait for it
    leader -> persist    Persist(step, prev_step, template, node_ranks, node, n_nodes,
                                 nonce, global_world, tidy)
                                                      persist `step` once every rank of the
                                                      node is Ready; node 0's process also
                                                      commits it, chained to `prev_step`,
                                                      once every node's part is written
                                                      (`twolevel.persist.commit`)
    leader -> persist    Abandon(step)                `step` failed: stop waiting for it
    leader -> persist    Stop()                       the job is closing
    persist -> leader    Done(step, ok, error, seconds, bytes_per_rank, phases, manifest)
                                                      `step` was committed (ok) or given up
                                                      (node j > 0: its part was written);
                                                      node 0's carries the manifest it
                                                      committed

A node's leader is its local rank 0; "rank 0" below means the leader of each node for
its own process, and global rank 0 (node 0's leader) for the commit's result.

Ordering: a rank sends Ready or Failed for a step only after rank 0 decided to persist it
(the decision is part of the plan, which every rank runs), but the persist process may
receive a Ready before the Persist it belongs to; it keeps both until they meet. It runs
one persist at a time, in the order of the Persist requests, and answers each with one
Done. Ready and Failed messages of steps older than the one just finished are dropped.

Liveness: the persist process exits, committing nothing more, when rank 0 (its parent) is
gone; rank 0 reads a closed connection or an exited process as the persist process being
gone (`PERSIST_GONE`), and kills one its watch finds stopped or hung (`twolevel.persist.watch`:
no Done within the hang limit; `PERSIST_KILLED`). Rank 0 then starts a new one (at most
`MAX_RESTARTS` per job) with a new secret and generation, shares the generation with
every rank at the next plan, and every rank reconnects before that plan's snapshot
reports Ready.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moc.checkpoint import codec

SECRET_BYTES = 32
"""Length of a persist process's random secret (its HMAC key)."""
MAX_MESSAGE_BYTES = 64 << 20
"""The largest frame either end accepts: a Persist's template names every key. A Done
may carry a manifest on top (`MAX_DONE_BYTES`)."""
MAX_DONE_BYTES = MAX_MESSAGE_BYTES + (1 << 30)
"""The largest Done a leader accepts from its own persist process: a message and a
manifest (at most `manifest.MAX_MANIFEST_BYTES`)."""
MAX_RESTARTS = 3
"""How many times rank 0 starts a new persist process after one died or was killed (its
watch found it stopped or hung), per job: a crash of the process (a bug, an OOM kill) or
a stop should not end durable checkpointing, but one that keeps dying is a fault to
report (`close()` raises), not to retry forever."""
PERSIST_GONE = "the persist process exited; this checkpoint is kept in memory only"
PERSIST_KILLED = ("the persist process was killed ({}); this checkpoint is kept in memory "
                  "only, and a new process persists the next one")
"""The outcome of the persist a leader's watch killed its process over
(`twolevel.persist.watch`)."""
PERSIST_TIMEOUT_S = 600.0
"""How long a persist may go unanswered before any was timed (`watch.PersistWatch.limit`),
and how long a node's process waits for another node's records (`twolevel.persist.commit`);
longer than writing any sane checkpoint."""


@dataclass(frozen=True)
class Hello:
    rank: int


@dataclass(frozen=True)
class Ready:
    rank: int
    step: int
    slot: int
    write: list[str]
    """Keys of the snapshot this rank writes under the sharded plan."""
    held: list[str]
    """Every key this rank holds: the manifest keeps exactly the keys some rank holds."""


@dataclass(frozen=True)
class Failed:
    rank: int
    step: int
    error: str


@dataclass(frozen=True)
class Persist:
    step: int
    prev_step: int | None
    """The committed step whose manifest this one chains from (None: a new chain)."""
    template: dict[str, Any] | None
    """The manifest's fields except entries and files (JSON-ready); None on a node other
    than 0 (only node 0's process commits)."""
    node_ranks: int
    """The ranks of this node: the persist waits for a Ready from each."""
    node: int = 0
    n_nodes: int = 1
    nonce: str = ""
    """The job's, shared by rank 0 at start: marks this job's records on storage
    (`twolevel.persist.commit`)."""
    global_world: int = 0
    """Ranks of the whole job (0: `node_ranks`), for Done's bytes_per_rank."""
    tidy: dict[int, str] | None = None
    """Node 0, the first request after the engine started or restored: the clean-up the
    read path left for the write path (`store.tidy`: corrupt steps to set aside, by step,
    and abandoned directories), done by the process before it writes this step."""


@dataclass(frozen=True)
class Abandon:
    """A node leader -> its persist process: `step` failed elsewhere; stop waiting for
    the other nodes' records of it."""

    step: int


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class Done:
    step: int
    ok: bool
    error: str | None = None
    seconds: float = 0.0
    bytes_per_rank: list[int] | None = field(default=None)
    phases: dict[str, list[float]] | None = None
    """Where the persist's time went: {phase: [wall s, CPU s, page faults]}
    (`Phases.to_dict`)."""
    manifest: str | None = None
    """Node 0, a committed step: the manifest's JSON as committed. The chain continues
    from it on every rank without reading storage back: a plan runs while training may
    wait for it, and a store that hangs or fails (an outage, an NFS server gone) must
    slow the persist down, never a training step (issue 29)."""


codec.register(Hello, Ready, Failed, Persist, Abandon, Stop, Done)
