"""A real torchtitan MoE training setup on CPU ranks (gloo), built from torchtitan's own
objects, for tests and examples that checkpoint a torchtitan run.

    run = build(seed=0)          # under torchrun, or in a plain process (then 1 rank)
    for _ in range(5):
        print(run.step())

What it builds, and the torchtitan piece behind each part:

- model: Qwen3 ``debugmodel_moe`` (``torchtitan.models.qwen3``), shrunk: ``layers`` MoE
  layers (every layer MoE), width ``dim``, ``experts`` routed experts, ``top_k``, vocab 512,
  sequence 32; parallelised by the model spec's own ``parallelize_qwen3``: EP over
  ``ep`` ranks (default the world size) and FSDP2 over the data-parallel ranks.
- optimizers: ``OptimizersContainer`` from ``default_adamw``; the spec's
  ``post_optimizer_build_fn`` (``register_moe_load_balancing_hook``) moves ``expert_bias_E``.
- lr_schedulers: ``LRSchedulersContainer`` (linear warmup, then linear decay).
- dataloader: torchtitan's ``ParallelAwareDataloader`` (a torchdata
  ``StatefulDataLoader``) over a synthetic token dataset (torchtitan's text loaders need
  ``datasets``, a tokenizer and data files; nothing here downloads anything).
- loss: torchtitan's ``CrossEntropyLoss`` (sum over tokens / global token count).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torchtitan.distributed.parallel_dims as tt_parallel_dims
import torchtitan.distributed.utils as tt_dist_utils
import torchtitan.tools.utils as tt_tools_utils
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.loss import IGNORE_INDEX, CrossEntropyLoss
from torchtitan.components.optimizer import (
    LRSchedulersContainer,
    OptimizersContainer,
    default_adamw,
)
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_moe_layers, model_registry
from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

import moc

VOCAB, SEQ_LEN, BATCH, HEAD_DIM = 512, 32, 2, 16


class SyntheticTokens(IterableDataset, Stateful):
    """Endless token sequences, sample ``k`` of data-parallel rank ``r`` a pure function of
    ``(seed, r, k)``: the state is one integer, so a restored dataloader replays the same
    batches. Each sequence walks a fixed random cycle through an eighth of the vocabulary
    from a random start (next token = perm[token]): learnable (first which tokens occur,
    then which follows which), so the loss falls within a few steps."""

    def __init__(self, seed: int, dp_rank: int, vocab: int, seq_len: int) -> None:
        self.seed, self.dp_rank, self.seq_len = seed, dp_rank, seq_len
        used = np.random.default_rng([seed]).permutation(vocab)[: max(2, vocab // 8)]
        self.perm = dict(zip(used.tolist(), np.roll(used, 1).tolist(), strict=True))
        self.used = used.tolist()
        self.sample_idx = 0

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            rng = np.random.default_rng([self.seed, self.dp_rank, self.sample_idx])
            tokens = [self.used[int(rng.integers(len(self.used)))]]
            for _ in range(self.seq_len):
                tokens.append(self.perm[tokens[-1]])
            t = torch.tensor(tokens, dtype=torch.long)
            self.sample_idx += 1
            yield {"input": t[:-1]}, t[1:]

    def state_dict(self) -> dict[str, Any]:
        return {"sample_idx": self.sample_idx}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.sample_idx = int(state_dict["sample_idx"])


@dataclass
class TitanRun:
    """Everything a training loop (and a checkpointer) touches; ``step()`` is one step."""

    model: nn.Module
    optimizers: OptimizersContainer
    lr_schedulers: LRSchedulersContainer
    dataloader: ParallelAwareDataloader
    parallel_dims: ParallelDims
    loss_fn: CrossEntropyLoss
    max_norm: float = 1.0
    _batches: Iterator[Any] | None = field(default=None, repr=False)

    def _next_batch(self) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        # A StatefulDataLoader applies load_state_dict() to the *next* iterator it makes and
        # drops its current one; follow it, or a restored state would be ignored.
        if self._batches is None or self._batches is not self.dataloader._iterator:
            self._batches = iter(self.dataloader)
        return next(self._batches)

    def step(self) -> float:
        """One training step, as torchtitan's Trainer.train_step does it (one microbatch).
        Returns the global mean token loss (the same float on every rank)."""
        pd = self.parallel_dims
        input_dict, labels = self._next_batch()
        loss_mesh = pd.get_optional_mesh("loss")
        # Sum-of-token losses over the global token count; FSDP's own gradient division is
        # off (torchtitan sets factor 1), so the summed gradients are those of the mean.
        global_tokens = tt_dist_utils.dist_sum_tensor((labels != IGNORE_INDEX).sum(), loss_mesh)
        pred = self.model(input_dict["input"])
        loss, _ = self.loss_fn(pred, labels, global_tokens)
        loss.backward()
        tt_dist_utils.clip_grad_norm_(list(self.model.parameters()), self.max_norm,
                                      foreach=True, ep_enabled=pd.ep_enabled)
        self.optimizers.step()  # the load-balancing pre-hook updates expert_bias_E here
        self.lr_schedulers.step()
        self.optimizers.zero_grad()
        return float(tt_dist_utils.dist_sum(loss.detach(), loss_mesh))


def _use_cpu_device() -> None:
    """torchtitan picks its device type once, at import, falling back to "cuda" when no
    accelerator is present; DeviceMesh would then ask for CUDA. Point the copies that mesh
    building and the distributed helpers read at the CPU."""
    for module in (tt_tools_utils, tt_parallel_dims, tt_dist_utils):
        module.device_type = "cpu"


def _init_process_group() -> int:
    """Join the caller's group if there is one (torchrun + gloo); otherwise start gloo
    from torchrun's environment, or, in a plain ``python`` process, a one-rank group on an
    in-memory store (no address or port to pick)."""
    if not dist.is_initialized():
        if "RANK" in os.environ:
            # Not dist.init_process_group: after a torchrun restart it reads the addresses
            # its dead predecessors published in torchrun's store ("connectFullMesh
            # failed ... Connection refused"); moc's namespaces the store by restart.
            moc.init_distributed("gloo")
        else:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_world_size()


def model_config(*, layers: int, dim: int, experts: int, top_k: int, ep: int,
                 fuse_qkv: bool = False) -> Qwen3Model.Config:
    """Qwen3 ``debugmodel_moe`` at a CPU size: its own layer builder and init recipe, fewer
    and narrower layers (heads of 16), ``experts`` routed experts of hidden size 2*dim.

    ``fuse_qkv`` False (debugmodel_moe: True) gives separate ``wq``/``wk``/``wv``
    parameters. Fused, the parameter is ``wqkv`` but ``state_dict()`` splits it into
    ``wq``/``wk``/``wv`` in a post-hook that all-gathers it (a collective, and keys that
    differ from ``named_parameters()``)."""
    ref = model_registry("debugmodel_moe").model
    rope = dataclasses.replace(ref.layers[0].attention.rope, dim=HEAD_DIM, max_seq_len=SEQ_LEN)
    cfg = dataclasses.replace(
        ref, vocab_size=VOCAB, dim=dim,
        norm=dataclasses.replace(ref.norm, normalized_shape=dim),
        tok_embeddings=dataclasses.replace(ref.tok_embeddings, num_embeddings=VOCAB,
                                           embedding_dim=dim),
        lm_head=dataclasses.replace(ref.lm_head, in_features=dim, out_features=VOCAB),
        layers=_build_qwen3_moe_layers(
            n_layers=layers, dim=dim, n_heads=dim // HEAD_DIM,
            n_kv_heads=max(1, dim // (2 * HEAD_DIM)), head_dim=HEAD_DIM, moe_hidden_dim=2 * dim,
            num_experts=experts, top_k=top_k, fuse_qkv=fuse_qkv, rope=rope,
            attn_backend="flex", moe_comm_backend="standard"))
    for layer in cfg.layers:
        # FlexAttention has no backward on the CPU; causal SDPA (no document masks: our
        # sequences are one document each), as torchtitan's graph_trainer tests do.
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    # What Qwen3Model.Config.update_from_config does; that method imports
    # torchtitan.trainer, which needs tensorboard.
    set_qwen3_sharding_config(cfg, enable_sp=False, enable_ep=ep > 1)
    return cfg


def build(seed: int = 0, *, ep: int | None = None, layers: int = 2, dim: int = 64,
          experts: int = 8, top_k: int = 2, lr: float = 3e-3, warmup_steps: int = 2,
          total_steps: int = 1000, fuse_qkv: bool = False) -> TitanRun:
    """The whole run on this rank. ``ep`` defaults to the world size (1: no EP); it must
    divide both the world size and ``experts``. Identical on every call with the same
    arguments and world size: the losses of two runs are bitwise equal."""
    _use_cpu_device()
    world = _init_process_group()
    ep = world if ep is None else ep
    if world % ep or experts % ep:
        raise ValueError(f"ep={ep} must divide the world size {world} and experts {experts}")
    if dim % HEAD_DIM:
        raise ValueError(f"dim={dim} must be a multiple of the head size {HEAD_DIM}")
    # partial_dtensor: DTensors only on the model-parallel axes (EP here), FSDP2 on top.
    # The default spmd_types backend fails inside torchtitan's FSDP call on torch 2.13.
    parallelism = ParallelismConfig(spmd_backend="partial_dtensor", expert_parallel_degree=ep)
    tt_dist_utils.set_spmd_backend(parallelism.spmd_backend)
    parallel_dims = ParallelDims.from_config(parallelism, world)
    parallel_dims.build_mesh()

    spec = model_registry("debugmodel_moe")
    cfg = model_config(layers=layers, dim=dim, experts=experts, top_k=top_k, ep=ep,
                       fuse_qkv=fuse_qkv)
    # Full weights, initialised identically on every rank, then sharded. The Trainer's way
    # (meta device, shard, init_weights on the shards) needs DTensor's RNG tracker, which
    # needs a CUDA-like device (is_rng_supported_mesh is False on the CPU): each rank would
    # draw its shard from the same local RNG state. This way every world size and EP
    # degree starts from the same weights.
    torch.manual_seed(seed)
    model = cfg.build()
    with torch.no_grad():
        model.init_weights()
    model.verify_module_protocol()
    model = spec.parallelize_fn(
        model, parallel_dims=parallel_dims,
        training=TrainingConfig(local_batch_size=BATCH, seq_len=SEQ_LEN,
                                mixed_precision_param="float32"),
        parallelism=parallelism, compile_config=CompileConfig(), ac_config=None,
        dump_folder="")
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # torchtitan turns FSDP's gradient division off (factor 1), which FSDP then
            # reduce-scatters with PREMUL_SUM; gloo has none. A plain SUM is the same here.
            module.set_force_sum_reduction_for_comms(True)
    model.train()

    optimizers = default_adamw(lr=lr).build(model_parts=[model])  # fused AdamW runs on CPU
    spec.post_optimizer_build_fn(optimizers, [model], parallel_dims)
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=warmup_steps).build(
        optimizers=optimizers, training_steps=total_steps)

    if parallel_dims.dp_enabled:
        batch_mesh = parallel_dims.get_mesh("batch")
        dp_rank, dp_world = batch_mesh.get_local_rank(), batch_mesh.size()
    else:
        dp_rank, dp_world = 0, 1
    dataloader = ParallelAwareDataloader(SyntheticTokens(seed, dp_rank, VOCAB, SEQ_LEN),
                                         dp_rank=dp_rank, dp_world_size=dp_world,
                                         batch_size=BATCH)
    loss_fn = CrossEntropyLoss.Config(global_vocab_size=VOCAB).build(
        compile_config=CompileConfig())
    return TitanRun(model, optimizers, lr_schedulers, dataloader, parallel_dims, loss_fn)
