"""Optimizer state by parameter name, whatever optimizer holds it.

The checkpoint engine needs three things of an optimizer: which parameters' state this
rank holds, that state keyed by parameter name, and a way to put it back. moc's
`ShardedAdamW` provides them directly; any `torch.optim.Optimizer` is adapted here (it
holds the state of every parameter it was given).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from moc.parallel.optim import load_named_state


@runtime_checkable
class OptimizerState(Protocol):
    def owned_names(self) -> list[str]:
        """Parameters whose optimizer state lives on this rank."""
        ...

    def local_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """{param name: {state name: tensor}} for owned parameters that have state."""
        ...

    def load_local_state(self, states: dict[str, dict[str, torch.Tensor]]) -> None:
        """Install `states`; owned parameters missing from it start fresh."""
        ...


class TorchOptimizerState:
    """Adapts a plain `torch.optim.Optimizer` (every parameter's state is local)."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
        self.optimizer = optimizer
        self._name_of = {id(p): n for n, p in model.named_parameters()}
        unknown = [p for g in optimizer.param_groups for p in g["params"]
                   if id(p) not in self._name_of]
        if unknown:
            raise ValueError(f"the optimizer holds {len(unknown)} tensors that are not "
                             "parameters of the model; pass the model it optimizes")

    def owned_names(self) -> list[str]:
        return [self._name_of[id(p)] for g in self.optimizer.param_groups for p in g["params"]]

    def local_state(self) -> dict[str, dict[str, torch.Tensor]]:
        return {self._name_of[id(p)]: {k: v if isinstance(v, torch.Tensor) else torch.tensor(v)
                                       for k, v in state.items()}
                for p, state in self.optimizer.state.items() if state}

    def load_local_state(self, states: dict[str, dict[str, torch.Tensor]]) -> None:
        load_named_state(self.optimizer, self._name_of, states)


def as_optimizer_state(optimizer: object, model: nn.Module) -> OptimizerState:
    if isinstance(optimizer, OptimizerState):
        return optimizer
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return TorchOptimizerState(optimizer.optim, model)  # this rank's partition
    if isinstance(optimizer, torch.optim.Optimizer):
        return TorchOptimizerState(optimizer, model)
    raise TypeError(f"cannot checkpoint optimizer of type {type(optimizer).__name__}: expected "
                    "a torch.optim.Optimizer or an object with owned_names/local_state/"
                    "load_local_state (see moc.checkpoint.optim_state.OptimizerState)")
