"""In-job recovery: a lost or hung rank replaced in place while the others keep their
processes (docs/guide/recovery.md).

    membership   a training process's side: the job's generations in its store, the
                 process groups formed for each, the heartbeat its rank host watches
    machines     lost machines: each rank host's lease, and the spare node that claims
                 a machine whose leases stopped
    loop         `run(train)`: any training function entered again, in the same
                 process, in each generation of the job; `generations`, the loop
                 that both `run` and `moc train` drive

The rank hosts that start and replace the training processes are the trainer's
(`moc.train.host`), and so is the launcher (`moc train`, `moc run`).
"""
