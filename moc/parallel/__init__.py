"""Data, expert and expert-data parallelism for the reference trainer."""

from moc.parallel.dispatch import AllToAllDispatcher, rebind_experts, shard_experts
from moc.parallel.grads import (
    clip_grad_norm_,
    expert_parameter_names,
    split_parameters,
    sync_gradients,
)
from moc.parallel.optim import ShardedAdamW
from moc.topology import ParallelGroups, ParallelLayout

__all__ = ["AllToAllDispatcher", "ParallelGroups", "ParallelLayout", "ShardedAdamW",
           "clip_grad_norm_", "expert_parameter_names", "rebind_experts", "shard_experts",
           "split_parameters",
           "sync_gradients"]
