"""Never silent about optimizer state. An optimizer that steps others (torchtitan's
`OptimizersContainer`, whose own `.state` is empty) is read through, each inner
optimizer saved and restored; one whose inner optimizers moc cannot see is refused in
one line, at the first save and at a restore; a restore that would drop state the
optimizer holds is an error.

Before this (issue 46), the container was saved with no optimizer state at all and
restored with none, without a word: the losses after the restore differed."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import moc
from moc.checkpoint.errors import IncompatibleCheckpointError
from moc.checkpoint.optimizers import inner_optimizers, unread_tensors
from moc.model import ModelConfig, Transformer
from tests.engines import save_now

CFG = ModelConfig(seq_len=8, d_model=16, n_layers=2, n_heads=2, d_ffn=32, n_experts=4)


def _model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(CFG)


def _train(model: Transformer, opt: Any, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


def _state(model: Transformer, opts: list[torch.optim.Optimizer]
           ) -> dict[tuple[str, str], torch.Tensor]:
    name = {id(p): n for n, p in model.named_parameters()}
    return {(name[id(p)], k): v.clone() for o in opts for p, s in o.state.items()
            for k, v in s.items()}


class Container(torch.optim.Optimizer):
    """torchtitan's OptimizersContainer's shape, without torchtitan: an Optimizer over
    every parameter (for hooks), empty `.state`, stepping the optimizers it holds in
    `.optimizers` (AdamW for the experts, SGD with momentum for the rest), and a flat
    `state_dict()` of its own."""

    def __init__(self, model: Transformer) -> None:
        experts = [p for n, p in model.named_parameters() if ".experts." in n]
        dense = [p for n, p in model.named_parameters() if ".experts." not in n]
        self.optimizers = [torch.optim.AdamW(experts, lr=1e-2),
                           torch.optim.SGD(dense, lr=1e-2, momentum=0.9)]
        torch.optim.Optimizer.__init__(self, list(model.parameters()), {})

    def step(self, closure: Any = None) -> None:
        for o in self.optimizers:
            o.step()

    def state_dict(self) -> dict[str, Any]:
        return {f"{i}.{k}": v for i, o in enumerate(self.optimizers)
                for k, v in o.state_dict().items()}


class Hidden(Container):
    """A wrapper whose inner optimizers are nowhere moc can see them (a closure)."""

    def __init__(self, model: Transformer) -> None:
        super().__init__(model)
        inner = self.optimizers
        del self.optimizers
        self._inner = lambda: inner

    def step(self, closure: Any = None) -> None:
        for o in self._inner():
            o.step()

    def state_dict(self) -> dict[str, Any]:
        return {f"{i}.{k}": v for i, o in enumerate(self._inner())
                for k, v in o.state_dict().items()}


def test_a_container_is_read_through_and_restores_every_inner_optimizer(tmp_path):
    model = _model()
    opt = Container(model)
    assert inner_optimizers(opt) == opt.optimizers
    _train(model, opt, range(1, 4))
    want = _state(model, opt.optimizers)
    assert len(want) > 0 and not opt.state  # the container's own state is empty
    ckpt = moc.Checkpointer(model, opt, tmp_path, policy=moc.PECPolicy.full())
    assert save_now(ckpt, 3).ok
    ckpt.close()

    model2 = _model()
    opt2 = Container(model2)
    opt2.optimizers[0].param_groups[0]["lr"] = 0.5  # restored from the checkpoint
    ckpt = moc.Checkpointer(model2, opt2, tmp_path, policy=moc.PECPolicy.full())
    assert ckpt.restore().step == 3
    ckpt.close()
    got = _state(model2, opt2.optimizers)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert opt2.optimizers[0].param_groups[0]["lr"] == 1e-2
    # ... and trains on exactly as the run that was never interrupted.
    _train(model, opt, range(4, 6))
    _train(model2, opt2, range(4, 6))
    for (n, p), (_, q) in zip(model.named_parameters(), model2.named_parameters(),
                              strict=True):
        assert torch.equal(p, q), n


def test_a_list_of_optimizers_is_one_optimizer_state(tmp_path):
    model = _model()
    opts = Container(model).optimizers
    for step in range(1, 3):
        _train(model, opts[0], range(step, step + 1))
        opts[1].step()
    ckpt = moc.Checkpointer(model, opts, tmp_path, policy=moc.PECPolicy.full())
    assert save_now(ckpt, 2).ok
    ckpt.close()
    model2 = _model()
    opts2 = Container(model2).optimizers
    ckpt = moc.Checkpointer(model2, opts2, tmp_path, policy=moc.PECPolicy.full())
    ckpt.restore()
    ckpt.close()
    want, got = _state(model, opts), _state(model2, opts2)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_a_wrapper_moc_cannot_read_is_refused_in_one_line_at_the_first_save(tmp_path):
    model = _model()
    opt = Hidden(model)
    assert inner_optimizers(opt) == []
    ckpt = moc.Checkpointer(model, opt, tmp_path, policy=moc.PECPolicy.full())
    assert save_now(ckpt, 0).ok  # before any step there is no state to lose
    _train(model, opt, range(1, 3))
    assert unread_tensors(opt) > 0
    with pytest.raises(TypeError, match=r"^moc cannot read the state of Hidden: its "
                       r"state_dict\(\) holds \d+ tensors that its \.state does not") as e:
        ckpt.save(2)
    assert "\n" not in str(e.value) and "OptimizerState" in str(e.value)
    ckpt.close()


def test_a_restore_into_a_wrapper_moc_cannot_read_is_refused(tmp_path):
    """A checkpoint of one AdamW over every parameter (one param group, as the wrapper's
    own): its state would go into the wrapper's `.state`, which nothing steps with."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, range(1, 3))
    ckpt = moc.Checkpointer(model, opt, tmp_path, policy=moc.PECPolicy.full())
    assert save_now(ckpt, 2).ok
    ckpt.close()
    model2 = _model()
    opt2 = Hidden(model2)
    ckpt = moc.Checkpointer(model2, opt2, tmp_path, policy=moc.PECPolicy.full())
    with pytest.raises(TypeError, match="^moc cannot read the state of Hidden: its "
                       r"state_dict\(\) shows none of the state restored"):
        ckpt.restore()
    ckpt.close()


