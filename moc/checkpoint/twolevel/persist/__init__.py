"""Persistence: a snapshot written to storage by a process beside training.

    protocol     the typed messages between the ranks and the persist process
    server       the persist process: waits for every rank's snapshot, writes, commits
    client       a rank's end of it: starts, watches, restarts; sends and receives
    channel      where a rank finds it: the job's socket and secret
    address      the socket and its listener, bound before torch's import (stdlib only)
    executor     `PersistExecutor`: persist requests; `execute` -> a future outcome
    watch        a leader's watch over its persist process: stopped or hung, killed
    lag          how far storage is behind memory, reported with every checkpoint
    commit       the commit across nodes: begin, parts, records on storage
    prestart     persist processes started: ahead of need, or listening first (stdlib)
    forking      children forked from a process that imported what they run

Imports `memory` and `snapshot`.
"""
