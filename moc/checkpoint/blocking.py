"""The baseline to beat: Megatron-DeepSpeed-style blocking checkpoints.

Training stops while rank 0 writes all non-expert state (weights, the non-expert
optimizer state gathered from its ZeRO owners, every rank's RNG, the loop's JSON state)
and the ranks of expert-parallel group 0 (ranks 0..ep-1) write all expert state (their
experts' weights and the expert optimizer state gathered from their EDP group). Every
other rank writes nothing and waits. The files are fsynced and the step is committed
atomically by rank 0 once every writer has reported.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moc.checkpoint.manifest import Entry, Manifest
from moc.checkpoint.recovery import RestoreResult, restore_latest
from moc.checkpoint.spec import ExpertSpec, flatten_optimizer, flatten_params, rng_key
from moc.checkpoint.storage import (
    begin_step,
    commit_step,
    rank_file,
    remove_abandoned,
    tmp_dir,
    write_safetensors,
)
from moc.parallel.groups import ParallelGroups
from moc.parallel.optim import ShardedAdamW


@dataclass(frozen=True)
class SaveStats:
    step: int
    stall_s: float
    """Time training was blocked by this save."""
    bytes_per_rank: list[int]
    mode: str

    @property
    def bytes(self) -> int:
        return sum(self.bytes_per_rank)


def _gather(obj: Any, dst: int, group: dist.ProcessGroup | None, groups: ParallelGroups
            ) -> list[Any] | None:
    """gather_object to global rank `dst`; returns the list there, None elsewhere."""
    if not groups.distributed:
        return [obj]
    size = dist.get_world_size(group)
    out = [None] * size if groups.rank == dst else None
    dist.gather_object(obj, out, dst=dst, group=group)
    return out


class BlockingCheckpointer:
    mode = "blocking"

    def __init__(self, root: str | Path, model: nn.Module, optimizer: ShardedAdamW,
                 groups: ParallelGroups, model_meta: dict[str, Any]) -> None:
        self.root = Path(root)
        self.model = model
        self.optimizer = optimizer
        self.groups = groups
        self.model_meta = model_meta
        self.spec = ExpertSpec.from_model(model)

    def save(self, step: int, extra: dict[str, Any]) -> SaveStats:
        """Write a full checkpoint of `step`. Blocks every rank until it is committed."""
        t0 = time.perf_counter()
        g = self.groups
        side = g.side_group
        expert_names = {p.name for p in self.spec.params}
        local = self.optimizer.local_state()
        dense_state = {n: s for n, s in local.items() if n not in expert_names}
        expert_state = {n: s for n, s in local.items() if n in expert_names}

        # Consolidate onto the writers, as the baseline does.
        dense_states = _gather(dense_state, 0, side, g)
        rngs = _gather(torch.get_rng_state(), 0, side, g)
        expert_states = _gather(expert_state, g.ep_rank, g.edp_group, g)

        if g.rank == 0:
            begin_step(self.root, step)
        self._barrier()

        tensors: dict[str, torch.Tensor] = {}
        params = flatten_params(self.model, self.spec)
        if g.rank == 0:
            tensors.update({k: v for k, v in params.items() if "/expert=" not in k})
            for states in dense_states:
                tensors.update(flatten_optimizer(states, self.spec))
            tensors.update({rng_key(r): t for r, t in enumerate(rngs)})
        if g.rank < g.layout.ep:  # expert-parallel group 0
            tensors.update({k: v for k, v in params.items() if "/expert=" in k})
            for states in expert_states:
                tensors.update(flatten_optimizer(states, self.spec))

        entries: dict[str, Entry] = {}
        nbytes = 0
        if tensors:
            name = rank_file(g.rank)
            path = tmp_dir(self.root, step) / name
            records = write_safetensors(path, tensors)
            nbytes = path.stat().st_size
            entries = {k: Entry(step, name, r.dtype, r.shape, r.crc32)
                       for k, r in records.items()}
        reports = _gather((g.rank, entries, nbytes), 0, side, g)

        bytes_per_rank = [0] * g.world_size
        if g.rank == 0:
            all_entries: dict[str, Entry] = {}
            files = {}
            for rank, rank_entries, rank_bytes in reports:
                all_entries.update(rank_entries)
                bytes_per_rank[rank] = rank_bytes
                if rank_bytes:
                    files[rank_file(rank)] = rank_bytes
            manifest = Manifest(step=step, mode=self.mode,
                                layout={"world_size": g.world_size, "ep": g.layout.ep},
                                model=self.model_meta, entries=all_entries, files=files,
                                extra=extra)
            commit_step(self.root, step, manifest.to_json())
        self._barrier()  # blocks until the step is committed: the baseline's stall
        return SaveStats(step, time.perf_counter() - t0, bytes_per_rank, self.mode)

    def restore(self) -> RestoreResult | None:
        if self.groups.rank == 0:
            remove_abandoned(self.root)
        self._barrier()
        return restore_latest(self.root, self.model, self.optimizer, self.spec, self.groups,
                              self.model_meta)

    def _barrier(self) -> None:
        if self.groups.distributed:
            dist.barrier(group=self.groups.side_group)

    def close(self) -> None:
        """Nothing runs in the background: every save finished before it returned."""
