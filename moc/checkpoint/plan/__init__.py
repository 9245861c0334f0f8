"""Who writes what, decided by pure functions: the write units of a model (units), their
assignment to ranks (writes), and the chain of partial checkpoints (chain)."""
