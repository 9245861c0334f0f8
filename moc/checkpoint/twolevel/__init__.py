"""Two-level checkpointing: a snapshot in node-local memory, persisted in the background,
on one node or many (each snapshot also replicated to a peer node's memory).

The engine at the root composes five folders, one per role, each importing only the
folders above it in this list (`tests/test_dependencies.py`, `FOLDERS`):

    memory/          the job's host memory on a node: job directory, slots, layout, copies
    snapshot/        what one checkpoint copies into the slots, and the thread that does
    persist/         the persist process beside training, its protocol, watch and commit
    replicas/        each snapshot kept in a peer node's memory too
    recovery/        which copy of which step each rank restores, and restoring it

The engine (the root's modules may import every folder; no folder imports them):

    checkpointer     `TwoLevelCheckpointer`: composes the parts below, and nothing else
    results          the caller's records of the checkpoints in flight, until final
    engine_state     `EngineState`: the one owner of chain, ledger, slot roles, failures
    planner          the plans' exchange (every failure agreed there) and their application
    snapshot_plan    what one checkpoint copies and persists: a pure function
    snapshotter      `Snapshotter`: slots + snapshot thread + replicas; `stage` -> a handle
    restore          the engine's restore: memory where every rank can, else storage
"""
