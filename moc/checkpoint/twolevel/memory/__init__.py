"""The job's host memory on one node: where snapshots live between a save and the next.

    jobdir      a job's directory in shared memory: owner, trust rules, stale ones
    nodes       which ranks share a node; each node's leader; its memory's root
    slots       the snapshot slots: files, mappings, pinning, headers
    places      where each tensor lies in a slot (pure): layouts and views
    native      copies and checksums of many buffers in one native call (C, or Python)

The lowest of the engine's folders: it imports none of them (`tests/test_dependencies.py`).
"""
