"""The engine on a model it has never seen: nn.ModuleList experts, its own names."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moc.checkpoint.policy.selection import PECPolicy
from moc.checkpoint.spec import ExpertSpec
from moc.checkpoint.store.manifest import Manifest
from moc.checkpoint.sync import Checkpointer

N_EXPERTS = 4


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc_in = nn.Linear(8, 16)
        self.fc_out = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(torch.relu(self.fc_in(x)))


class Mixture(nn.Module):
    """Top-1 routing over a ModuleList called `ffns` (not `experts`)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, N_EXPERTS)
        self.ffns = nn.ModuleList(Expert() for _ in range(N_EXPERTS))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        choice = self.gate(x).argmax(-1)
        out = torch.zeros_like(x)
        for e, ffn in enumerate(self.ffns):
            mask = choice == e
            out[mask] = ffn(x[mask])
        return x + out, torch.bincount(choice, minlength=N_EXPERTS)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(Mixture() for _ in range(2))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embed(x)
        counts = []
        for block in self.blocks:
            x, c = block(x)
            counts.append(c)
        return x.pow(2).mean(), torch.stack(counts)


def _spec(model: Net) -> ExpertSpec:
    return ExpertSpec.from_modules(model, ["blocks.0.ffns", "blocks.1.ffns"])


def _build(seed: int) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model: Net, opt: torch.optim.Optimizer, seed: int) -> torch.Tensor:
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(seed))
    loss, counts = model(x)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return counts


def test_spec_maps_modulelist_experts_to_per_expert_keys():
    spec = _spec(Net())
    assert spec.n_experts == N_EXPERTS and spec.n_moe_layers == 2
    by_name = spec.by_name()
    p = by_name["blocks.1.ffns.3.fc_in.weight"]
    assert (p.stem, p.moe_layer, p.expert_dim, p.global_ids) == (
        "blocks.1.ffns.fc_in.weight", 1, None, (3,))
    assert "embed.weight" not in by_name and "blocks.0.gate.weight" not in by_name


def test_infer_finds_modules_named_experts_and_offsets_them():
    model = nn.Module()
    model.experts = nn.ModuleList(Expert() for _ in range(2))
    spec = ExpertSpec.infer(model, n_experts=4, expert_offset=2)
    assert {p.global_ids for p in spec.params} == {(2,), (3,)}
    with pytest.raises(ValueError, match="no expert container"):
        ExpertSpec.infer(Net())
    with pytest.raises(ValueError, match=r"outside 0\.\.3"):
        ExpertSpec.infer(model, n_experts=4, expert_offset=3)


def test_full_restore_of_a_foreign_model_is_bitwise(tmp_path):
    model, opt = _build(0)
    ckpt = Checkpointer(model, opt, tmp_path, experts=_spec(model), interval=1)
    for step in range(3):
        ckpt.record_routing(_step(model, opt, step))
    ckpt.save(3, {"step": 3})
    fresh, fresh_opt = _build(1)
    report = Checkpointer(fresh, fresh_opt, tmp_path, experts=_spec(fresh)).restore()
    assert report.step == 3 and report.lost_tokens == 0
    for (n, a), (_, b) in zip(model.named_parameters(), fresh.named_parameters(), strict=True):
        assert torch.equal(a, b), n
    for pa, pb in zip(model.parameters(), fresh.parameters(), strict=True):
        for k in opt.state[pa]:
            assert torch.equal(opt.state[pa][k], fresh_opt.state[pb][k]), k
    # Training continues identically from the restored state.
    _step(model, opt, 99)
    _step(fresh, fresh_opt, 99)
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)


def test_partial_checkpoints_of_a_foreign_model_chain_to_older_copies(tmp_path):
    model, opt = _build(0)
    ckpt = Checkpointer(model, opt, tmp_path, experts=_spec(model),
                        policy=PECPolicy(k=1), interval=1)
    copies = {}
    for step in range(1, 5):
        ckpt.record_routing(_step(model, opt, step))
        ckpt.save(step)
        copies[step] = {n: p.detach().clone() for n, p in model.named_parameters()}
    m = Manifest.load(tmp_path, 4)
    assert m.experts_saved == {"0": [(0 + 3) % 4], "1": [(1 + 3) % 4]}
    fresh, fresh_opt = _build(1)
    Checkpointer(fresh, fresh_opt, tmp_path, experts=_spec(fresh),
                 policy=PECPolicy(k=1)).restore()
    for name, p in fresh.named_parameters():
        parts = name.split(".")
        if len(parts) > 3 and parts[2] == "ffns":
            stem = ".".join(parts[:3] + parts[4:])
            src = m.entries[f"param/{stem}/expert={parts[3]}"].step
        else:
            src = 4
        assert torch.equal(p, copies[src][name]), (name, src)
