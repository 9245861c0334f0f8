"""The presets: the GPU models' sizes, counted on the meta device (no memory)."""

from __future__ import annotations

import pytest
import torch

from moc.model import Transformer
from moc.train.config import PRESETS, TrainConfig


def _params(preset: str) -> tuple[int, int]:
    """(all parameters, expert parameters) of the preset's model, built on the meta
    device: shapes only, nothing allocated (gpu-800m would take 9 GB with its moments)."""
    with torch.device("meta"):
        model = Transformer(PRESETS[preset]["model"])
    every = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return every, experts


@pytest.mark.parametrize(("preset", "layers", "total"), [("gpu-400m", 4, 386_999_296),
                                                         ("gpu-800m", 8, 772_948_992)])
def test_the_gpu_presets_are_the_models_measured_on_the_h200(preset, layers, total):
    cfg = TrainConfig.from_preset(preset)
    m = cfg.model
    assert (m.d_model, m.d_ffn, m.n_layers, m.n_heads, m.n_experts, m.seq_len) == (
        1024, 2816, layers, 16, 16, 512)
    assert cfg.batch_size == 32
    every, experts = _params(preset)
    assert every == total
    # Analytically: per MoE layer 16 experts x (2 x 1024 x 2816); the dense rest is
    # attention (4 x 1024^2), two norms, the router (16 x 1024) per layer, the token
    # (256 x 1024) and position (512 x 1024) tables, the final norm and the output head
    # (256 x 1024, not tied).
    assert experts == layers * 16 * 2 * 1024 * 2816
    dense = (layers * (4 * 1024 * 1024 + 2 * 1024 + 16 * 1024)
             + (256 + 512 + 1 + 256) * 1024)
    assert every == experts + dense
    assert experts / every > 0.95  # expert state dominates, as in `bench`


def test_every_preset_builds_a_valid_config():
    for preset in PRESETS:
        assert TrainConfig.from_preset(preset).preset == preset