def test_a_restore_that_would_drop_state_the_optimizer_holds_is_an_error(tmp_path):
    """The checkpoint holds the experts' AdamW state only (the dense SGD had not stepped
    when it was taken); the optimizer holds state for both now: restoring would reset
    the dense parameters' momentum without a word."""
    model = _model()
    opt = Container(model)
    adamw = opt.optimizers[0]
    _train(model, adamw, range(1, 3))
    ckpt = moc.Checkpointer(model, opt, tmp_path, policy=moc.PECPolicy.full())
    assert save_now(ckpt, 2).ok
    _train(model, opt, range(3, 4))
    with pytest.raises(IncompatibleCheckpointError, match="holds no optimizer state for"):
        ckpt.restore()
    ckpt.close()


def test_torchtitans_own_container_is_read_through(tmp_path):
    optimizer = pytest.importorskip("torchtitan.components.optimizer")
    model = _model()
    opt = optimizer.default_adamw(lr=1e-2, fused=False, foreach=True).build(
        model_parts=[model])
    assert type(opt).__name__ == "OptimizersContainer" and not opt.state
    _train(model, opt, range(1, 3))
    want = _state(model, opt.optimizers)
    ckpt = moc.Checkpointer(model, opt, tmp_path, policy=moc.PECPolicy.full())
    assert save_now(ckpt, 2).ok
    ckpt.close()
    model2 = _model()
    opt2 = optimizer.default_adamw(lr=1e-2, fused=False, foreach=True).build(
        model_parts=[model2])
    ckpt = moc.Checkpointer(model2, opt2, tmp_path, policy=moc.PECPolicy.full())
    ckpt.restore()
    ckpt.close()
    got = _state(model2, opt2.optimizers)
    assert len(want) == 3 * len(list(model.parameters()))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
