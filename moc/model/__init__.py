"""The reference MoE transformer. No distributed or checkpoint code lives here."""

from moc.model.transformer import (
    Experts,
    FeedForward,
    ModelConfig,
    ModelOutput,
    MoE,
    Router,
    Transformer,
)

__all__ = [
    "Experts",
    "FeedForward",
    "MoE",
    "ModelConfig",
    "ModelOutput",
    "Router",
    "Transformer",
]
