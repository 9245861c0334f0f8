"""A rank's training state under stable keys: flattening it for a save, installing it on
restore, whatever model and optimizer hold it.

The checkpoint engines see a model only through an `ExpertSpec` and an optimizer only
through `OptimizerState`: which parameters' state this rank holds, that state keyed by
parameter name, and a way to put it back. moc's `ShardedAdamW` provides them directly;
torch's optimizers, ZeRO's partition and optimizers that step others (torchtitan's
`OptimizersContainer`) are adapted in `moc.checkpoint.optimizers`.

    local_state(...)      this rank's parameters, persistent buffers, owned optimizer
                          state, the optimizer's param groups and RNG (views but the
                          param groups)
    load_rank_state(...)  read (and check) everything first, then install it

Buffers and hyperparameters. A persistent buffer (`register_buffer(..., persistent=True)`,
such as the router bias of aux-loss-free balancing) is training state: it is stored under
`buffer/<name>`, like a non-expert parameter (identical on every rank, one rank writes
it). Non-persistent buffers stay out, as they do of `state_dict()`. The optimizer's
param groups (lr, betas, weight_decay, `initial_lr` of an LR scheduler, ...) are stored
as JSON under `optim/param_groups`, each group with the (layout-independent) names of
its parameters, so a restore matches groups by their parameters. Checkpoints written
before either existed restore as before: what they lack keeps its current value, with a
warning.

The package, lowest module first (each imports only those above it):

    flat     parameters, buffers and optimizer state under stable keys, and read back
    groups   the optimizer's param groups as JSON: encoded, decoded, matched by parameters
    rng      the rank's generators: which it holds, their states taken, read and installed
    rank     `RankState`: what one rank saves (`local_state`) and restores
             (`load_rank_state`)
"""

from __future__ import annotations

from moc.checkpoint.shards import Placed
from moc.checkpoint.state.flat import (
    Getter,
    Named,
    Reader,
    StateGetter,
    default_model_meta,
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
    PARAM_GROUPS_VERSION,
    decode_param_groups,
    encode_param_groups,
    match_param_groups,
    param_groups_tensor,
    stable_names,
)
from moc.checkpoint.state.rank import (
    RankState,
    TakenAtSave,
    load_rank_state,
    local_state,
    shared_state,
)
from moc.checkpoint.state.rng import install_rng, rank_generators, read_rng, take_rng

__all__ = [
    "PARAM_GROUPS_VERSION",
    "Getter",
    "Named",
    "Placed",
    "RankState",
    "Reader",
    "StateGetter",
    "TakenAtSave",
    "decode_param_groups",
    "default_model_meta",
    "encode_param_groups",
    "flatten_optimizer",
    "flatten_params",
    "install_rng",
    "load_params",
    "load_rank_state",
    "local_state",
    "match_param_groups",
    "optimizer_state",
    "param_groups_tensor",
    "persistent_buffers",
    "piece_key",
    "rank_generators",
    "read_piece",
    "read_rng",
    "shared_state",
    "stable_names",
    "take_rng",
    "whole_shapes",
]
