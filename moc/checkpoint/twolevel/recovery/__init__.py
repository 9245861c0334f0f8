"""Recovery from memory: which copy of which step each rank takes, and taking it.

    copies       which copy of which step each rank restores: the exact copy wins
    memory       recovery from memory: own node's, a peer's replica, or none
    alignment    after it: expert replicas made equal, the copies each came from
    reader       the engine's model-only form (`optimizer=None`): a reader of storage

Imports `memory`, `snapshot` and `replicas`.
"""
