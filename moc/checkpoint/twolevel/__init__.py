"""Two-level checkpointing: a snapshot in node-local memory, persisted in the background,
on one node or many (each snapshot also replicated to a peer node's memory).

    checkpointer     `TwoLevelCheckpointer`: composes the parts below, and nothing else
    reader           its model-only form (`optimizer=None`): a reader of storage
    results          the caller's records of the checkpoints in flight, until final
    engine_state     `EngineState`: the one owner of chain, ledger, slot roles, failures
    planner          the plans' exchange (every failure agreed there) and their application
    snapshot_plan    what one checkpoint copies and persists: a pure function
    snapshotter      `Snapshotter`: slots + snapshot thread + replicas; `stage` -> a handle
    executor         `PersistExecutor`: persist requests; `execute` -> a future outcome
    slots            the snapshot slots in shared memory: files, mappings, pinning, headers
    places           where each tensor lies in a slot (pure): layouts and views
    state_cache      the flattened state kept between snapshots, checked at each plan
    snapshot_tensors what one snapshot copies, in the form the capture takes it
    capture          filling a slot: captured (the copies training waits for), then sealed
    native           copies and checksums of many buffers in one native call (C, or Python)
    worker           the snapshot thread: plan, capture, seal
    hooks            the optimizer step hooks: wait for a capture, prepare the slots
    jobdir           a job's directory in shared memory: owner, trust rules, stale ones
    sizing           K_snapshot: how many experts a snapshot holds, which, and `auto`
    protocol         the typed messages between the ranks and the persist process
    persist          the persist process (server) and a rank's end of it (client)
    watch            a leader's watch over its persist process: stopped or hung, killed
    lag              how far storage is behind memory, reported with every checkpoint
    prestart         persist processes started ahead of need (stdlib only)
    forking          children forked from a process that imported what they run
    commit           the commit across nodes: begin, parts, records on storage
    nodes            which ranks share a node; each node's leader; its memory's root
    replica          a snapshot sent to, and kept in, another node's memory
    replication      this rank's replica rounds, on the snapshot thread
    copies           which copy of which step each rank restores: the exact copy wins
    memory_restore   recovery from memory: own node's, a peer's replica, or none
    alignment        after it: expert replicas made equal, the copies each came from
    restore          the engine's restore: memory where every rank can, else storage
"""
