"""A restored optimizer state entry sits where torch's own `Optimizer.load_state_dict`
puts it: the same device, dtype and value, for every optimizer, on every device; and the
optimizer steps after the restore exactly as it would have without one.

torch's rule (`Optimizer._process_value_according_to_param_policy`): `step` in float32
on the parameter's device when its group is `fused` or `capturable`, else as stored; any
other entry on the parameter's device, in its dtype when it is floating point. A
capturable AdamW whose `step` is left on the host fails its first step on CUDA.

"meta" makes the device observable on a machine without an accelerator: a meta
parameter's state that is not on meta was placed by a rule other than torch's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import moc
from moc.checkpoint.optimizers import TorchOptimizerState
from moc.model import ModelConfig, Transformer
from tests.engines import save_now

CFG = ModelConfig(seq_len=8, d_model=16, n_layers=2, n_heads=2, d_ffn=32, n_experts=4)
SAVED_AT = 2

Factory = Callable[[Any], torch.optim.Optimizer]
OPTIMIZERS: dict[str, Factory] = {
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "adamw-capturable": lambda ps: torch.optim.AdamW(ps, lr=1e-2, capturable=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.9, centered=True),
    "asgd": lambda ps: torch.optim.ASGD(ps, lr=1e-2),  # 0-dim state besides step: eta, mu
}
CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _can_step(kind: str, device: str) -> bool:
    """Whether torch steps this optimizer on this device: nothing steps on meta (no
    values), a capturable one only on an accelerator, a fused one not on meta."""
    return device != "meta" and not (kind == "adamw-capturable" and device == "cpu")


def _can_build(kind: str, device: str) -> bool:
    return not (kind == "adamw-fused" and device == "meta")  # torch refuses it


def _model(device: str, dtype: torch.dtype) -> Transformer:
    torch.manual_seed(0)
    return Transformer(CFG).to(device=device, dtype=dtype)


def _grads(model: nn.Module, step: int) -> None:
    """The same gradients for every model at `step`, made on the host."""
    g = torch.Generator().manual_seed(step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g).to(device=p.device, dtype=p.dtype)


def _on_host(sd: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict as storage gives it back (`torch.load(..., map_location=
    "cpu")`): every tensor on the host, as moc's readers give it."""
    return {"state": {i: {k: v.cpu() if isinstance(v, torch.Tensor) else v
                          for k, v in s.items()} for i, s in sd["state"].items()},
            "param_groups": sd["param_groups"]}


def _saved_for(sd: dict[str, Any], opt: torch.optim.Optimizer) -> dict[str, Any]:
    """`sd` with `opt`'s implementation flags in its groups: what `opt`'s twin would have
    saved (torch's load_state_dict places state by the saved groups' flags; moc keeps the
    restoring process's flags, which are these)."""
    flags = ("foreach", "fused", "capturable")
    groups = [{**g, **{f: now[f] for f in flags if f in now}}
              for g, now in zip(sd["param_groups"], opt.param_groups, strict=True)]
    return {"state": sd["state"], "param_groups": groups}


def _state_by_name(model: nn.Module, opt: torch.optim.Optimizer
                   ) -> dict[tuple[str, str], torch.Tensor]:
    return {(n, k): v for n, p in model.named_parameters()
            for k, v in opt.state.get(p, {}).items()}


