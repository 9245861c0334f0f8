"""The two-level engine's hooks on every optimizer's step (torch's global lists).

    hooks = OptimizerHooks(engine, params, prepare)   # registered; hooks.remove() at
                                                      # close or abandon

before a step    a step of an optimizer over the engine's model waits for the snapshot
                 being captured, as `wait_for_snapshot()` would
after a step     after the first one, the snapshot slots are prepared for the state's
                 size, in the background (`Snapshotter.prepare`)

The hooks are global, so that optimizers the engine was not given (a ZeRO partition's
inner one, a second optimizer over some of the same parameters) are seen too; a step of
an optimizer over other parameters is left alone, and outside a snapshot (after the
first step) each hook returns at once. The engine is held by weak reference: a dropped
engine is not kept alive by torch's lists. What the hooks need of it is a Protocol
(`Hooked`), so that this module does not import the engine's.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)


class Hooked(Protocol):
    """The engine, as the hooks see it."""

    @property
    def capturing(self) -> bool:
        """Whether a snapshot is being captured (its tensors must not change yet)."""
        ...

    def wait_for_snapshot(self) -> None: ...


class OptimizerHooks:
    """Both hooks of one engine, registered at construction. `params`: the engine's
    model's; `prepare`: prepares the snapshot slots ahead of the first snapshot (it
    must not hold the engine). Owner: the engine."""

    def __init__(self, engine: Hooked, params: Iterable[torch.Tensor],
                 prepare: Callable[[], None]) -> None:
        self._engine = weakref.ref(engine)
        self._ours = {id(p) for p in params}
        self._prepare: Callable[[], None] | None = prepare
        self._handles = [register_optimizer_step_pre_hook(self._before),
                         register_optimizer_step_post_hook(self._after)]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _over_ours(self, optimizer: torch.optim.Optimizer) -> bool:
        return any(id(p) in self._ours for g in optimizer.param_groups for p in g["params"])

    def _before(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """The contract asks the loop to call `wait_for_snapshot()` before
        `optimizer.step()`. A loop that does not (a framework's own loop, a forgotten
        line) would otherwise update the parameters and moments while they are being
        copied, and the snapshot would hold some of each step. Hooked, it cannot: the
        step waits, as it would have in `wait_for_snapshot()`."""
        engine = self._engine()
        if engine is not None and engine.capturing and self._over_ours(optimizer):
            engine.wait_for_snapshot()

    def _after(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Not sooner than the first step: an optimizer's state (AdamW's moments, twice
        the parameters) exists from it on. Not later: then the first checkpoints would
        map, fault in and pin their slots themselves (seconds each on a GPU)."""
        if (self._prepare is not None and self._engine() is not None
                and self._over_ours(optimizer)):
            prepare, self._prepare = self._prepare, None
            prepare()
