"""Process groups for data, expert and expert-data parallelism."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from moc.parallel.layout import ParallelLayout


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
