"""`run(train)`: in-job recovery for a training loop of one's own.

    model = build_model()                      # made once: kept across generations
    optimizer = torch.optim.AdamW(model.parameters())

    def train(gen: moc.Generation) -> None:    # entered once per generation
        report = gen.engine.restore()          # memory first: the survivors' own
        for step in range((report.step if report else 0) + 1, steps + 1):
            ...                                # forward, backward
            gen.engine.wait_for_snapshot()
            optimizer.step()
            gen.engine.maybe_save(step)

    moc.run(train, engine=lambda: moc.TwoLevelCheckpointer(model, optimizer, "ckpt/"))

Under a rank host (`moc run script.py`, docs/guide/recovery.md) a rank that dies or
hangs is replaced by a new process, and the others keep theirs: their next collective
fails, `run` leaves the generation (its process groups destroyed, the engine abandoned:
its snapshots stay in memory), joins the next one with the newcomer, makes a new engine
on the new groups and enters `train` again, in the same process, with the same model
and optimizer (the gradients of the step cut short dropped). Hang detection needs
nothing in the loop: the heartbeat counts the
optimizers' steps (a global step hook), and the host kills a process whose heartbeat
stops, or whose steps stop while it is not waiting for a peer.

Without a host (plain torchrun, one process) `run` joins the job as
`moc.init_distributed` does and enters `train` once: the same script runs both ways.

What `train` must do (docs/guide/recovery.md, "Your own loop"): make everything that
holds the process group inside it (DDP and FSDP wrappers, extra groups); restore from
`gen.engine` before it trains; and let the errors of collectives propagate (a peer lost
is recognised by `membership.lost_peer`).
"""

from __future__ import annotations

import os
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

from moc.checkpoint.api import CheckpointEngine
from moc.checkpoint.twolevel.persist import prestart
from moc.injob.membership import Membership, enabled, first_line, lost_peer, prestarts
from moc.topology import init_distributed

T = TypeVar("T")
E = TypeVar("E", bound=CheckpointEngine)


@dataclass
class Generation(Generic[E]):
    """What `train` is given each time `run` enters it."""

    number: int
    """0 at the start; one more at each recovery in this job (a process replaced, or a
    machine taken over)."""
    rank: int
    world_size: int
    engine: E | None
    """The checkpoint engine made for this generation's process groups (`run`'s
    `engine`), or None."""
    replaced: list[int] = field(default_factory=list)
    """The ranks whose processes are new in this generation (empty in generation 0)."""

    def own(self, engine: E) -> None:
        """Give `run` an engine that `train` built, as a framework builds one with the
        model it builds (torchtitan's Trainer, `moc.integrations.torchtitan.run`): `run`
        then owns it as it owns the one its `engine` makes, abandoning it when a peer is
        lost (after the process groups are dropped) and closing it when `train`
        returns. Whoever built it must not close it too."""
        if self.engine is not None:
            raise ValueError(f"generation {self.number} already has its engine "
                             f"({type(self.engine).__name__}); one engine a generation")
        self.engine = engine


class _Steps:
    """The optimizers' steps in this process, counted by a global step hook: the
    heartbeat's progress and the step times that set the host's hang timeout, with no
    code in the loop. Owner: the training thread."""

    def __init__(self) -> None:
        self.membership: Membership | None = None
        self.count = 0
        self.last: float | None = None
        self.optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        """Every optimizer that stepped in this process (`drop_gradients`)."""
        self.handle = register_optimizer_step_post_hook(self._stepped)

    def _stepped(self, optimizer: torch.optim.Optimizer, args: object, kwargs: object
                 ) -> None:
        now = time.monotonic()
        self.count += 1
        self.optimizers.add(optimizer)
        m = self.membership
        if m is None:
            return
        if (self.last is not None and m.phase == "train" and m.stepped(now - self.last)
                and prestarts() and prestart.needed()):
            prestart.prestart()  # training is back: the next engine's persist process
        m.phase = "train"  # steps follow each other from here: a stall is a hang
        self.last = now
        m.check()  # NCCL: the heartbeat thread aborted this generation's communicators

    def rejoined(self) -> None:
        """A new generation: the time across a recovery is not a step."""
        self.last = None

    def drop_gradients(self) -> None:
        """The gradients of the step a lost peer cut short (a backward whose all-reduce
        failed half-way left some): the restored state's next backward must start from
        none, as it did in the run without the fault."""
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)


