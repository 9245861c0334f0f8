"""AdamW with its state sharded ZeRO-1 style, one partition per replication group.

Dense parameters are replicated on all W ranks, so their optimizer state is split across
all W (`ZeroRedundancyOptimizer` over the world group). Expert parameters are replicated
only on their EDP group, so their state is split across that group. Each rank updates
the parameters it owns and ZeRO broadcasts the result to the other replicas.

Checkpointing needs to name state, not index it: `local_state()` returns the state of the
parameters this rank owns keyed by parameter name, and `load_local_state()` puts it back,
whatever the partition was when it was saved. `hyperparameters()` describes the param
groups as ZeRO's wrappers hold them, with every rank's parameters, so every rank describes
the same groups whatever its partition, and a restore on another world size matches them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from moc.checkpoint.optimizers import describe_groups, load_named_state, set_hyperparameters
from moc.parallel.grads import split_parameters
from moc.topology import ParallelGroups

if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer


class ShardedAdamW:
    def __init__(self, model: nn.Module, groups: ParallelGroups, *, lr: float,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.1) -> None:
        dense, experts = split_parameters(model)
        self._by_name = dict(dense + experts)
        self._name_of = {id(p): n for n, p in self._by_name.items()}
        self._names: dict[tuple[int, ...], list[str]] = {}  # `describe_groups`' cache
        self._layout = groups.layout
        self._expert_names = {n for n, _ in experts}
        kwargs = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        self.optimizers: list[torch.optim.Optimizer] = []
        self._zero: list[tuple[ZeroRedundancyOptimizer, str]] = []
        """Each ZeRO optimizer and the group it shards over ("world" or "edp")."""
        for which, named, group, size in (
                ("world", dense, groups.world, groups.world_size),
                ("edp", experts, groups.edp_group, groups.layout.edp)):
            if not named:
                continue
            # Norm gains and other vectors are not decayed.
            param_groups = [
                {"params": [p for _, p in named if p.dim() >= 2]},
                {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0},
            ]
            param_groups = [g for g in param_groups if g["params"]]
            if groups.distributed and size > 1:
                # Imported here: torch.distributed.optim imports FSDP and DTensor, 1.1 s
                # of the start of every process that imports moc (`shards.is_dtensor`).
                from torch.distributed.optim import ZeroRedundancyOptimizer

                opt = ZeroRedundancyOptimizer(param_groups, optimizer_class=torch.optim.AdamW,
                                              process_group=group, **kwargs)
                self._zero.append((opt, which))
            else:
                opt = torch.optim.AdamW(param_groups, **kwargs)
            self.optimizers.append(opt)

    def rebind(self, groups: ParallelGroups) -> None:
        """Communicate over `groups`, new process groups of the same layout (in-job
        recovery rebuilt them; ranks and sizes are unchanged, so ZeRO's partition and the
        moments it holds stay valid): only the group ZeRO broadcasts on changes."""
        if groups.layout != self._layout:
            raise ValueError(f"ShardedAdamW.rebind: the layout changed ({self._layout} -> "
                             f"{groups.layout}); build a new optimizer and restore instead")
        for opt, which in self._zero:
            opt.process_group = groups.world if which == "world" else groups.edp_group

    def reset(self) -> None:
        """Forget every moment and step count, as a new optimizer has none (the model is
        back at its initial weights: in-job recovery before any checkpoint)."""
        for opt in self.optimizers:
            opt.state.clear()
            if self._is_zero(opt):
                opt.optim.state.clear()

    def set_lr(self, lr: float) -> None:
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = lr

    def step(self) -> None:
        """Update owned parameters; ZeRO broadcasts them to their replicas (collective)."""
        for opt in self.optimizers:
            opt.step()

    def _local(self) -> Iterator[torch.optim.Optimizer]:
        for opt in self.optimizers:
            yield opt.optim if self._is_zero(opt) else opt

    def _is_zero(self, opt: torch.optim.Optimizer) -> bool:
        return any(opt is z for z, _ in self._zero)

    def owner_of(self, name: str, ep_rank: int) -> int:
        """Global rank owning the optimizer state of parameter `name`; for an expert
        parameter, of the copy held by expert-parallel rank `ep_rank`.

        Every rank can answer for every parameter without communication: ZeRO's
        partition is a deterministic function of the parameters, and every EDP group
        partitions the same parameter names with the same shapes in the same order.
        """
        param = self._by_name[name]
        expert = name in self._expert_names
        for opt in self.optimizers:
            if not self._is_zero(opt):
                if any(param is p for g in opt.param_groups for p in g["params"]):
                    return ep_rank if expert else 0  # an unsharded group of one
                continue
            if param in opt._param_to_rank:  # private but stable since torch 1.8
                j = opt._param_to_rank[param]
                return ep_rank + j * self._layout.ep if expert else j
        raise KeyError(f"parameter {name!r} is not optimized by this ShardedAdamW")

    def owned_names(self) -> list[str]:
        """Parameters whose optimizer state lives on this rank."""
        return [self._name_of[id(p)] for local in self._local()
                for group in local.param_groups for p in group["params"]]

    def local_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """{param name: {"step", "exp_avg", "exp_avg_sq"}} for owned params with state."""
        return {self._name_of[id(p)]: dict(state)
                for local in self._local() for p, state in local.state.items()}

    def load_local_state(self, states: dict[str, dict[str, torch.Tensor]]) -> None:
        """Install state for owned parameters. An owned parameter missing from `states`
        (saved before its first update) starts fresh, as it did then."""
        for local in self._local():
            load_named_state(local, self._name_of, states)

    def hyperparameters(self) -> list[dict[str, Any]]:
        """Every param group (dense decayed, dense not decayed, then the same for
        experts), with every rank's parameters: ZeRO's wrapper holds them all and drives
        the hyperparameters (it copies them into its partition at each step)."""
        return [g for opt in self.optimizers for g in describe_groups(
            opt.param_groups, self._name_of, self._names)]

    def load_hyperparameters(self, groups: list[dict[str, Any]]) -> None:
        """Set every group's hyperparameters, in the order `hyperparameters()` lists them,
        in the wrapper and in this rank's partition (which has the same groups)."""
        at = 0
        for opt, local in zip(self.optimizers, self._local(), strict=True):
            n = len(opt.param_groups)
            set_hyperparameters(opt.param_groups, groups[at:at + n])
            if local is not opt:
                set_hyperparameters(local.param_groups, groups[at:at + n])
            at += n

