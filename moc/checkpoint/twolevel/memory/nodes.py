"""Which ranks share a machine, and which machine keeps whose replicas (pure arithmetic).

Node-local memory is what a machine loss takes with it: each node has its own snapshot
directory and its own persist process, run by its leader (local rank 0). torchrun numbers
ranks node by node, `per_node` consecutive ranks per node:

    world 4, 2 per node:   node 0 = ranks {0, 1} (leader 0),  node 1 = {2, 3} (leader 2)

Peer replicas go to another failure domain: node i sends to node (i + jump) mod n, each
rank to the rank of the same local rank there (NVIDIA's resiliency extension calls it
`replication_jump`). A jump of 0 mod n would keep the replica on the node it protects
against, so it is refused.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


def node_memory_root() -> Path:
    """Where node-local snapshots live: /dev/shm (tmpfs: they outlive processes, not the
    node), or $MOC_SHM_ROOT. What a node's loss wipes."""
    return Path(os.environ.get("MOC_SHM_ROOT", "/dev/shm"))


@dataclass(frozen=True)
class NodeLayout:
    world_size: int
    per_node: int
    """Ranks per node (torchrun's LOCAL_WORLD_SIZE)."""

    def __post_init__(self) -> None:
        if self.per_node < 1 or self.world_size % self.per_node:
            raise ValueError(f"{self.world_size} ranks cannot be split into nodes of "
                             f"{self.per_node}: every node must run the same number of ranks "
                             "(torchrun --nproc-per-node)")

    @classmethod
    def from_env(cls, world_size: int) -> NodeLayout:
        """The layout torchrun describes in this process's environment (one node without
        torchrun)."""
        return cls(world_size, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))

    @property
    def n_nodes(self) -> int:
        return self.world_size // self.per_node

    def node(self, rank: int) -> int:
        return rank // self.per_node

    def local_rank(self, rank: int) -> int:
        return rank % self.per_node

    def leader(self, node: int) -> int:
        """The rank that runs `node`'s persist process and owns its memory."""
        return node * self.per_node

    def is_leader(self, rank: int) -> bool:
        return self.local_rank(rank) == 0

    def ranks(self, node: int) -> list[int]:
        return list(range(node * self.per_node, (node + 1) * self.per_node))

    def check_jump(self, jump: int) -> None:
        if self.n_nodes > 1 and jump % self.n_nodes == 0:
            raise ValueError(f"replica jump {jump} sends every node's replica to itself with "
                             f"{self.n_nodes} nodes; choose a jump in 1..{self.n_nodes - 1}")

    def replica_dst(self, rank: int, jump: int) -> int:
        """Where `rank` keeps its replica: the same local rank, `jump` nodes on."""
        node = (self.node(rank) + jump) % self.n_nodes
        return node * self.per_node + self.local_rank(rank)

    def replica_src(self, rank: int, jump: int) -> int:
        """Whose replica `rank` keeps (the inverse of `replica_dst`)."""
        node = (self.node(rank) - jump) % self.n_nodes
        return node * self.per_node + self.local_rank(rank)
