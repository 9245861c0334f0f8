"""A checkpoint written with W ranks and expert-parallel size ep restores on W', ep'."""

from __future__ import annotations

import pytest
import torch

from moc.checkpoint.errors import IncompatibleCheckpointError
from moc.checkpoint.policy.selection import PECPolicy
from moc.checkpoint.spec import ExpertSpec
from moc.checkpoint.state import flatten_optimizer, flatten_params
from moc.checkpoint.sync import Checkpointer
from moc.model import ModelConfig
from moc.parallel import clip_grad_norm_, sync_gradients
from tests.distributed import build_sharded, run_ranks
from tests.engines import save_now

pytestmark = pytest.mark.integration  # real processes: see README, Tests


def _global_state(model, opt) -> dict[str, torch.Tensor]:
    spec = ExpertSpec.infer(model)
    state = {k: v.clone() for k, v in flatten_params(list(model.named_parameters()), spec).items()}
    state.update({k: v.clone() for k, v in flatten_optimizer(opt.local_state(), spec).items()})
    return state


def _save(rank: int, world: int, ep: int, root: str) -> dict[str, torch.Tensor]:
    groups, model, opt = build_sharded(ep)
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + rank)
        idx = torch.randint(0, 256, (2, 8), generator=g)
        model(idx, idx).loss.backward()
        sync_gradients(model, groups)
        clip_grad_norm_(model, groups, 1.0)
        opt.step()
        model.zero_grad()
    ckpt = Checkpointer(model, opt, root, groups=groups, policy=PECPolicy.full())
    assert save_now(ckpt, 3).ok
    return _global_state(model, opt)


def _restore(rank: int, world: int, ep: int, root: str) -> dict[str, torch.Tensor]:
    groups, model, opt = build_sharded(ep)
    report = Checkpointer(model, opt, root, groups=groups, policy=PECPolicy.full()).restore()
    assert report.step == 3
    return _global_state(model, opt)


def _merge(per_rank: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for state in per_rank:
        for k, v in state.items():
            if k in merged:  # replicas of one tensor agree bitwise
                assert torch.equal(merged[k], v), k
            merged[k] = v
    return merged


@pytest.mark.parametrize(("saved", "restored"), [((4, 4), (2, 2)), ((4, 2), (4, 4)),
                                                  ((2, 2), (1, 1))])
def test_restore_on_another_world_size_and_ep_gives_back_the_saved_state(
        tmp_path, saved, restored):
    before = _merge(run_ranks(_save, saved[0], saved[1], str(tmp_path)))
    after = _merge(run_ranks(_restore, restored[0], restored[1], str(tmp_path)))
    assert any(k.startswith("optim/") and "/expert=" in k for k in before)
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k


def _restore_other_model(rank: int, world: int, root: str) -> str:
    other = ModelConfig(seq_len=8, d_model=24, n_layers=2, n_heads=2, d_ffn=32, n_experts=4)
    groups, model, opt = build_sharded(1, other)
    try:
        Checkpointer(model, opt, root, groups=groups).restore()
    except IncompatibleCheckpointError as e:
        return str(e)
    return "restored"


def test_restoring_into_a_different_model_fails_on_every_rank_saying_what_differs(tmp_path):
    run_ranks(_save, 2, 2, str(tmp_path))
    messages = run_ranks(_restore_other_model, 2, str(tmp_path))
    assert all("n_experts" not in m and "checkpoint" in m for m in messages)
    assert all("d_model" in m or "dense" in m for m in messages), messages
