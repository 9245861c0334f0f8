"""A snapshot holds one step's state, whatever the loop does while it is being copied.

The copy runs behind the next forward pass. What may change meanwhile is waited for (an
optimizer step, even without `wait_for_snapshot()`), taken when the checkpoint was
requested (buffers a forward pass updates, the learning rate a loop sets), or, when it
changes in place during the copy anyway, refused: the snapshot is discarded, the error
says what changed, and the run goes on from the previous one. Each interleaving is
forced at the worst moment by pausing the real plan or the real copy."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.optim.optimizer as optimizer_hooks

from moc.checkpoint.errors import CheckpointError
from moc.checkpoint.policy.selection import PECPolicy
from moc.checkpoint.twolevel.checkpointer import TwoLevelCheckpointer
from moc.checkpoint.twolevel.memory import native
from moc.model import ModelConfig, Transformer
from tests.checkpoint.twolevel.test_checkpointer import _train

pytestmark = pytest.mark.integration  # real persist processes

CFG = ModelConfig(seq_len=8, d_model=16, n_layers=2, n_heads=2, d_ffn=32, n_experts=4)


def _count_forward(module, args) -> None:
    module.forwards.add_(1)


def _build(seed: int, device: str = "cpu"):
    torch.manual_seed(seed)
    model = Transformer(CFG).to(device)
    # A persistent buffer that every forward pass updates in place, as running
    # statistics or a step counter would.
    model.register_buffer("forwards", torch.zeros((), dtype=torch.int64, device=device))
    model.register_forward_pre_hook(_count_forward)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _state(model, opt):
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    moments = {n: {k: v.clone() for k, v in opt.state[p].items()}
               for n, p in model.named_parameters()}
    return params, moments, int(model.forwards), opt.param_groups[0]["lr"]


def _restored(seed: int, root):
    model, opt = _build(seed)
    ckpt = TwoLevelCheckpointer(model, opt, root, policy=PECPolicy(k=1), interval=1)
    report = ckpt.restore()
    ckpt.close()
    return report, _state(model, opt)


def _assert_same(a, b):
    (pa, ma, fa, la), (pb, mb, fb, lb) = a, b
    assert pa.keys() == pb.keys() and all(torch.equal(pa[n], pb[n]) for n in pa)
    assert all(torch.equal(ma[n][k], mb[n][k]) for n in ma for k in ma[n])
    assert (fa, la) == (fb, lb)


def _step(model, opt, seed: int, device: str = "cpu"):
    idx = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(seed))
    idx = idx.to(device)
    model(idx, idx).loss.backward()


def test_an_optimizer_step_without_wait_for_snapshot_waits_for_the_copy(tmp_path):
    root = tmp_path / "ckpt"
    model, opt = _build(0)
    ckpt = TwoLevelCheckpointer(model, opt, root, policy=PECPolicy(k=1), interval=1)
    hooks = len(optimizer_hooks._global_optimizer_pre_hooks)
    _train(model, opt, ckpt, 2)  # step 2's snapshot is in flight
    at_save = _state(model, opt)
    _step(model, opt, 3)
    unrelated = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    unrelated.step()  # another model's optimizer does not wait for this engine
    assert ckpt.capturing
    opt.step()  # no wait_for_snapshot(): the step must wait by itself
    assert not ckpt.capturing  # it did: the snapshot was waited for before the update
    ckpt.flush()
    assert [r.step for r in ckpt.drain_completed() if r.error is None] == [1, 2]
    ckpt.close(keep_snapshots=True)
    assert len(optimizer_hooks._global_optimizer_pre_hooks) == hooks - 1  # removed
    report, restored = _restored(1, root)
    assert (report.step, report.source) == (2, "memory")
    _assert_same(restored, at_save)


def test_buffers_and_the_learning_rate_are_taken_when_the_checkpoint_is_requested(
        tmp_path, monkeypatch):
    """The loop sets the next learning rate and runs the next forward (which updates a
    buffer in place) before the plan has even started: the snapshot is still step 2's."""
    root = tmp_path / "ckpt"
    model, opt = _build(0)
    ckpt = TwoLevelCheckpointer(model, opt, root, policy=PECPolicy(k=1), interval=1)
    _train(model, opt, ckpt, 1)
    ckpt.wait_for_snapshot()
    go = threading.Event()
    real_plan = ckpt.planner.plan

    def held_plan(*args, **kwargs):
        assert go.wait(30)
        return real_plan(*args, **kwargs)

    monkeypatch.setattr(ckpt.planner, "plan", held_plan)
    _train(model, opt, ckpt, 1, start=2)  # step 2: saved, its plan held
    at_save = _state(model, opt)
    for g in opt.param_groups:
        g["lr"] = 123.0
    _step(model, opt, 3)  # forwards += 1, in place
    go.set()
    ckpt.wait_for_snapshot()  # no error: nothing it copies changed during the copy
    ckpt.flush()
    ckpt.close(keep_snapshots=True)
    report, restored = _restored(1, root)
    assert (report.step, report.source) == (2, "memory")
    _assert_same(restored, at_save)


def test_a_change_in_place_during_the_copy_discards_the_snapshot(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    model, opt = _build(0)
    ckpt = TwoLevelCheckpointer(model, opt, root, policy=PECPolicy(k=1), interval=1)
    records = _train(model, opt, ckpt, 2)
    ckpt.wait_for_snapshot()
    at_2 = _state(model, opt)
    copied, go = threading.Event(), threading.Event()
    real_copy = native.copy_and_digest

    def held_copy(*args, **kwargs):
        out = real_copy(*args, **kwargs)
        copied.set()
        assert go.wait(30)
        return out

    monkeypatch.setattr(native, "copy_and_digest", held_copy)
    records += _train(model, opt, ckpt, 1, start=3)  # step 3: saved, its copy held once done
    assert copied.wait(30)
    with torch.no_grad():  # what a loop that bypasses the optimizer might do
        model.lm_head.weight.mul_(0.5)
    go.set()
    with pytest.raises(CheckpointError, match=r"snapshot of step 3 failed: the state changed "
                       r"while the snapshot of step 3 was being copied \('param/lm_head"):
        ckpt.wait_for_snapshot()
    monkeypatch.setattr(native, "copy_and_digest", real_copy)
    ckpt.flush()
    records += ckpt.drain_completed()
    assert sorted(r.step for r in records if r.error is None) == [1, 2]
    ckpt.close(keep_snapshots=True)
    # Step 3's snapshot was never published: memory recovers step 2, exactly.
    report, restored = _restored(1, root)
    assert (report.step, report.source) == (2, "memory")
    _assert_same(restored, at_2)
