"""Two-level checkpointing: a snapshot in node-local memory, persisted in the background.

    slots           the snapshot slots in shared memory (one owner: the rank)
    worker          the snapshot thread: plan, then copy
    planner         what one checkpoint's snapshot copies and persists
    protocol        the typed messages between the ranks and the persist process
    persist         the persist process (server) and a rank's end of it (client)
    sizing          K_snapshot: how many experts a snapshot holds, and which
    memory_restore  recovery from memory, each rank from its own when it can
    checkpointer    `TwoLevelCheckpointer`, which wires them
"""
