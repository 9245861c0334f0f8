"""Who writes the keys that are neither parameters nor their optimizer state."""

from __future__ import annotations

import torch

from moc.checkpoint.optimizers import TorchOptimizerState
from moc.checkpoint.plan.units import rank_share
from moc.checkpoint.spec import PARAM_GROUPS_KEY, ExpertSpec
from moc.checkpoint.state import RankState
from moc.model import ModelConfig, Transformer
from moc.model.transformer import Router
from moc.topology import ParallelLayout

CFG = ModelConfig(seq_len=8, d_model=16, n_layers=2, n_heads=2, d_ffn=32, n_experts=4)


def test_buffers_and_param_groups_are_written_by_exactly_one_rank_every_checkpoint():
    torch.manual_seed(0)
    model = Transformer(CFG)
    router = next(m for m in model.modules() if isinstance(m, Router))
    router.register_buffer("bias_E", torch.zeros(CFG.n_experts))
    opt = torch.optim.AdamW(model.parameters())
    spec = ExpertSpec.infer(model)
    layout = ParallelLayout(3, 1, CFG.n_experts)
    writers: dict[str, list[int]] = {}
    for rank in range(layout.world_size):
        state = RankState(model, TorchOptimizerState(opt, model), spec, rank)
        flat = state.flatten()
        assert PARAM_GROUPS_KEY in flat and "buffer/layers.0.ffn.router.bias_E" in flat
        for key in rank_share(state, layout, flat, lambda key: True):
            writers.setdefault(key, []).append(rank)
    assert len(writers[PARAM_GROUPS_KEY]) == 1
    assert len(writers["buffer/layers.0.ffn.router.bias_E"]) == 1
    assert all(len(ranks) == 1 for k, ranks in writers.items() if not k.startswith("rng/"))