def _assert_same_state(got: dict[tuple[str, str], torch.Tensor],
                       want: dict[tuple[str, str], torch.Tensor], *, values: bool) -> None:
    assert got.keys() == want.keys()
    for key, w in want.items():
        g = got[key]
        assert (g.device, g.dtype, g.shape) == (w.device, w.dtype, w.shape), key
        if values:
            assert torch.equal(g, w), key


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("device", ["cpu", "meta", CUDA])
@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_restored_optimizer_state_is_placed_as_torch_places_it_and_steps_bitwise(
        tmp_path, kind, device, dtype):
    if not _can_build(kind, device):
        pytest.skip(f"torch builds no {kind} on {device}")
    if kind == "asgd" and dtype == torch.bfloat16:
        # torch itself casts ASGD's fp32 eta and mu to bf16 on load: no bitwise resume.
        pytest.skip("torch's own restore of ASGD in bf16 is not bitwise")
    make = OPTIMIZERS[kind]
    # The run that saves: on this device where it can step there, else a twin that can
    # on the host (a capturable AdamW's state is a plain AdamW's, step in float32).
    steps_here = _can_step(kind, device)
    src_device = device if steps_here else "cpu"
    src = _model(src_device, dtype)
    twin = "adamw-foreach" if kind == "adamw-capturable" and not steps_here else kind
    src_opt = OPTIMIZERS[twin](src.parameters())
    for step in range(1, SAVED_AT + 1):
        _grads(src, step)
        src_opt.step()
    ckpt = moc.Checkpointer(src, src_opt, tmp_path, policy=moc.PECPolicy.full())
    assert save_now(ckpt, SAVED_AT).ok
    ckpt.close()

    want_model = _model(device, dtype)
    want_opt = make(want_model.parameters())
    want_opt.load_state_dict(_saved_for(_on_host(src_opt.state_dict()), want_opt))
    got_model = _model(device, dtype)
    got_opt = make(got_model.parameters())
    ckpt = moc.Checkpointer(got_model, got_opt, tmp_path, policy=moc.PECPolicy.full())
    assert ckpt.restore().step == SAVED_AT
    ckpt.close()
    values = device != "meta"
    _assert_same_state(_state_by_name(got_model, got_opt),
                       _state_by_name(want_model, want_opt), values=values)

    if not steps_here:
        return
    for model, opt in ((src, src_opt), (got_model, got_opt)):
        _grads(model, SAVED_AT + 1)
        opt.step()
    _assert_same_state(_state_by_name(got_model, got_opt), _state_by_name(src, src_opt),
                       values=True)
    for (n, a), (_, b) in zip(got_model.named_parameters(), src.named_parameters(),
                              strict=True):
        assert torch.equal(a, b), n


def test_a_bf16_model_restored_from_an_fp32_run_holds_its_state_in_bf16(tmp_path):
    """torch casts floating point state (not `step`) to the parameter's dtype on load: a
    bf16 process restoring an fp32 run's AdamW holds exp_avg in bf16, as it would have
    created it, not in the checkpoint's fp32."""
    src = _model("cpu", torch.float32)
    src_opt = torch.optim.AdamW(src.parameters(), lr=1e-2)
    _grads(src, 1)
    src_opt.step()
    ckpt = moc.Checkpointer(src, src_opt, tmp_path, policy=moc.PECPolicy.full())
    assert save_now(ckpt, 1).ok
    ckpt.close()
    for device in ("cpu", "meta"):
        want_model = _model(device, torch.bfloat16)
        want_opt = torch.optim.AdamW(want_model.parameters(), lr=1e-2)
        want_opt.load_state_dict(src_opt.state_dict())
        got_model = _model(device, torch.bfloat16)
        got_opt = torch.optim.AdamW(got_model.parameters(), lr=1e-2)
        ckpt = moc.Checkpointer(got_model, got_opt, tmp_path, policy=moc.PECPolicy.full())
        ckpt.restore()
        ckpt.close()
        got = _state_by_name(got_model, got_opt)
        assert {v.dtype for (_, k), v in got.items() if k != "step"} == {torch.bfloat16}
        _assert_same_state(got, _state_by_name(want_model, want_opt),
                           values=device != "meta")


@pytest.mark.parametrize("kind", ["adamw-foreach", "adamw-fused", "sgd-momentum", "asgd"])
def test_installed_state_is_a_copy_even_where_it_already_fits(kind):
    """A reader's tensor may be a view into a mapped file: installed as it is, the
    optimizer would update the file's pages (or crash when they are unmapped). Where
    device and dtype already fit, `.to()` returns the tensor itself; the state must
    still be a copy."""
    src = _model("cpu", torch.float32)
    src_opt = OPTIMIZERS[kind](src.parameters())
    _grads(src, 1)
    src_opt.step()
    given = TorchOptimizerState(src_opt, src).local_state()
    model = _model("cpu", torch.float32)
    opt = OPTIMIZERS[kind](model.parameters())
    TorchOptimizerState(opt, model).load_local_state(given)
    installed = _state_by_name(model, opt)
    assert len(installed) == sum(len(s) for s in given.values())
    for (name, key), v in installed.items():
        assert torch.equal(v, given[name][key]), (name, key)
        assert v.untyped_storage().data_ptr() != given[name][key].untyped_storage().data_ptr()
