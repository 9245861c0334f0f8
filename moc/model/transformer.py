"""A GPT-style decoder whose feed-forward layers are Mixtures of Experts.

Reads top to bottom: config, norm, attention, dense FFN, router, experts, MoE, block,
transformer. There is no distributed or checkpoint code here. Expert parallelism plugs
in through `MoE.dispatcher` (see `moc.parallel.dispatch`): the layer hands the
dispatcher the token rows sorted by global expert id and gets their expert outputs back
in the same order, whether the experts live in this process or on other ranks.

Shape legend (suffixes on tensor names, as in torchtitan):
    B batch, T sequence, D model width, H heads, C head width, V vocabulary,
    N tokens (B*T), K experts per token (top-k), A routed assignments (<= N*K),
    E experts (global), L experts held locally, F expert hidden width
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

MODEL_TYPE = "moc"
"""`model_type` of this model in a `config.json` (transformers' key for an architecture):
what `moc.model.load_exported` recognises as its own."""


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of the MoE transformer; frozen so it can key checkpoints."""

    vocab_size: int = 256
    """Byte-level tokens by default."""
    seq_len: int = 128
    """Context length; also the size of the learned position table."""
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    d_ffn: int = 256
    """Hidden width of each expert and of the dense FFN layers."""
    n_experts: int = 8
    top_k: int = 2
    moe_every: int = 1
    """1: every layer is MoE; 2: every other layer (1, 3, ...), the rest dense FFN."""
    capacity_factor: float | None = None
    """Per-expert capacity = ceil(cf * N * K / E) assignments per rank; None keeps all."""
    aux_loss_coef: float = 0.01
    """Weight of the Switch-style load-balancing loss."""

    def __post_init__(self) -> None:
        positive = ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "d_ffn",
                    "n_experts", "top_k", "moe_every")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(f"ModelConfig.d_model ({self.d_model}) must be divisible by "
                             f"n_heads ({self.n_heads})")
        if self.top_k > self.n_experts:
            raise ValueError(f"ModelConfig.top_k ({self.top_k}) must be <= n_experts "
                             f"({self.n_experts})")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"ModelConfig.capacity_factor must be > 0 or None, "
                             f"got {self.capacity_factor}")
        if self.aux_loss_coef < 0:
            raise ValueError(f"ModelConfig.aux_loss_coef must be >= 0, got {self.aux_loss_coef}")

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the layers whose FFN is a Mixture of Experts."""
        return tuple(i for i in range(self.n_layers) if i % self.moe_every == self.moe_every - 1)

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, D = x_BTD.shape
        q, k, v = self.qkv(x_BTD).split(D, dim=-1)
        # (B, T, D) -> (B, H, T, C)
        q_BHTC, k_BHTC, v_BHTC = (t.view(B, T, self.n_heads, -1).transpose(1, 2)
                                  for t in (q, k, v))
        y_BHTC = F.scaled_dot_product_attention(q_BHTC, k_BHTC, v_BHTC, is_causal=True)
        return self.proj(y_BHTC.transpose(1, 2).reshape(B, T, D))


class FeedForward(nn.Module):
    """The dense FFN of non-MoE layers; also the reference a 1-expert MoE must equal."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.d_ffn, bias=False)
        self.w2 = nn.Linear(cfg.d_ffn, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


@dataclass
class Routing:
    """What the router decided for N tokens."""

    probs_NE: torch.Tensor
    """Softmax over all experts (float32), for the load-balancing loss."""
    weights_NK: torch.Tensor
    """Gate applied to each chosen expert's output."""
    ids_NK: torch.Tensor
    """Chosen global expert ids, int64."""


class Router(nn.Module):
    """Top-k softmax gate. k > 1 renormalises the chosen probabilities (Mixtral);
    k = 1 keeps the raw probability (Switch) so the router still gets a gradient."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.gate = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)

    def forward(self, x_ND: torch.Tensor) -> Routing:
        probs_NE = self.gate(x_ND).float().softmax(dim=-1)
        weights_NK, ids_NK = probs_NE.topk(self.top_k, dim=-1)
        if self.top_k > 1:
            weights_NK = weights_NK / weights_NK.sum(dim=-1, keepdim=True)
        return Routing(probs_NE, weights_NK.to(x_ND.dtype), ids_NK)


class Experts(nn.Module):
    """The L experts held by this process, as batched parameters [L, ...].

    `expert_offset` is the global id of local expert 0: expert parallelism
    (`moc.parallel.shard_experts`) narrows the tensors to a contiguous range of experts.
    """

    def __init__(self, n_experts: int, d_model: int, d_ffn: int) -> None:
        super().__init__()
        self.expert_offset = 0
        self.w1_LDF = nn.Parameter(torch.empty(n_experts, d_model, d_ffn))
        self.w2_LFD = nn.Parameter(torch.empty(n_experts, d_ffn, d_model))

    @property
    def n_local(self) -> int:
        return self.w1_LDF.shape[0]

    def forward(self, x_AD: torch.Tensor, counts_L: list[int]) -> torch.Tensor:
        """Run rows grouped by local expert: rows [sum(counts[:l]), ...) go to expert l."""
        outputs = [
            F.gelu(x @ self.w1_LDF[i]) @ self.w2_LFD[i]
            for i, x in enumerate(x_AD.split(counts_L))
        ]
        return torch.cat(outputs) if outputs else x_AD


class Dispatcher(Protocol):
    """Moves rows grouped by global expert to wherever those experts live and back."""

    def __call__(self, experts: Experts, x_AD: torch.Tensor, counts_E: list[int]
                 ) -> torch.Tensor: ...


def local_dispatch(experts: Experts, x_AD: torch.Tensor, counts_E: list[int]) -> torch.Tensor:
    """All experts are in this process."""
    assert experts.n_local == len(counts_E), "local dispatch needs every expert local"
    return experts(x_AD, counts_E)


class MoE(nn.Module):
    """Route each token to its top-k experts, run them, and combine the gated outputs."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_experts = cfg.n_experts
        self.top_k = cfg.top_k
        self.capacity_factor = cfg.capacity_factor
        self.router = Router(cfg)
        self.experts = Experts(cfg.n_experts, cfg.d_model, cfg.d_ffn)
        self.dispatcher: Dispatcher = local_dispatch

    def forward(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (output, load-balancing loss, assignments kept per global expert)."""
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(-1, D)
        N, K, E = x_ND.shape[0], self.top_k, self.n_experts
        routing = self.router(x_ND)

        # Group the N*K assignments by expert; a stable sort keeps token order inside
        # each expert, which decides who is dropped first when capacity is exceeded.
        ids_A = routing.ids_NK.reshape(-1)
        order_A = torch.argsort(ids_A, stable=True)
        counts_E = torch.bincount(ids_A, minlength=E)
        if self.capacity_factor is not None:
            capacity = math.ceil(self.capacity_factor * N * K / E)
            starts_E = torch.cumsum(counts_E, 0) - counts_E
            rank_in_expert_A = (torch.arange(N * K, device=ids_A.device)
                                - starts_E[ids_A[order_A]])
            order_A = order_A[rank_in_expert_A < capacity]
            counts_E = counts_E.clamp(max=capacity)
        token_A = order_A // K

        y_AD = self.dispatcher(self.experts, x_ND[token_A], counts_E.tolist())
        y_AD = y_AD * routing.weights_NK.reshape(-1)[order_A].unsqueeze(-1)
        out_ND = torch.zeros_like(x_ND).index_add(0, token_A, y_AD)

        # Switch Transformer's auxiliary loss: E * sum_e (share of assignments) * (mean prob).
        share_E = torch.bincount(ids_A, minlength=E).float() / (N * K)
        aux = E * (share_E * routing.probs_NE.mean(dim=0)).sum()
        return out_ND.view(B, T, D), aux, counts_E


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, moe: bool) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model)
        self.ffn: MoE | FeedForward = MoE(cfg) if moe else FeedForward(cfg)

    def forward(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None,
                                                    torch.Tensor | None]:
        x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD))
        if isinstance(self.ffn, MoE):
            y, aux, counts_E = self.ffn(self.ffn_norm(x_BTD))
            return x_BTD + y, aux, counts_E
        return x_BTD + self.ffn(self.ffn_norm(x_BTD)), None, None


@dataclass
class ModelOutput:
    logits_BTV: torch.Tensor
    loss: torch.Tensor | None
    """Cross-entropy plus aux_loss_coef * mean load-balancing loss; None without targets."""
    ce_loss: torch.Tensor | None
    aux_loss: torch.Tensor
    tokens_per_expert: torch.Tensor
    """(MoE layers, E) int64: assignments each global expert received from this
    process's tokens in this forward (after capacity dropping)."""


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        moe_layers = set(cfg.moe_layers)
        self.layers = nn.ModuleList(Block(cfg, i in moe_layers) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 init; residual projections scaled by 1/sqrt(2 * layers)."""
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)  # norm gains
            elif name.endswith(("proj.weight", "w2.weight", "w2_LFD")):
                p.normal_(0.0, residual_std)
            else:
                p.normal_(0.0, 0.02)

    @property
    def config(self) -> dict:
        """The architecture as a transformers `config.json` holds one: `model_type`,
        `architectures` and the `ModelConfig` fields. Tools that keep a model's config
        with its weights read `model.config` (moc's engines store it in every manifest;
        `moc export` writes it as config.json, which `load_exported` reads back)."""
        return {"model_type": MODEL_TYPE, "architectures": [type(self).__name__],
                **self.cfg.to_dict()}

    def forward(self, idx_BT: torch.Tensor, targets_BT: torch.Tensor | None = None
                ) -> ModelOutput:
        T, max_T = idx_BT.shape[1], self.cfg.seq_len
        if T > max_T:
            raise ValueError(f"sequence length {T} exceeds ModelConfig.seq_len {max_T}")
        x_BTD = self.tok_emb(idx_BT) + self.pos_emb(torch.arange(T, device=idx_BT.device))
        aux_losses, counts = [], []
        for layer in self.layers:
            x_BTD, aux, counts_E = layer(x_BTD)
            if aux is not None:
                aux_losses.append(aux)
                counts.append(counts_E)
        logits_BTV = self.lm_head(self.norm(x_BTD))
        aux_loss = torch.stack(aux_losses).mean() if aux_losses else logits_BTV.new_zeros(())
        tokens_per_expert = (torch.stack(counts) if counts
                             else torch.zeros(0, self.cfg.n_experts, dtype=torch.int64,
                                          device=idx_BT.device))
        ce_loss = loss = None
        if targets_BT is not None:
            ce_loss = F.cross_entropy(logits_BTV.flatten(0, 1).float(), targets_BT.flatten())
            loss = ce_loss + self.cfg.aux_loss_coef * aux_loss
        return ModelOutput(logits_BTV, loss, ce_loss, aux_loss, tokens_per_expert)

    def moe_modules(self) -> list[MoE]:
        return [layer.ffn for layer in self.layers if isinstance(layer.ffn, MoE)]
