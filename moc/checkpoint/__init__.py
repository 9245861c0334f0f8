"""The checkpoint engine: the product. Depends on torch and `moc.topology` only; it
never imports the reference model, trainer, benchmarks or baselines (enforced by
tests/test_dependencies.py).

    api.py          the contract every engine keeps, and its result types
    errors.py       what callers can catch
    failures.py     a failed checkpoint: logged, until too many in a row (or the final)
    phases.py       where a checkpoint's time went (wall, CPU, page faults)
    liveness.py     whether another process is alive (pid + start time)
    modelconfig.py  the model's own configuration, recorded with a checkpoint
    codec.py        the one encoding of what processes send each other (never pickle)
    dist.py         every collective, and which thread may use them
    spec.py         which parameters are experts; stable keys
    shards.py       DTensor placements as boxes: pieces of a tensor, and their tiling
    optimizers.py   an optimizer as the engines see it: torch's, ZeRO's partition, and
                    optimizers that step others (torchtitan's container), read through
    state/          a rank's state flattened under those keys, and installed back
    parts.py        the parts every engine is built from
    lineage.py      which line of training a checkpoint is; saves that never go back
    preemption.py   SIGTERM/SIGINT: stop at an agreed step boundary, a final checkpoint
    policy/         what is saved: PEC selection; the token ledger (PLT, Dynamic-K)
    plan/           who writes what: write units, their assignment, the chain
    store/          how it lands: `Storage` (a local directory or an object store URL),
                    tensor files, step directories, manifest, retention, the lock, the
                    run's identity, the clean-up a restore leaves for the first save
    recovery.py     the one restore loop
    routing.py      `RoutingRecorder`: routed tokens counted by forward hooks
    sync.py         `Checkpointer`, the synchronous engine
    twolevel/       `TwoLevelCheckpointer`: snapshot in memory, background persist
    tools.py        inspect, verify
    export.py       a step as the model's own state dict (`moc export`)
    exportplan.py   that state dict from the manifest alone: names, keys, experts' ages

The layers (lowest first) are in tests/test_dependencies.py: no module imports a higher
one, and none is in an import cycle.
"""

from moc.checkpoint.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
)

__all__ = ["CheckpointError", "CorruptCheckpointError", "IncompatibleCheckpointError"]
