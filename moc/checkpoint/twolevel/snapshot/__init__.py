"""A snapshot: what one checkpoint copies into the slots, and the thread that copies it.

    tensors      what one snapshot copies, in the form the capture takes it
    state_cache  the flattened state kept between snapshots, checked at each plan
    capture      filling a slot: captured (the copies training waits for), then sealed
    worker       the snapshot thread: plan, capture, seal
    sizing       K_snapshot: how many experts a snapshot holds, which, and `auto`
    hooks        the optimizer step hooks: wait for a capture, prepare the slots

Imports `memory` only.
"""
