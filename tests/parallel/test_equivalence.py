"""Expert + data parallelism computes what one process with every expert computes."""

from __future__ import annotations

import pytest
import torch

from moc.model import ModelConfig, Transformer
from moc.parallel import (
    ParallelGroups,
    ShardedAdamW,
    clip_grad_norm_,
    expert_parameter_names,
    shard_experts,
    sync_gradients,
)
from tests.distributed import run_ranks

pytestmark = pytest.mark.integration  # real processes: see README, Tests

CFG = ModelConfig(seq_len=16, d_model=32, n_layers=2, n_heads=4, d_ffn=64, n_experts=4,
                  top_k=2, moe_every=1)
PER_RANK = 3
LR = 1e-2
EPS = 1e-4
"""Adam's eps, large enough that an update is not ~lr * sign(g) for near-zero
gradients, where float32 noise in g would flip whole steps."""


def _batch(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(123)
    tokens = torch.randint(0, 256, (world * PER_RANK, CFG.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _parallel_step(rank: int, world: int, ep: int) -> dict:
    groups = ParallelGroups.from_world(ep, CFG.n_experts)
    torch.manual_seed(0)
    model = Transformer(CFG)
    shard_experts(model, groups)
    opt = ShardedAdamW(model, groups, lr=LR, eps=EPS)
    x, y = _batch(world)
    rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    out = model(x[rows], y[rows])
    out.loss.backward()
    sync_gradients(model, groups)
    loss = out.loss.detach().clone()
    torch.distributed.all_reduce(loss)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    clip_grad_norm_(model, groups, max_norm=0.5)
    opt.step()
    offset = model.layers[0].ffn.experts.expert_offset
    return {"loss": loss.item() / world, "grads": grads, "offset": offset,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _reference(world: int) -> dict:
    """One process, all experts local, the same global batch as `world` equal shards."""
    torch.manual_seed(0)
    model = Transformer(CFG)
    opt = torch.optim.AdamW([
        {"params": [p for p in model.parameters() if p.dim() >= 2]},
        {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ], lr=LR, betas=(0.9, 0.95), eps=EPS, weight_decay=0.1)
    x, y = _batch(world)
    total = 0.0
    for r in range(world):
        rows = slice(r * PER_RANK, (r + 1) * PER_RANK)
        loss = model(x[rows], y[rows]).loss / world
        loss.backward()
        total += loss.item()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()
    return {"loss": total, "grads": grads,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


@pytest.mark.parametrize(("world", "ep"), [(2, 2), (4, 2)])
def test_expert_and_data_parallel_step_equals_single_process(world, ep):
    results = run_ranks(_parallel_step, world, ep)
    ref = _reference(world)
    model = Transformer(CFG)
    expert_names = set(expert_parameter_names(model))
    L = CFG.n_experts // ep
    for res in results:
        assert res["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        for kind in ("grads", "params"):
            for name, t in res[kind].items():
                want = ref[kind][name]
                if name in expert_names:
                    want = want[res["offset"]:res["offset"] + L]
                torch.testing.assert_close(t, want, rtol=1e-5, atol=1e-7,
                                           msg=lambda m, n=name, k=kind: f"{k} {n}: {m}")
