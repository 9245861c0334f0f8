"""Where ranks and experts sit: pure arithmetic, testable with no process group.

W ranks of data parallelism are cut into W/ep expert-parallel (EP) groups of ep
consecutive ranks. Inside an EP group the experts are split in contiguous blocks:
ep rank r holds global experts [r * E/ep, (r + 1) * E/ep). Ranks with the same ep rank in
different EP groups hold the same experts and form an expert-data-parallel (EDP) group.

    W = 4, ep = 2, E = 8:   EP groups {0,1} {2,3};  EDP groups {0,2} {1,3}
                            ranks 0, 2 hold experts 0-3; ranks 1, 3 hold experts 4-7
"""

from __future__ import annotations

from dataclasses import dataclass


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
