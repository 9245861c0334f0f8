"""Peer replicas: each snapshot also kept in another node's memory.

    replica      a snapshot kept in another node's memory, and the channel it came by
    wire         how it travels: the frame, the stream, the checks; and back on recovery
    replication  this rank's replica rounds, on the snapshot thread

Imports `memory` and `snapshot`.
"""
