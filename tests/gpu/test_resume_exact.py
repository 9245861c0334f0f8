"""A CUDA run restored from memory resumes bit for bit, and its optimizer steps: with a
fused AdamW (torchtitan's default), a capturable AdamW with a tensor learning rate (a
CUDA-graph loop's), and a model whose dropout draws from the CUDA generator. Each trains
N steps straight, saving at step K, then a fresh model and optimizer restore step K from
the two-level engine's snapshot and train to N: the losses and the final weights must be
the straight run's, exactly. Skipped without a GPU; scripts/gpu_check.sh runs them.

What each case needs of a restore: fused and capturable AdamW read `step` on the device
(a `step` left on the host fails the capturable one's first step, `placed_like_torch`);
dropout needs the CUDA generator's state, which a checkpoint of the CPU generator alone
does not hold (`RankState.rng`). The slots are in the test's own MOC_SHM_ROOT, under
/dev/shm (tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moc.checkpoint.policy.selection import PECPolicy
from moc.checkpoint.spec import ExpertSpec
from moc.checkpoint.twolevel.checkpointer import TwoLevelCheckpointer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA device")]

D, F, E, K, VOCAB, N = 32, 64, 4, 2, 64, 256
"""Width, expert hidden width, experts, experts per token, classes, tokens per batch."""
STEPS, SAVED_AT = 8, 4
CASES = ["fused-adamw", "capturable-adamw-tensor-lr", "dropout"]


class Experts(nn.Module):
    """E experts as batched [E, ...] weights; every expert runs on every token."""

    def __init__(self) -> None:
        super().__init__()
        self.w1_EDF = nn.Parameter(torch.randn(E, D, F) / D**0.5)
        self.w2_EFD = nn.Parameter(torch.randn(E, F, D) / F**0.5)

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        h_ENF = torch.einsum("nd,edf->enf", x_ND, self.w1_EDF).relu()
        return torch.einsum("enf,efd->end", h_ENF, self.w2_EFD)


class Model(nn.Module):
    """Input projection, one MoE layer with top-k gating, dropout (p=0: none), head.
    No embedding (its CUDA backward adds with atomics: not bitwise across runs)."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.router = nn.Linear(D, E, bias=False)
        self.experts = Experts()
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, x_ND: torch.Tensor, y_N: torch.Tensor) -> torch.Tensor:
        h_ND = self.drop(self.inp(x_ND))
        weights_NK, ids_NK = self.router(h_ND).softmax(dim=-1).topk(K, dim=-1)
        gate_NE = torch.zeros(h_ND.shape[0], E, device=h_ND.device).scatter(1, ids_NK,
                                                                             weights_NK)
        h_ND = h_ND + self.drop(torch.einsum("ne,end->nd", gate_NE, self.experts(h_ND)))
        return nn.functional.cross_entropy(self.head(h_ND), y_N)


def _build(case: str, seed: int) -> tuple[Model, torch.optim.Optimizer, ExpertSpec]:
    """The case's model and optimizer, on the GPU. `seed` sets the weights and every
    generator (the CPU's and CUDA's): a restore must bring back the saved ones."""
    torch.manual_seed(seed)
    model = Model(dropout=0.2 if case == "dropout" else 0.0).cuda()
    if case == "fused-adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    elif case == "capturable-adamw-tensor-lr":
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3, device="cuda"),
                                capturable=True)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    spec = ExpertSpec.from_modules(model, ["experts"], n_experts=E)
    return model, opt, spec


def _engine(model: Model, opt: torch.optim.Optimizer, spec: ExpertSpec, root
            ) -> TwoLevelCheckpointer:
    # Every expert in each snapshot; no save but the test's own.
    return TwoLevelCheckpointer(model, opt, root, experts=spec, policy=PECPolicy.full(),
                                interval=10**6)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(step)  # not the default generator
    x = torch.randn(N, D, device="cuda", generator=g)
    y = torch.randint(0, VOCAB, (N,), device="cuda", generator=g)
    return x, y


def _train(model: Model, opt: torch.optim.Optimizer, ckpt: TwoLevelCheckpointer,
           steps: range, save_at: int | None = None) -> list[torch.Tensor]:
    losses = []
    for step in steps:
        x, y = _batch(step)
        loss = model(x, y)
        loss.backward()
        ckpt.wait_for_snapshot()  # the snapshot's copies of the weights have landed
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == save_at:
            ckpt.save(step, {"step": step})
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("case", CASES)
def test_a_run_restored_from_memory_steps_on_bitwise(tmp_path, case):
    model, opt, spec = _build(case, seed=0)
    ckpt = _engine(model, opt, spec, tmp_path / "ckpt")
    straight = _train(model, opt, ckpt, range(1, STEPS + 1), save_at=SAVED_AT)
    ckpt.flush()
    assert [(r.step, r.error) for r in ckpt.drain_completed()] == [(SAVED_AT, None)]
    final = {n: p.detach().clone() for n, p in model.named_parameters()}
    ckpt.close(keep_snapshots=True)  # as after a crash: the snapshots survive

    model2, opt2, spec2 = _build(case, seed=1)  # other weights, other RNG states
    again = _engine(model2, opt2, spec2, tmp_path / "ckpt")
    report = again.restore()
    assert (report.step, report.source) == (SAVED_AT, "memory")
    restored = {n: p.detach().clone() for n, p in model2.named_parameters()}
    resumed = _train(model2, opt2, again, range(SAVED_AT + 1, STEPS + 1))
    again.close()

    assert torch.equal(torch.stack(resumed), torch.stack(straight[SAVED_AT:])), (
        torch.stack(resumed).tolist(), torch.stack(straight[SAVED_AT:]).tolist())
    for n, p in model2.named_parameters():
        assert not torch.equal(p, restored[n]), f"{n}: the optimizer did not step"
        assert torch.equal(p, final[n]), n
    for p in model2.parameters():
        step = opt2.state[p]["step"]
        if case != "dropout":  # fused and capturable kernels read `step` on the device
            assert (step.device.type, step.dtype) == ("cuda", torch.float32)
        assert int(step.item()) == STEPS
