"""Expert parallelism: narrow each rank's experts and route tokens to them by all-to-all.

Design note: the model's MoE layer sorts its routed rows by global expert id and calls a
dispatcher. `AllToAllDispatcher` cuts those rows by destination ep rank, exchanges the
per-expert counts (one small all-to-all), sends the rows (a second, autograd-aware
all-to-all), regroups what arrived by local expert, runs the experts, and sends the
results back the way they came. Gradients flow through the same all-to-alls reversed,
so an expert's gradient on its owner sums the contributions of every rank in the EP group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moc.model.transformer import Experts, MoE, local_dispatch
from moc.topology import ParallelGroups


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with row splits; backward swaps the splits."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        out_splits, in_splits = ctx.splits
        grad_in = grad_out.new_empty((sum(in_splits), *grad_out.shape[1:]))
        dist.all_to_all_single(grad_in, grad_out.contiguous(), in_splits, out_splits,
                               group=ctx.group)
        return grad_in, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
               group: dist.ProcessGroup) -> torch.Tensor:
    return _AllToAll.apply(x, out_splits, in_splits, group)


class AllToAllDispatcher:
    """Sends rows grouped by global expert to the ep rank holding that expert."""

    def __init__(self, group: dist.ProcessGroup, ep: int) -> None:
        self.group = group
        self.ep = ep

    def __call__(self, experts: Experts, x_AD: torch.Tensor, counts_E: list[int]
                 ) -> torch.Tensor:
        ep, L = self.ep, experts.n_local
        # The counts travel on the rows' device: NCCL sends only CUDA tensors.
        send_counts_RL = torch.tensor(counts_E, dtype=torch.int64,
                                      device=x_AD.device).view(ep, L)
        recv_counts_RL = torch.empty_like(send_counts_RL)
        # Blocks until every rank of the EP group has sent its counts.
        dist.all_to_all_single(recv_counts_RL, send_counts_RL, group=self.group)
        in_splits = send_counts_RL.sum(1).tolist()
        out_splits = recv_counts_RL.sum(1).tolist()
        recv_x = all_to_all(x_AD, out_splits, in_splits, self.group)

        # Arrived rows are ordered (source rank, local expert); experts want
        # (local expert, source rank).
        # Built on the host from the counts (a no-op copy on the CPU), used on the rows'
        # device.
        perm = _regroup_permutation(recv_counts_RL.cpu()).to(x_AD.device)
        y = experts(recv_x[perm], recv_counts_RL.sum(0).tolist())
        y = y[torch.argsort(perm)]
        return all_to_all(y, in_splits, out_splits, self.group)


def _regroup_permutation(counts_RL: torch.Tensor) -> torch.Tensor:
    """Row indices that reorder segments laid out (r, l) into (l, r) order."""
    R, L = counts_RL.shape
    starts_RL = (torch.cumsum(counts_RL.flatten(), 0) - counts_RL.flatten()).view(R, L)
    segments = [torch.arange(int(starts_RL[r, e]), int(starts_RL[r, e] + counts_RL[r, e]))
                for e in range(L) for r in range(R)]
    return torch.cat(segments) if segments else torch.zeros(0, dtype=torch.int64)


@torch.no_grad()
def shard_experts(model: nn.Module, groups: ParallelGroups) -> None:
    """Keep only this rank's experts in every MoE layer and route tokens by all-to-all.

    Call it on a model built identically on every rank (same seed): each rank narrows
    the full expert tensors to its own contiguous block, so a run with expert
    parallelism starts from exactly the weights a single process would have.
    """
    layout = groups.layout
    local = layout.local_experts(groups.rank)
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        experts = module.experts
        if experts.n_local != layout.n_experts:
            raise ValueError(f"shard_experts expects the full {layout.n_experts} experts, "
                             f"found {experts.n_local}: was the model sharded twice?")
        for name, param in list(experts.named_parameters(recurse=False)):
            setattr(experts, name, nn.Parameter(param[local.start:local.stop].clone()))
        experts.expert_offset = local.start
        if layout.ep > 1:
            module.dispatcher = AllToAllDispatcher(groups.ep_group, layout.ep)
        else:
            module.dispatcher = local_dispatch


def rebind_experts(model: nn.Module, groups: ParallelGroups) -> None:
    """Route `model`'s tokens over `groups`, new process groups of the same layout (in-job
    recovery rebuilt them): the experts this rank holds stay as they are."""
    for module in model.modules():
        if isinstance(module, MoE) and isinstance(module.dispatcher, AllToAllDispatcher):
            module.dispatcher = AllToAllDispatcher(groups.ep_group, groups.layout.ep)
