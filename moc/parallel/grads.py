"""Gradient reduction and clipping for data + expert parallelism.

The global loss is the mean of the W ranks' losses. Dense gradients are therefore
averaged over all W ranks. An expert's gradient on its owner already sums what every
rank of its EP group sent through the all-to-all; summing over the EDP group (the other
copies of that expert) covers all W ranks, and dividing by W gives the mean.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from moc.model.transformer import Experts
from moc.topology import ParallelGroups


def expert_parameter_names(model: nn.Module) -> list[str]:
    """Names (as in `model.named_parameters()`) of the parameters held by Experts."""
    return [f"{mod_name}.{p_name}" if mod_name else p_name
            for mod_name, module in model.named_modules() if isinstance(module, Experts)
            for p_name, _ in module.named_parameters(recurse=False)]


def split_parameters(model: nn.Module) -> tuple[list[tuple[str, nn.Parameter]],
                                                list[tuple[str, nn.Parameter]]]:
    """(dense, expert) named parameters, each in `named_parameters()` order."""
    expert_names = set(expert_parameter_names(model))
    dense, experts = [], []
    for name, p in model.named_parameters():
        (experts if name in expert_names else dense).append((name, p))
    return dense, experts


def _all_reduce_mean(params: list[nn.Parameter], group: dist.ProcessGroup | None,
                     group_size: int, divisor: int) -> None:
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    if not grads:
        return
    # One flat buffer: one collective instead of one per tensor.
    flat = _flatten_dense_tensors(grads)
    if group is not None and group_size > 1:
        dist.all_reduce(flat, group=group)
    flat.div_(divisor)
    for p, g in zip(params, _unflatten_dense_tensors(flat, grads), strict=True):
        p.grad = g


def sync_gradients(model: nn.Module, groups: ParallelGroups) -> None:
    """Average gradients: dense over all ranks, experts over their EDP group (see module doc)."""
    if not groups.distributed:
        return
    dense, experts = split_parameters(model)
    W = groups.world_size
    _all_reduce_mean([p for _, p in dense], groups.world, W, W)
    _all_reduce_mean([p for _, p in experts], groups.edp_group, groups.layout.edp, W)


def clip_grad_norm_(model: nn.Module, groups: ParallelGroups, max_norm: float) -> torch.Tensor:
    """Clip by the norm of the full (global) gradient; call after `sync_gradients`.

    Dense gradients are identical on every rank; each EP group holds every expert once,
    so the expert part is the sum of squares over the EP group.
    """
    dense, experts = split_parameters(model)
    # On the parameters' device: the all-reduce below may be NCCL's (CUDA tensors only).
    zero = torch.zeros((), device=next(model.parameters()).device)
    dense_sq = sum((p.grad.float().pow(2).sum() for _, p in dense if p.grad is not None),
                   zero)
    expert_sq = sum((p.grad.float().pow(2).sum() for _, p in experts if p.grad is not None),
                    zero)
    if groups.distributed and groups.layout.ep > 1:
        dist.all_reduce(expert_sq, group=groups.ep_group)
    total = (dense_sq + expert_sq).sqrt()
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for _, p in dense + experts:
        if p.grad is not None:
            p.grad.mul_(scale)
    return total
