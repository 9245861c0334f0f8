"""The Megatron-DeepSpeed baseline: rank 0 writes the non-expert state, expert-parallel
group 0 writes the experts, and training waits for all of it.

    ckpt = blocking_checkpointer(model, optimizer, "ckpt/", groups=groups)  # the paper's
    ckpt = Checkpointer(..., policy=PECPolicy(k=1), placement=MegatronPlacement())  # PEC

Not part of the product: it is moc's synchronous engine (`moc.Checkpointer`) with another
`Placement`, composed, not inherited. The non-expert optimizer state, sharded over every
rank by ZeRO, is gathered to rank 0; each expert's optimizer state, sharded over its
replicas, to the rank of EP group 0 that holds the expert. With the full policy this is
the blocking baseline of the paper; with a partial one, PEC without fully sharded writes
(`moc train --ckpt-mode pec --no-shard`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from moc.checkpoint.plan.units import Wanted
from moc.checkpoint.policy.selection import PECPolicy
from moc.checkpoint.spec import parse_expert_key
from moc.checkpoint.state import flatten_optimizer, flatten_params, shared_state
from moc.checkpoint.sync import Checkpointer, WriteContext


class MegatronPlacement:
    """Rank 0: all non-expert state; EP group 0: the experts (collective gathers)."""

    def tensors(self, ctx: WriteContext, wanted: Wanted) -> dict[str, torch.Tensor]:
        g, spec = ctx.groups, ctx.state.spec
        expert_names = {p.name for p in spec.params}
        local = ctx.state.optimizer.local_state()
        dense_optim = flatten_optimizer(
            {n: s for n, s in local.items() if n not in expert_names}, spec)
        expert_optim = flatten_optimizer(
            {n: s for n, s in local.items() if n in expert_names}, spec)
        expert_optim = {k: v for k, v in expert_optim.items() if wanted(k)}
        dense_optim.update(ctx.state.rng())  # every generator of this rank, by key
        dense_parts = ctx.dist.gather_tensors(dense_optim, 0)
        expert_parts = ctx.dist.gather_tensors(expert_optim, g.ep_rank, edp=True)
        params = flatten_params(ctx.state.named, spec)
        tensors: dict[str, torch.Tensor] = {}
        if g.rank == 0:
            tensors.update({k: v for k, v in params.items() if parse_expert_key(k) is None})
            tensors.update(shared_state(ctx.state))  # buffers, param groups: the same everywhere
            for part in dense_parts:
                tensors.update(part)
        if g.rank < g.layout.ep:  # expert-parallel group 0 writes the experts
            tensors.update({k: v for k, v in params.items()
                            if parse_expert_key(k) is not None and wanted(k)})
            for part in expert_parts:
                tensors.update(part)
        return tensors


def blocking_checkpointer(model: nn.Module, optimizer: object, directory: str | Path,
                         **kwargs: Any) -> Checkpointer:
    """The paper's baseline: every expert, every time, written by rank 0 and EP group 0
    while training waits. Takes `Checkpointer`'s arguments but `policy` and `placement`."""
    return Checkpointer(model, optimizer, directory, policy=PECPolicy.full(),
                        placement=MegatronPlacement(), **{"mode": "blocking", **kwargs})
