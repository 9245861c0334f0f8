"""Where ranks and experts sit, and the process groups joining them.

The one module every other part of moc may import (the checkpoint package, the
reference trainer's parallelism): it imports nothing else of moc.

W ranks of data parallelism are cut into W/ep expert-parallel (EP) groups of ep
consecutive ranks. Inside an EP group the experts are split in contiguous blocks:
ep rank r holds global experts [r * E/ep, (r + 1) * E/ep). Ranks with the same ep rank in
different EP groups hold the same experts and form an expert-data-parallel (EDP) group.

    W = 4, ep = 2, E = 8:   EP groups {0,1} {2,3};  EDP groups {0,2} {1,3}
                            ranks 0, 2 hold experts 0-3; ranks 1, 3 hold experts 4-7

`ParallelLayout` is the arithmetic (pure, testable with no process group);
`ParallelGroups` the process groups of one rank; `init_distributed` joins the job.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)
"""Long enough for a slow disk under a blocking save; short enough that a hung peer
does not hold the job forever when torchrun fails to notice."""


def restart_count() -> int:
    """How many times torchrun has restarted this job (0 on the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def node_rank() -> int:
    """This process's node in the job: torchrun's GROUP_RANK (its agent's rank in the
    rendezvous), 0 outside torchrun."""
    return int(os.environ.get("GROUP_RANK", "0"))


def init_distributed(backend: str | None = None,
                     timeout: datetime.timedelta = COLLECTIVE_TIMEOUT) -> bool:
    """Join the torchrun job, in a way that survives torchrun restarts; whether a
    process group is (now) initialised. A no-op outside torchrun (no RANK in the
    environment) or when one is already initialised.

    `backend`: default nccl when CUDA is available (each rank then uses the device
    `LOCAL_RANK`), gloo otherwise. moc's checkpoint traffic always has its own gloo
    group (`ParallelGroups.side_group`), whatever training uses.

    Why not `dist.init_process_group(backend)`: torchrun keeps one store for the whole
    job, and a restarted worker would read the addresses its dead predecessors
    published there and fail to connect (gloo: "connectFullMesh failed ... Connection
    refused"). That shared store (TORCHELASTIC_USE_AGENT_STORE) is namespaced here by
    torchrun's restart count, which is right on one node. Across nodes the agents'
    counts can differ (an agent whose workers are still healthy when another node
    re-joins restarts them without counting it), so multi-node jobs turn the sharing
    off (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, as `moc train --nodes` does): rank 0
    then hosts a fresh store on a fresh port every rendezvous round, which needs no
    namespace (see docs/DECISIONS.md, Issue 14: simulated nodes).
    """
    if dist.is_initialized():
        return True
    if "RANK" not in os.environ:
        return False
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not agent_store and rank == 0, timeout=timeout)
    if agent_store:
        store = dist.PrefixStore(f"moc/attempt-{restart_count()}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=timeout)
    return True


@dataclass(frozen=True)
class ParallelLayout:
    world_size: int
    """Number of ranks; every rank is a data-parallel replica of the dense part."""
    ep: int
    """Expert-parallel degree: ranks that split one copy of the experts."""
    n_experts: int
    """Experts per MoE layer (global)."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world size must be >= 1, got {self.world_size}")
        if self.ep < 1 or self.world_size % self.ep:
            raise ValueError(
                f"ep={self.ep} must divide the number of ranks ({self.world_size}); "
                f"choose ep from {divisors(self.world_size)}")
        if self.n_experts % self.ep:
            both = sorted(set(divisors(self.world_size)) & set(divisors(self.n_experts)))
            raise ValueError(
                f"ep={self.ep} must divide the expert count ({self.n_experts}); "
                f"choose ep from {both}")

    @property
    def edp(self) -> int:
        """Replicas of each expert (size of an expert-data-parallel group)."""
        return self.world_size // self.ep

    @property
    def experts_per_rank(self) -> int:
        return self.n_experts // self.ep

    def ep_rank(self, rank: int) -> int:
        return rank % self.ep

    def ep_groups(self) -> list[list[int]]:
        return [list(range(g * self.ep, (g + 1) * self.ep)) for g in range(self.edp)]

    def edp_groups(self) -> list[list[int]]:
        return [list(range(r, self.world_size, self.ep)) for r in range(self.ep)]

    def local_experts(self, rank: int) -> range:
        """Global ids of the experts held by `rank`, in local order."""
        first = self.ep_rank(rank) * self.experts_per_rank
        return range(first, first + self.experts_per_rank)

    def expert_replicas(self, expert: int) -> list[int]:
        """Ranks that hold a copy of global expert `expert`."""
        return self.edp_groups()[expert // self.experts_per_rank]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ParallelGroups:
    """The groups one rank takes part in. With no process group (a single process
    that never called `init_process_group`) every group is None and every collective
    in `moc.parallel` is a no-op."""

    layout: ParallelLayout
    rank: int
    world: dist.ProcessGroup | None
    ep_group: dist.ProcessGroup | None
    """The ep ranks that together hold one copy of every expert (all-to-all)."""
    edp_group: dist.ProcessGroup | None
    """The ranks that hold the same experts as this one (expert gradients, ZeRO)."""
    side_group: dist.ProcessGroup | None
    """A gloo group of all ranks for checkpoint coordination, never used by the training
    stream (with NCCL training, checkpoint traffic stays on CPU and off the GPU stream)."""
    edp_side_group: dist.ProcessGroup | None = None
    """A gloo group of this rank's EDP group, for moving CPU checkpoint state between
    the replicas of an expert (the EDP group itself when training already uses gloo)."""

    @property
    def distributed(self) -> bool:
        return self.world is not None

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def ep_rank(self) -> int:
        return self.layout.ep_rank(self.rank)

    @classmethod
    def single(cls, n_experts: int) -> ParallelGroups:
        """One process, every expert local, no communication."""
        return cls(ParallelLayout(1, 1, n_experts), 0, None, None, None, None)

    @classmethod
    def from_world(cls, ep: int, n_experts: int) -> ParallelGroups:
        """Build the groups after `dist.init_process_group`. Collective: every rank calls
        it, since `new_group` must be entered by all ranks in the same order."""
        if not dist.is_initialized():
            if ep != 1:
                raise ValueError(f"ep={ep} needs torch.distributed; run under torchrun")
            return cls.single(n_experts)
        layout = ParallelLayout(dist.get_world_size(), ep, n_experts)
        rank = dist.get_rank()
        ep_group = edp_group = None
        for ranks in layout.ep_groups():
            group = dist.new_group(ranks)
            if rank in ranks:
                ep_group = group
        for ranks in layout.edp_groups():
            group = dist.new_group(ranks)
            if rank in ranks:
                edp_group = group
        side_group = dist.new_group(backend="gloo")
        edp_side_group = edp_group
        if dist.get_backend() != "gloo":
            for ranks in layout.edp_groups():
                group = dist.new_group(ranks, backend="gloo")
                if rank in ranks:
                    edp_side_group = group
        return cls(layout, rank, dist.group.WORLD, ep_group, edp_group, side_group,
                   edp_side_group)
