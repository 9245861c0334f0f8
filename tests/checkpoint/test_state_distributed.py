"""Buffers and param groups of ShardedAdamW across real ranks, and on another world size."""

from __future__ import annotations

import pytest
import torch

from moc.checkpoint.policy.selection import PECPolicy
from moc.checkpoint.sync import Checkpointer
from moc.model.transformer import Router
from moc.parallel import clip_grad_norm_, sync_gradients
from tests.distributed import build_sharded, run_ranks
from tests.engines import save_now

pytestmark = pytest.mark.integration  # real processes: see README, Tests


def _build(ep: int):
    groups, model, opt = build_sharded(ep)
    router = next(m for m in model.modules() if isinstance(m, Router))
    router.register_buffer("bias_E", torch.zeros(4))
    router.register_buffer("scratch_E", torch.zeros(4), persistent=False)
    return groups, model, opt, router


def _hyper(opt) -> list[tuple[float, float]]:
    """(lr, weight_decay) of every group, in the wrappers and in this rank's partition."""
    return [(g["lr"], g["weight_decay"]) for opt_ in (*opt.optimizers, *opt._local())
            for g in opt_.param_groups]


def _save(rank: int, world: int, ep: int, root: str):
    groups, model, opt, router = _build(ep)
    opt.set_lr(3e-3)
    opt.optimizers[-1].param_groups[0]["weight_decay"] = 0.05  # the experts' matrices
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + rank)
        idx = torch.randint(0, 256, (2, 8), generator=g)
        out = model(idx, idx)
        out.loss.backward()
        sync_gradients(model, groups)
        clip_grad_norm_(model, groups, 1.0)
        opt.step()
        model.zero_grad()
        router.bias_E.add_(float(step + 1))  # the same on every rank, as a synced bias
        router.scratch_E.add_(1.0)
    ckpt = Checkpointer(model, opt, root, groups=groups, policy=PECPolicy.full())
    assert save_now(ckpt, 3).ok
    return router.bias_E.clone(), _hyper(opt)


def _restore(rank: int, world: int, ep: int, root: str):
    groups, model, opt, router = _build(ep)
    router.scratch_E.fill_(-1.0)
    report = Checkpointer(model, opt, root, groups=groups, policy=PECPolicy.full()).restore()
    assert report.step == 3
    return router.bias_E.clone(), router.scratch_E.clone(), _hyper(opt)


@pytest.mark.parametrize("restored", [(2, 2), (1, 1)])
def test_sharded_adamw_restores_buffers_and_param_groups_on_every_rank(tmp_path, restored):
    saved = run_ranks(_save, 2, 2, str(tmp_path))
    bias, hyper = saved[0]
    assert all(torch.equal(b, bias) and h == hyper for b, h in saved)
    assert hyper[:3] == [(3e-3, 0.1), (3e-3, 0.0), (3e-3, 0.05)]  # dense 2, experts 1
    world, ep = restored
    if world == 1:
        results = [_restore(0, 1, 1, str(tmp_path))]
    else:
        results = run_ranks(_restore, world, ep, str(tmp_path))
    for got_bias, got_scratch, got_hyper in results:
        assert torch.equal(got_bias, bias)
        assert torch.equal(got_scratch, torch.full((4,), -1.0))  # not state: untouched
        assert got_hyper[:3] == hyper[:3]
        assert all(h == got_hyper[i % 3] for i, h in enumerate(got_hyper))  # partitions too
