"""A small MoE laid out as PyTorch-native training lays it out (torchtitan): FSDP2
(`fully_shard`) on the dense layers, and batched experts `[E, D, F]` as DTensors `Shard(0)`
over an expert-parallel mesh dimension; on a 2-D mesh (dp_shard x ep) the experts are
`Shard(0)` over ep and replicated over dp_shard, the dense layers sharded over both.

Every rank computes the same loss on the same batch, so runs are deterministic; the
experts' forward all-gathers them (`full_tensor()`), which is not how real expert
parallelism moves tokens but exercises the same checkpointed layout.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

D, F, E, VOCAB, LAYERS = 8, 16, 4, 32, 2


class Experts(nn.Module):
    """Batched experts: w1 [E, D, F], w2 [E, F, D]."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(E, D, F) * 0.3)
        self.w2 = nn.Parameter(torch.randn(E, F, D) * 0.3)

    def forward(self, h: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
        w1, w2 = (w.full_tensor() if isinstance(w, DTensor) else w for w in (self.w1, self.w2))
        y = torch.einsum("bd,bdf->bf", h, w1[top]).relu()
        return torch.einsum("bf,bfd->bd", y, w2[top])


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(D, D)
        self.router = nn.Linear(D, E, bias=False)
        self.experts = Experts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(x)
        gate, top = self.router(h).softmax(-1).max(-1)
        return h + gate[:, None] * self.experts(h, top)


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def top1(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
    """`watch_routing`'s `indices`: the expert each token went to, from the router's
    logits."""
    return output.argmax(-1, keepdim=True)


def build(mesh: DeviceMesh | None, seed: int = 0, fsdp_experts: bool = False) -> MoE:
    """The seeded model; with `mesh` (1-D: (ep,), or 2-D named ("dp_shard", "ep")),
    laid out over it. `fsdp_experts` (2-D): the experts, `Shard(0)` over ep, are also
    sharded by FSDP2 over dp_shard, as torchtitan does: placements
    (_StridedShard(0), Shard(0))."""
    torch.manual_seed(seed)
    model = MoE()
    if mesh is None:
        return model
    ep_mesh = mesh["ep"] if mesh.ndim == 2 else mesh
    placements = [Replicate(), Shard(0)] if mesh.ndim == 2 else [Shard(0)]
    for block in model.layers:
        for name in ("w1", "w2"):
            w = getattr(block.experts, name)
            setattr(block.experts, name, nn.Parameter(
                distribute_tensor(w.data, ep_mesh, [Shard(0)]) if fsdp_experts
                else distribute_tensor(w.data, mesh, placements)))
        if fsdp_experts:
            fully_shard(block.experts, mesh=mesh["dp_shard"])
        for module in (block.attn, block.router):
            fully_shard(module, mesh=mesh["dp_shard"] if mesh.ndim == 2 else mesh)
    fully_shard(model.embed, mesh=ep_mesh if mesh.ndim == 1 else mesh["dp_shard"])
    fully_shard(model.head, mesh=ep_mesh if mesh.ndim == 1 else mesh["dp_shard"])
    return model


def mesh_of(shape: tuple[int, ...]) -> DeviceMesh:
    if len(shape) == 1:
        return init_device_mesh("cpu", shape)
    return init_device_mesh("cpu", shape, mesh_dim_names=("dp_shard", "ep"))


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (12,), generator=g)


def train_step(model: MoE, opt: torch.optim.Optimizer, step: int) -> float:
    idx = batch(step)
    logits = model(idx)
    loss = nn.functional.cross_entropy(logits, idx.roll(1))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def full_state(model: MoE, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer state tensor, whole (collective for DTensors)."""
    out = {}
    for name, p in model.named_parameters():
        out[f"param/{name}"] = full(p)
        for k, v in opt.state.get(p, {}).items():
            out[f"optim/{name}/{k}"] = full(v)
    return out
