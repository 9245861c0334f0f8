"""The reference MoE transformer. No distributed or checkpoint code lives here."""

from moc.model.exported import load_exported
from moc.model.transformer import (
    MODEL_TYPE,
    Experts,
    FeedForward,
    ModelConfig,
    ModelOutput,
    MoE,
    Router,
    Transformer,
)

__all__ = [
    "MODEL_TYPE",
    "Experts",
    "FeedForward",
    "MoE",
    "ModelConfig",
    "ModelOutput",
    "Router",
    "Transformer",
    "load_exported",
]