def run(train: Callable[[Generation[E]], T], *, engine: Callable[[], E] | None = None,
        backend: str | None = None) -> T:
    """Call `train` in each generation of the job until it returns, and return what it
    returned (module docstring). `engine`: makes the checkpoint engine of a generation,
    after its process groups formed (`Generation.engine`); `run` closes it when `train`
    returns, and abandons it when a peer is lost (a collective close could not finish).
    `backend`: of the default process group (nccl when CUDA is available, else gloo).

    Errors that are not a lost peer propagate, the engine abandoned first: its
    snapshots stay in memory for the job started again."""
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if enabled() and dist.is_initialized():
        raise RuntimeError(
            "moc.run under a rank host (moc run) forms the job's process group itself, in "
            "each generation, but one is already initialised: remove the script's "
            "init_process_group / moc.init_distributed call before moc.run (without a "
            "host, moc.run makes it too)")
    if not enabled():
        init_distributed(backend)
        gen = _generation(0, engine, [])
        return _finish(train, gen)
    steps = _Steps()
    membership = Membership(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                            lambda: steps.count)
    steps.membership = membership
    current: list[Generation[E]] = []

    def enter(number: int) -> T:
        current[:] = [_generation(number, engine, membership.replaced() if number else [])]
        return _finish(train, current[0], rejoins=True)

    def leave(error: BaseException) -> None:
        print(f"moc: rank {membership.rank}: lost a peer ({first_line(error)}); "
              "rejoining", file=sys.stderr, flush=True)
        if current and current[0].engine is not None:
            current[0].engine.abandon()  # the groups are gone: no collective
        current.clear()
        steps.drop_gradients()
        steps.rejoined()

    try:
        return generations(membership, backend, enter, leave)
    finally:
        steps.handle.remove()


def generations(membership: Membership, backend: str, enter: Callable[[int], T],
                leave: Callable[[BaseException], None],
                stopping: Callable[[], None] | None = None, joined: bool = False) -> T:
    """The generation loop of every in-job recovery, `run`'s and `moc train`'s: join the
    job's current generation (unless `joined`: the caller joined the first itself) and
    `enter(generation)` until it returns, then tell the host that training is done.
    When `enter` loses a peer (`lost_peer`: its collectives failed), this process
    leaves the generation: the process groups dropped first (`Membership.leave`; on
    NCCL its communicators aborted, which also ends a device wait an engine's threads
    may be blocked behind), then `leave(error)`, where the caller lets go of what held
    them without a collective (the engine abandoned: its snapshots stay in memory); and
    it joins the next generation and enters again, in the same process. A rejoin that
    loses a peer too leaves again. Any other error propagates. `stopping`: called while
    a join waits for ranks (`Membership.join`)."""
    lost: BaseException | None = None
    while True:
        try:
            if lost is not None:
                membership.phase = "leave"  # watched by the host: a leave that hangs is one
                membership.leave()
                leave(lost)
                lost, joined = None, False
            if not joined:
                membership.phase = "start" if membership.gen == 0 else "rejoin"
                membership.join(backend, stopping)
                joined = True
            membership.phase = "restore"
            result = enter(membership.gen)
            membership.done()
            return result
        except Exception as e:
            if not lost_peer(e):
                raise
            lost = e


def _generation(number: int, engine: Callable[[], E] | None, replaced: list[int]
                ) -> Generation[E]:
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    return Generation(number, rank, world, engine() if engine is not None else None,
                      replaced)


def _finish(train: Callable[[Generation[E]], T], gen: Generation[E], rejoins: bool = False
            ) -> T:
    """`train(gen)`, then the engine closed (collective: every rank returned) and the
    process group with it. On an error the engine is abandoned (no collective), but for
    a lost peer in a process that `rejoins`: `generations` drops the groups first, and
    its `leave` abandons the engine then (on NCCL, an abandon could wait behind a kernel
    that only the communicators' abort ends)."""
    try:
        result = train(gen)
        if gen.engine is not None:
            gen.engine.close()  # a peer lost here too: nothing half-done stays
    except BaseException as e:
        if gen.engine is not None and not (rejoins and isinstance(e, Exception)
                                           and lost_peer(e)):
            gen.engine.abandon()
        raise
    if dist.is_initialized():
        dist.destroy_process_group()
    return result
