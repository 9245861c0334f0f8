"""The two-level engine on a CUDA device: nothing on the training thread waits for the
device, the slots are pinned before the first checkpoint and again after a restore from
memory, and a snapshot restores bit for bit. Skipped without a GPU; scripts/gpu_check.sh
runs them where one is lent.

The model here is an MoE written to never synchronise (dense dispatch: every expert runs
on every token, weighted by a top-k gate), so that a whole training step, the engine's
calls and the routing hooks in the forward included, runs under
`torch.cuda.set_sync_debug_mode("error")`, which raises at a copy to the host or an
`.item()`, and under `waits_recorded`, which records what sync-debug mode does not see:
a stream's, an event's or the device's `synchronize()` called on the training thread.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from moc.checkpoint.policy.selection import PECPolicy
from moc.checkpoint.spec import ExpertSpec
from moc.checkpoint.twolevel.checkpointer import TwoLevelCheckpointer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA device")]

D, F, E, K, LAYERS, VOCAB, N = 64, 128, 8, 2, 2, 256, 512


class DenseExperts(nn.Module):
    """E experts as batched [E, ...] weights."""

    def __init__(self) -> None:
        super().__init__()
        self.w1_EDF = nn.Parameter(torch.randn(E, D, F) / D**0.5)
        self.w2_EFD = nn.Parameter(torch.randn(E, F, D) / F**0.5)

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:  # every expert, every token
        h_ENF = torch.einsum("nd,edf->enf", x_ND, self.w1_EDF).relu()
        return torch.einsum("enf,efd->end", h_ENF, self.w2_EFD)


class SyncFreeMoE(nn.Module):
    """Top-k gating without a host sync: the gate is a scatter of the top-k weights."""

    top_k = K

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.experts = DenseExperts()

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        weights_NK, ids_NK = self.router(x_ND).softmax(dim=-1).topk(K, dim=-1)
        gate_NE = torch.zeros(x_ND.shape[0], E, device=x_ND.device).scatter(1, ids_NK,
                                                                             weights_NK)
        return x_ND + torch.einsum("ne,end->nd", gate_NE, self.experts(x_ND))


class SyncFreeModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(SyncFreeMoE() for _ in range(LAYERS))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, x_N: torch.Tensor, y_N: torch.Tensor) -> torch.Tensor:
        h_ND = self.embed(x_N)
        for layer in self.layers:
            h_ND = layer(h_ND)
        return nn.functional.cross_entropy(self.head(h_ND), y_N)


def _build(tensor_lr: bool) -> tuple[SyncFreeModel, torch.optim.Optimizer, ExpertSpec]:
    torch.manual_seed(0)
    model = SyncFreeModel().cuda()
    # A tensor learning rate (capturable AdamW) is what a CUDA-graph loop keeps: the
    # engine must take it without reading it on this thread.
    lr = torch.tensor(1e-3, device="cuda") if tensor_lr else 1e-3
    opt = torch.optim.AdamW(model.parameters(), lr=lr, capturable=tensor_lr)
    spec = ExpertSpec.from_modules(model, [f"layers.{i}.experts" for i in range(LAYERS)],
                                   n_experts=E)
    return model, opt, spec


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(step)
    x = torch.randint(0, VOCAB, (N + 1,), device="cuda", generator=g)
    return x[:-1], x[1:]


@contextlib.contextmanager
def waits_recorded() -> Iterator[list[str]]:
    """Every `synchronize()` of a stream, an event or the device called on this thread
    meanwhile (the snapshot thread's own waits are its business, not training's)."""
    me = threading.current_thread()
    waits: list[str] = []

    def recording(name: str, original):
        def wait(*args, **kwargs):
            if threading.current_thread() is me:
                waits.append(name)
            return original(*args, **kwargs)
        return wait

    with pytest.MonkeyPatch.context() as patch:
        for owner, attr, name in ((torch.cuda.Event, "synchronize", "Event.synchronize"),
                                  (torch.cuda.Stream, "synchronize", "Stream.synchronize"),
                                  (torch.cuda, "synchronize", "torch.cuda.synchronize")):
            patch.setattr(owner, attr, recording(name, getattr(owner, attr)))
        yield waits


def _step(model, opt, ckpt, step: int) -> torch.Tensor:
    x, y = _batch(step)
    loss = model(x, y)
    loss.backward()
    ckpt.wait_for_snapshot()
    opt.step()
    opt.zero_grad(set_to_none=True)
    ckpt.maybe_save(step, {"step": step})
    if ckpt.pending:
        assert all(r.error is None for r in ckpt.drain_completed())
    return loss.detach()


@pytest.mark.parametrize("tensor_lr", [False, True], ids=["float-lr", "tensor-lr"])
def test_a_checkpointed_step_never_waits_for_the_device(tmp_path, tensor_lr):
    model, opt, spec = _build(tensor_lr)
    ckpt = TwoLevelCheckpointer(model, opt, tmp_path / "ckpt", experts=spec,
                                policy=PECPolicy(k=1), interval=1)
    ckpt.watch_routing(model)
    for step in (1, 2):  # warm: the ledger's counts move to the device, pinned buffers
        _step(model, opt, ckpt, step)
    losses = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        with waits_recorded() as waits:
            for step in range(3, 9):  # forward, backward, the engine's calls, the optimizer
                losses.append(_step(model, opt, ckpt, step))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert waits == [], f"the training thread waited for the device: {waits}"
    ckpt.flush()
    results = ckpt.drain_completed()
    assert [r.step for r in results if r.error is None][-1] == 8
    assert torch.stack(losses).isfinite().all()
    # The counts the hooks took on the device reached the ledger through the host.
    assert int(ckpt.parts.ledger.cumulative.sum()) == 8 * N * K * LAYERS
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    ckpt.close(keep_snapshots=True)
    model2, opt2, spec2 = _build(tensor_lr)
    with torch.no_grad():
        for p in model2.parameters():
            p.zero_()
    again = TwoLevelCheckpointer(model2, opt2, tmp_path / "ckpt", experts=spec2,
                                 policy=PECPolicy(k=1), interval=1)
    report = again.restore()
    assert (report.step, report.source) == (8, "memory")
    for n, p in model2.named_parameters():
        assert torch.equal(p, state[n]), n
    again.close()


def test_the_slots_are_pinned_and_ready_before_the_first_checkpoint(tmp_path):
    model, opt, spec = _build(False)
    ckpt = TwoLevelCheckpointer(model, opt, tmp_path / "ckpt", experts=spec,
                                policy=PECPolicy(k=1), interval=4)
    _step(model, opt, ckpt, 1)  # the first optimizer step prepares them
    ckpt.snapshots.wait_prepared()
    store = ckpt.snapshots.store
    assert store.pinned is True and store.sizes()["snapshot_bytes"] > 0
    for step in range(2, 9):
        _step(model, opt, ckpt, step)
    ckpt.flush()
    results = ckpt.drain_completed()
    assert [r.step for r in results] == [4, 8]
    for r in results:  # nothing left to reserve, map or pin at a checkpoint
        assert r.phases["snapshot"].get("reserve", [0.0])[0] < 0.05, r.phases
    ckpt.close()


def test_the_slots_are_pinned_again_after_a_restore_from_memory(tmp_path):
    """A restore maps the slots it reads without pinning them (it only reads); the copies
    that follow it must still be asynchronous DMA into pinned memory."""
    model, opt, spec = _build(False)
    ckpt = TwoLevelCheckpointer(model, opt, tmp_path / "ckpt", experts=spec,
                                policy=PECPolicy(k=1), interval=1)
    for step in range(1, 5):
        _step(model, opt, ckpt, step)
    ckpt.flush()
    ckpt.drain_completed()
    ckpt.close(keep_snapshots=True)  # as after a crash: memory survives
    model2, opt2, spec2 = _build(False)
    again = TwoLevelCheckpointer(model2, opt2, tmp_path / "ckpt", experts=spec2,
                                 policy=PECPolicy(k=1), interval=1)
    report = again.restore()
    assert (report.step, report.source) == (4, "memory")
    for step in range(5, 9):  # into every slot, the ones the restore read first
        _step(model2, opt2, again, step)
    again.flush()
    results = again.drain_completed()
    assert [r.step for r in results if r.error is None] == [5, 6, 7, 8]
    store = again.snapshots.store
    assert store.pinned is True and len(store._maps) == 3
    again.close()
