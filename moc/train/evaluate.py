"""The loss every rank agrees on: a step's, averaged over the ranks, and the validation
loss over evenly spaced windows of the validation split (the same on every run)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moc.parallel import ParallelGroups
from moc.train.config import TrainConfig
from moc.train.data import Corpus, rank_slice, windows


def mean_over_ranks(value: torch.Tensor, groups: ParallelGroups) -> float:
    """`value` averaged over every rank (collective)."""
    value = value.detach().clone().float()
    if groups.distributed:
        dist.all_reduce(value, group=groups.world)
        value /= groups.world_size
    return value.item()


@torch.no_grad()
def validation_loss(model: nn.Module, corpus: Corpus, cfg: TrainConfig,
                    groups: ParallelGroups, device: torch.device) -> float:
    """Cross-entropy over `cfg.eval_batches` batches per rank (collective)."""
    T = cfg.model.seq_len
    n_windows = (len(corpus.val) - 1) // T
    total = cfg.eval_batches * cfg.batch_size * groups.world_size
    # Evenly spaced windows over the validation split, the same on every run.
    starts = torch.linspace(0, n_windows - 1, total).long() * T
    mine = rank_slice(starts, groups.rank, groups.world_size)
    losses = []
    for batch in mine.split(cfg.batch_size):
        x_BT, y_BT = (t.to(device) for t in windows(corpus.val, batch, T))
        losses.append(model(x_BT, y_BT).ce_loss)
    return mean_over_ranks(torch.stack(losses).mean(), groups)
