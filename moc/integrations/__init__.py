"""moc inside training frameworks: their loops, their resume, moc's checkpoints.

| module | what it holds |
| --- | --- |
| `hf_trainer` | `MocTrainer`, `MocTrainerMixin`: `transformers.Trainer`, resumed exactly |
| `accelerate` | `AcceleratorCheckpointer`: a loop under `accelerate.Accelerator` |
| `torchtitan` | `MocCheckpointManager` (torchtitan's Trainer), `TitanCheckpointer` |
| `loopstate` | a loop's state beside moc's: RNGs, scheduler, scaler, data layout |

No framework is imported until its module is used.
"""
