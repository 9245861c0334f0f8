from __future__ import annotations

import pytest
import torch

from moc.model import FeedForward, ModelConfig, MoE, Transformer


def _cfg(**kw) -> ModelConfig:
    base = {"seq_len": 16, "d_model": 32, "n_layers": 2, "n_heads": 4, "d_ffn": 64,
            "n_experts": 4, "top_k": 2}
    return ModelConfig(**{**base, **kw})


def test_one_expert_moe_equals_dense_ffn_forward_and_gradients():
    torch.manual_seed(0)
    cfg = _cfg(n_experts=1, top_k=1)
    moe, dense = MoE(cfg), FeedForward(cfg)
    torch.nn.init.normal_(moe.experts.w1_LDF, std=0.1)
    torch.nn.init.normal_(moe.experts.w2_LFD, std=0.1)
    with torch.no_grad():
        dense.w1.weight.copy_(moe.experts.w1_LDF[0].T)
        dense.w2.weight.copy_(moe.experts.w2_LFD[0].T)
    x = torch.randn(3, 16, cfg.d_model)
    x_moe, x_dense = x.clone().requires_grad_(), x.clone().requires_grad_()

    y_moe, _, counts = moe(x_moe)
    y_dense = dense(x_dense)
    torch.testing.assert_close(y_moe, y_dense, rtol=1e-6, atol=1e-6)
    assert counts.tolist() == [3 * 16]

    g = torch.randn_like(y_dense)
    y_moe.backward(g)
    y_dense.backward(g)
    torch.testing.assert_close(x_moe.grad, x_dense.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(moe.experts.w1_LDF.grad[0], dense.w1.weight.grad.T,
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(moe.experts.w2_LFD.grad[0], dense.w2.weight.grad.T,
                               rtol=1e-5, atol=1e-6)


def test_tokens_per_expert_counts_every_assignment_per_moe_layer():
    torch.manual_seed(0)
    cfg = _cfg(n_layers=4, moe_every=2)
    model = Transformer(cfg)
    idx = torch.randint(0, 256, (2, 16))
    out = model(idx, idx)
    assert cfg.moe_layers == (1, 3)
    assert out.tokens_per_expert.shape == (2, cfg.n_experts)
    assert out.tokens_per_expert.sum(1).tolist() == [2 * 16 * cfg.top_k] * 2
    assert out.loss is not None and torch.isfinite(out.loss)


def test_capacity_factor_drops_assignments_beyond_capacity():
    torch.manual_seed(0)
    cfg = _cfg(capacity_factor=0.5)
    moe = MoE(cfg)
    with torch.no_grad():  # route every token to experts 0 and 1
        moe.router.gate.weight.zero_()
        moe.router.gate.weight[0, 0] = moe.router.gate.weight[1, 0] = 10.0
    x = torch.zeros(1, 16, cfg.d_model)
    x[..., 0] = 1.0
    _, _, counts = moe(x)
    capacity = int(0.5 * 16 * 2 / 4)  # ceil(cf * N * K / E)
    assert counts.tolist() == [capacity, capacity, 0, 0]


def test_top1_gate_passes_gradient_to_router():
    torch.manual_seed(0)
    model = Transformer(_cfg(top_k=1))
    idx = torch.randint(0, 256, (2, 16))
    model(idx, idx).loss.backward()
    assert model.layers[0].ffn.router.gate.weight.grad.abs().sum() > 0


@pytest.mark.parametrize(("field", "value", "match"), [
    ("n_heads", 5, "divisible by n_heads"),
    ("top_k", 9, "top_k"),
    ("capacity_factor", 0.0, "capacity_factor"),
    ("n_experts", 0, "n_experts"),
])
def test_config_rejects_bad_values_naming_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        _cfg(**{field: value})
