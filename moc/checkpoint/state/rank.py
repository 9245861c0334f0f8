"""What one rank checkpoints and restores, put together: `RankState` (its model, its
optimizer's state, which parameters are experts, its rank), everything it holds under
stable keys for a save (`local_state`), and a restore that reads and checks everything
before it installs anything (`load_rank_state`), so a corrupt key never leaves a
half-loaded model.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from moc.checkpoint.errors import IncompatibleCheckpointError
from moc.checkpoint.optimizers import NoOptimizer, OptimizerState
from moc.checkpoint.shards import (
    Placed,
    UnsupportedLayoutError,
    agreed_placements,
    is_dtensor,
    is_instance_of_loaded,
    local,
    refusal,
    report,
    sharding_of,
    split_key,
)
from moc.checkpoint.spec import PARAM_GROUPS_KEY, ExpertSpec, buffer_key, dense_key, expert_key
from moc.checkpoint.state.flat import (
    Named,
    Reader,
    flatten_optimizer,
    flatten_params,
    load_params,
    optimizer_state,
    persistent_buffers,
    piece_key,
    read_piece,
    whole_shapes,
)
from moc.checkpoint.state.groups import (
    few,
    groups_json,
    has_hyperparameters,
    host_copy,
    param_groups_tensor,
    plain_groups,
    read_host_copies,
    read_hyperparameters,
)
from moc.checkpoint.state.rng import install_rng, rank_generators, read_rng, take_rng

log = logging.getLogger(__name__)


def _shared(model: nn.Module, optimizer: OptimizerState, spec: ExpertSpec
            ) -> dict[str, torch.Tensor]:
    state = _buffers(model, spec)
    groups = param_groups_tensor(optimizer, spec)
    if groups is not None:
        state[PARAM_GROUPS_KEY] = groups
    return state


def _buffers(model: nn.Module, spec: ExpertSpec, clone: bool = False
             ) -> dict[str, torch.Tensor]:
    return {piece_key(buffer_key(n), n, b): local(b).detach().clone() if clone
            else local(b).detach() for n, b in persistent_buffers(model, spec).items()}


@dataclass(frozen=True)
class TakenAtSave:
    """What an asynchronous snapshot takes when the checkpoint is requested, not when it
    is copied (`RankState.capture`): the persistent buffers, cloned, and the param groups
    as JSON values, their tensor entries (a capturable optimizer's `lr`) as host copies
    queued without waiting. Nothing here waits for a device.

    On a device, `tensors()` may be called only once the work queued before the
    checkpoint's `ready` event is done (the snapshot thread waits for it): the host
    copies land then."""

    buffers: dict[str, torch.Tensor]
    groups: list[dict[str, Any]] | None

    def tensors(self) -> dict[str, torch.Tensor]:
        """The buffers, and the param groups' JSON under PARAM_GROUPS_KEY."""
        out = dict(self.buffers)
        if self.groups is not None:
            out[PARAM_GROUPS_KEY] = groups_json(read_host_copies(self.groups))
        return out


def local_state(model: nn.Module, optimizer: OptimizerState, spec: ExpertSpec, rank: int,
                rng: dict[str, torch.Tensor] | None = None,
                captured: TakenAtSave | None = None,
                named: Named | None = None) -> dict[str, torch.Tensor]:
    """Everything this rank holds under stable keys (views, no copies, but the param
    groups' JSON): its parameters and persistent buffers, the optimizer state it owns,
    the optimizer's param groups, its generators' RNG states (`rng`: `take_rng`'s, taken
    when the checkpoint was requested; now by default). `captured`: the buffers and param
    groups taken then (`RankState.capture`), in place of their values now."""
    named = named if named is not None else list(model.named_parameters())
    state = flatten_params(named, spec)
    state.update(flatten_optimizer(optimizer.local_state(), spec))
    state.update(_shared(model, optimizer, spec) if captured is None else captured.tensors())
    state.update(take_rng(rank_generators(rank, named)) if rng is None else rng)
    return state

def load_rank_state(reader: Reader, model: nn.Module, optimizer: OptimizerState,
                    spec: ExpertSpec, rank: int, named: Named | None = None,
                    generators: dict[str, torch.device] | None = None) -> None:
    """Install this rank's share of a checkpoint: its parameters and persistent buffers,
    the optimizer state of the parameters it owns, the optimizer's hyperparameters, its
    generators' RNG states (`generators`: `rank_generators`' by default). Everything is
    read (and checked) before anything is installed, so a corrupt key never leaves a
    half-loaded model.

    A checkpoint written before buffers and param groups were saved lacks their keys:
    those keep their current values, with a warning."""
    named = named if named is not None else list(model.named_parameters())
    wholes = whole_shapes(named, spec)
    params = {k: read_piece(reader, k, tuple(t.shape), wholes[k])
              for k, t in flatten_params(named, spec).items()}
    buffers = persistent_buffers(model, spec)
    missing = sorted(n for n in buffers if not reader.pieces(buffer_key(n)))
    buffer_values = {n: read_piece(reader, piece_key(buffer_key(n), n, b),
                                   tuple(local(b).shape), tuple(b.shape))
                     for n, b in buffers.items() if n not in missing}
    hyper = read_hyperparameters(reader, optimizer, spec)
    experts = spec.by_name()
    by_name = dict(named)
    owned = {n: by_name[n] for n in optimizer.owned_names()}
    names = {}
    for n in owned:
        if n in experts:
            # A rank holding none of the experts (an empty piece) still keeps their state's
            # structure (the optimizer's is the same on every rank): expert 0's names.
            prefix = expert_key("optim", experts[n].stem, (*experts[n].global_ids, 0)[0])
        else:
            prefix = dense_key("optim", n)
        names[n] = _state_kinds(reader, prefix)
    with_state = {n: p for n, p in owned.items() if names[n]}

    def get(key: str, piece: str | None, shape: tuple[int, ...], whole: tuple[int, ...]
            ) -> torch.Tensor:
        return reader.get(key) if piece is None else read_piece(reader, piece, shape, whole)

    _check_state_agrees(optimizer, owned, with_state)
    states = optimizer_state(with_state, names, spec, get)
    # A model-only restore (inference) leaves the process's RNG alone: it resumes no run.
    model_only = isinstance(optimizer, NoOptimizer)
    if generators is None:
        generators = rank_generators(rank, named)
    rng = {} if model_only else read_rng(reader, generators)

    load_params(named, spec, params.__getitem__)
    with torch.no_grad():
        for n, t in buffer_values.items():
            local(buffers[n]).copy_(t)
    optimizer.load_local_state(states)
    if hyper is not None:
        optimizer.load_hyperparameters(hyper)  # type: ignore[attr-defined]
    if missing:
        log.warning("the checkpoint has no key for the persistent buffers %s (written "
                    "before buffers were checkpointed?); they keep their current values",
                    few(missing))
    install_rng(rng)


def _check_state_agrees(optimizer: OptimizerState, owned: dict[str, torch.Tensor],
                        with_state: dict[str, torch.Tensor]) -> None:
    """Refuse a restore that would drop optimizer state without a word: the optimizer
    holds state now for parameters the checkpoint has none for, while it has state for
    others (a checkpoint with no optimizer state at all is one taken before the first
    step, and a rollback to it starts every parameter fresh, as that run did)."""
    if not with_state:
        return
    dropped = sorted(n for n, s in optimizer.local_state().items()
                     if s and n in owned and n not in with_state)
    if dropped:
        raise IncompatibleCheckpointError(
            f"the checkpoint holds no optimizer state for {len(dropped)} parameters the "
            f"optimizer holds state for ({few(dropped)}), while it holds state for "
            f"{len(with_state)} others: restoring it would drop that state silently; "
            "restore with the optimizer of the run that wrote it")


def _state_kinds(reader: Reader, prefix: str) -> list[tuple[str, bool]]:
    """(name, is a scalar) of each optimizer state tensor stored under `prefix/`: a
    scalar (AdamW's `step`) is stored whole under its own key on every layout, a tensor
    as the pieces its layout held."""
    out: dict[str, bool] = {}
    for name in reader.state_names(prefix):
        base, offsets = split_key(name)
        if offsets is not None:
            out[base] = False
            continue
        pieces = reader.pieces(f"{prefix}/{base}")
        out.setdefault(base, not pieces or pieces[0][1].shape == ())
    return sorted(out.items())

@dataclass(frozen=True)
class RankState:
    """What one rank checkpoints and restores: its model, its optimizer's state, which
    parameters are experts, and its rank (whose RNG it is)."""

    model: nn.Module
    optimizer: OptimizerState
    spec: ExpertSpec
    rank: int
    pieces: int = field(default=0, init=False)
    """A checksum of the boxes this model's DTensors are cut into (0: no DTensor sharded
    over the ranks): the same on every rank of a job, different for another layout."""
    placements: dict[str, Placed] = field(default_factory=dict)
    """Every piece of each DTensor parameter (by name) and persistent buffer (by its key,
    `buffer/<name>`) this rank holds part of, with the ranks that hold it, as every rank
    of the job reported it (`placed`); empty until then, and the units of a plan fall
    back to what this rank's mesh says."""
    generators: dict[str, torch.device] = field(default_factory=dict, init=False)
    """This rank's RNG keys, each with the device whose generator it holds
    (`rank_generators`): the CPU's and that of each accelerator its parameters live on,
    as the engine found them when it was built."""
    names: dict[tuple[str, ...], list[str]] = field(default_factory=dict, init=False,
                                                    repr=False, compare=False)
    """The param groups' stable names by their names, kept between saves
    (`plain_groups`: made once, not at every save on the training thread)."""
    named: Named = field(default=(), init=False)
    """The model's parameters by name, as it held them when the engine was built. Kept,
    not looked up at each save: FSDP2 swaps a module's sharded parameters for unsharded
    ones during forward and backward, while a two-level snapshot copies behind the
    forward; the sharded ones are the optimizer's, and the state."""

    def __post_init__(self) -> None:
        # An expert buffer, or a DTensor whose layout moc cannot save: refused at
        # construction, never from inside a save.
        for name, b in persistent_buffers(self.model, self.spec).items():
            sharding_of(name, b)
        named = tuple(self.model.named_parameters())
        _check_sharded(self.model)
        object.__setattr__(self, "named", named)
        object.__setattr__(self, "generators", rank_generators(self.rank, named))
        pieces = []
        for name, p in named:
            sharding = sharding_of(name, p)
            if sharding is not None and not sharding.whole:
                pieces.append(f"{name}:{[b for b, _ in sharding.pieces]}")
        # The layout's boxes, as a number manifests and snapshots record (0: none).
        object.__setattr__(self, "pieces",
                           zlib.crc32("|".join(pieces).encode()) if pieces else 0)

    @classmethod
    def agreed(cls, model: nn.Module, optimizer: OptimizerState, spec: ExpertSpec | None,
               rank: int, all_gather: Callable[[Any], list[Any]], *,
               refused: ValueError | None = None) -> RankState:
        """`RankState(...).placed(all_gather)` on every rank, or the same refusal raised
        on every rank (collective). A rank whose construction refuses the model (an
        UnsupportedLayoutError, a ValueError; or `refused`, its experts' refusal found
        before: `spec` is then None) still enters the one all-gather, carrying its
        refusal in place of its pieces: raising before it would leave its peers in a
        collective it never enters (gloo's "Connection closed by peer"), each with a
        different story."""
        try:
            if refused is not None:
                raise refused
            assert spec is not None
            state = cls(model, optimizer, spec, rank)
        except ValueError as e:  # UnsupportedLayoutError is one
            agreed_placements(all_gather(refusal(e)))  # raises: this rank refused
            raise AssertionError("a rank's refusal is raised by every rank") from e
        return state.placed(all_gather)

    def placed(self, all_gather: Callable[[Any], list[Any]]) -> RankState:
        """This state with `placements`: which ranks hold each piece, from every rank's
        own piece (one all-gather, collective, entered whatever the layout). A DTensor's
        mesh may be a slice of a larger one (FSDP2 over dp_shard of a dp_shard x ep
        mesh): its own mesh then names only some of the ranks that hold the same piece,
        and two ranks that each think they alone hold it would both write it. Raises the
        same UnsupportedLayoutError on every rank when the ranks' pieces do not tile a
        tensor (`shards.agreed_placements`)."""
        tensors = [*self.named, *((buffer_key(n), b) for n, b in
                                  persistent_buffers(self.model, self.spec).items())]
        return replace(self, placements=agreed_placements(all_gather(report(tensors))))

    @property
    def device(self) -> torch.device | None:
        """The CUDA device this rank's parameters live on; None when they live on the
        host (or on another accelerator, whose tensors are copied through the host)."""
        return next((p.device for _, p in self.named if p.is_cuda), None)

    def flatten(self, rng: dict[str, torch.Tensor] | None = None,
                captured: TakenAtSave | None = None) -> dict[str, torch.Tensor]:
        """`local_state`: everything this rank holds under stable keys, as views (`rng`:
        `rng()` as taken when the checkpoint was requested; now by default)."""
        return local_state(self.model, self.optimizer, self.spec, self.rank,
                           self.rng() if rng is None else rng, captured, self.named)

    def rng(self) -> dict[str, torch.Tensor]:
        """The state of every generator this rank uses, by key: the CPU's under
        `rng/rank=<r>`, each accelerator's under `rng/rank=<r>/<type>=<n>`. The one place
        a save takes the RNG: at `save()`, on the caller's thread, since the next forward
        draws from it (dropout). Host-side: no device sync (see `take_rng`)."""
        return take_rng(self.generators)

    def capture(self) -> TakenAtSave:
        """What an asynchronous snapshot takes when the checkpoint is requested, not
        when it is copied: the persistent buffers (cloned) and the param groups.

        The copy runs behind the next forward pass, which may update buffers in place
        (running statistics, step counters), and a loop may set the learning rate
        between `save()` and the next optimizer step (at the top of an iteration, as
        nanoGPT does, or with a scheduler stepped after the save). Taken later, the
        snapshot of step t would hold some of step t+1: a recovery that is not exact,
        and differently so from run to run. Both are small (tens of microseconds on
        the `bench` model); parameters and optimizer state change only in the optimizer
        step, which waits for the copy. Nothing here waits for a device: a device
        tensor is cloned, or copied to pinned host memory, by work queued on the
        current stream (`TakenAtSave`)."""
        groups = None
        if has_hyperparameters(self.optimizer):
            groups = plain_groups(self.optimizer.hyperparameters(),  # type: ignore[attr-defined]
                                   self.spec, tensor=host_copy, cache=self.names)
        return TakenAtSave(_buffers(self.model, self.spec, clone=True), groups)

    def sizing(self) -> dict[str, torch.Tensor]:
        """`flatten()`'s tensors as a slot lays them out, reading no value (no device
        sync): what the snapshot slots are prepared for. The param groups' JSON is
        sized with tensor entries as 0 (a few bytes off: slots are reserved with slack)."""
        groups = None
        if has_hyperparameters(self.optimizer):
            groups = plain_groups(self.optimizer.hyperparameters(),  # type: ignore[attr-defined]
                                   self.spec, tensor=lambda t: 0)
        return self.flatten(None, TakenAtSave(_buffers(self.model, self.spec), groups))

    def load(self, reader: Reader) -> None:
        """`load_rank_state`: read and check everything this rank holds, then install it."""
        load_rank_state(reader, self.model, self.optimizer, self.spec, self.rank, self.named,
                        self.generators)


def _check_sharded(model: nn.Module) -> None:
    """UnsupportedLayoutError for an FSDP2 module whose parameters are unsharded now
    (built between a forward and its backward, or under `unshard()`): the engine keeps
    the parameters it sees when it is built, and those would not be the optimizer's."""
    for name, module in model.named_modules():
        if is_instance_of_loaded(module, "torch.distributed.fsdp", "FSDPModule") and any(
                not is_dtensor(p) for p in module.parameters(recurse=False)):
            raise UnsupportedLayoutError(
                f"the FSDP2 module {name or type(model).__name__!r} holds unsharded "
                "parameters now; build the checkpointer when the model is sharded: after "
                "fully_shard, before the first forward or after a backward")


def shared_state(state: RankState) -> dict[str, torch.Tensor]:
    """The keys of `state.flatten()` that are neither parameters nor their optimizer
    state and are the same on every rank: persistent buffers, the param groups. (For
    placements that pick what each rank writes by kind, as the baselines do.)"""
    return _shared(state.model, state.optimizer, state.spec)
