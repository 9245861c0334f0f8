"""Baselines that moc is measured against, behind the same checkpoint contract
(`moc.checkpoint.api.CheckpointEngine`): the Megatron-DeepSpeed blocking save
(`blocking`) and PyTorch DCP's `save` / `async_save` (`dcp`).

Not part of the product: `moc.checkpoint` never imports them; the reference trainer and
the benchmarks do.
"""
