"""moc inside training frameworks: their loops, their resume, moc's checkpoints.

| module | what it holds |
| --- | --- |
| `hf_trainer` | `MocTrainer`, `MocTrainerMixin`: `transformers.Trainer`, resumed exactly |
| `accelerate` | `AcceleratorCheckpointer`: a loop under `accelerate.Accelerator` |
| `loopstate` | a loop's state beside moc's: RNGs, scheduler, scaler, data layout |

Neither framework is imported until its module is used.
"""
