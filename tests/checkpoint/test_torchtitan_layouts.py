"""torchtitan's MoE layouts, found by structure as any model's are: 0.3.0's
`moe.routed_experts.inner_experts` (grouped `w1_EFD`, `w2_EDF`, `w3_EFD`, experts first)
with its router `moe.router` beside `routed_experts`, and 0.2.x's `moe.experts` with
`moe.router` beside it, whose router returns (scores, ids, counts). The routed tokens
counted by moc's hooks are those torchtitan counts itself (`tokens_per_expert_E`) or the
ids the router chose."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from moc.checkpoint.routing import RoutingRecorder
from moc.checkpoint.spec import ExpertSpec

E, D, F, K = 8, 16, 32, 2


class Router02(nn.Module):
    """torchtitan 0.2.x's TokenChoiceTopKRouter, reduced: a gate, top-k of its sigmoid,
    and the counts per expert beside the ids."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(D, E, bias=False)
        self.num_experts, self.top_k = E, K

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scores = torch.sigmoid(self.gate(x).float())
        _, ids = torch.topk(scores, k=self.top_k, dim=-1)
        counts = torch.bincount(ids.view(-1), minlength=self.num_experts)  # (E,) int64
        return scores.gather(1, ids), ids, counts


class GroupedExperts(nn.Module):
    """torchtitan's GroupedExperts (both versions): batched weights, experts first."""

    def __init__(self, w1: str = "w1", w2: str = "w2", w3: str = "w3") -> None:
        super().__init__()
        self.num_experts = E
        self.names = (w1, w2, w3)
        for name, shape in zip(self.names, [(E, F, D), (E, D, F), (E, F, D)], strict=True):
            self.register_parameter(name, nn.Parameter(torch.randn(shape) * 0.1))

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (getattr(self, n) for n in self.names)
        out = torch.zeros_like(x)
        for k in range(ids.shape[1]):
            e = ids[:, k]
            h = torch.nn.functional.silu(torch.einsum("td,tfd->tf", x, w1[e]))
            h = h * torch.einsum("td,tfd->tf", x, w3[e])
            out = out + torch.einsum("tf,tdf->td", h, w2[e])
        return out


class MoE02(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = Router02()
        self.experts = GroupedExperts()
        self.register_buffer("expert_bias", torch.zeros(E))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, ids, _ = self.router(x)
        return self.experts(x, ids)


class Model02(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleDict({str(i): nn.ModuleDict({"moe": MoE02()}) for i in range(2)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = x + layer["moe"](x)
        return x


def test_torchtitan_02_layout_is_found_and_its_routing_counted():
    model = Model02()
    spec = ExpertSpec.infer(model)
    assert (spec.n_experts, spec.n_moe_layers) == (E, 2)
    assert [p.name for p in spec.params] == [f"layers.{i}.moe.experts.{w}"
                                            for i in range(2) for w in ("w1", "w2", "w3")]
    chosen: list[torch.Tensor] = []
    for i in range(2):
        model.layers[str(i)]["moe"].router.register_forward_hook(
            lambda m, a, out: chosen.append(torch.bincount(out[1].view(-1), minlength=E)))
    with RoutingRecorder(model, spec) as rec:
        model(torch.randn(12, D)).sum().backward()
        assert torch.equal(rec.take(), torch.stack(chosen))


def test_torchtitan_03_model_is_found_and_counted_as_torchtitan_counts():
    pytest.importorskip("torchtitan")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    from torchtitan_model import model_config

    torch.manual_seed(0)
    model = model_config(layers=2, dim=32, experts=E, top_k=K, ep=1).build()
    with torch.no_grad():
        model.init_weights()
    model.train()
    spec = ExpertSpec.infer(model)
    assert (spec.n_experts, spec.n_moe_layers) == (E, 2)
    assert [p.name for p in spec.params] == [
        f"layers.{i}.moe.routed_experts.inner_experts.{w}"
        for i in range(2) for w in ("w1_EFD", "w2_EDF", "w3_EFD")]
    moes = [model.layers[str(i)].moe for i in range(2)]
    with RoutingRecorder(model, spec) as rec:
        assert rec.routers == {i: moes[i].router for i in range(2)}
        model(torch.randint(0, 512, (2, 16))).float().sum().backward()
        counts = rec.take()
    assert torch.equal(counts, torch.stack([m.tokens_per_expert_E.long() for m in moes]))
    assert counts.sum() == 2 * 2 * 16 * K  # layers x tokens x top-k
