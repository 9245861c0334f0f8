"""How checkpoints sit on storage.

    storage    `Storage`: the checkpoint directory behind one interface (local, object store)
    backend    where it lives: a local path, or an `ObjectPath` in an object store (fsspec)
    format     tensor files (safetensors, checksummed), written and read
    disk       a file's bytes onto a local disk: few `writev` calls, or O_DIRECT
    steps      step directories and their atomic commit; set aside, abandoned, replaced
    manifest   the manifest that names every key of a step (and chains to older steps)
    retention  which steps to keep, and their deletion in the background
    lock       one training job per directory
    identity   the run a directory belongs to
    tidy       the clean-up a restore leaves for the first save
"""
