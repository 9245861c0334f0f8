"""What a training process builds that depends on the job, not on the step: the initial
model, the checkpoint engine of `--ckpt-mode`, the placement every rank agrees on, and
what a spare prepares while it waits.
Built at the start and again after an in-job recovery (new process groups, new engine;
the initial weights again when there was nothing to restore)."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from moc.baselines.blocking import MegatronPlacement, blocking_checkpointer
from moc.checkpoint.api import CheckpointEngine
from moc.checkpoint.dist import Dist
from moc.checkpoint.policy.selection import PECPolicy
from moc.checkpoint.sync import Checkpointer
from moc.checkpoint.twolevel.checkpointer import TwoLevelCheckpointer
from moc.checkpoint.twolevel.memory.nodes import node_memory_root
from moc.model import Transformer
from moc.parallel import ParallelGroups, ShardedAdamW, shard_experts
from moc.topology import node_rank, restart_count
from moc.train.config import DCP_MODES, TrainConfig
from moc.train.data import Corpus
from moc.train.metrics import MetricsWriter


def initial_model(cfg: TrainConfig, groups: ParallelGroups, device: torch.device
                  ) -> Transformer:
    """The model's initial weights, this rank's experts of them: built on the CPU from
    the seed, then moved, so that every rank and every start has the same weights (and
    torch's RNG the same state after them)."""
    torch.manual_seed(cfg.seed)
    model = Transformer(cfg.model)
    shard_experts(model, groups)
    return model.to(device)


def prepare_standby(cfg: TrainConfig) -> Corpus:
    """What a spare does while it waits (in-job recovery), so that none of it stands
    between a fault and the next step: the data loaded, and torch's deterministic
    mode set (its first call costs 0.7 s on the project's VM)."""
    torch.use_deterministic_algorithms(True)
    return Corpus.load(cfg.data, cfg.model.seq_len)


def make_engine(cfg: TrainConfig, model: nn.Module, optimizer: ShardedAdamW,
                groups: ParallelGroups) -> CheckpointEngine | None:
    """The engine of `--ckpt-mode` over `groups` (None: no checkpoints); the loop drives
    every one through the contract."""
    if cfg.ckpt_dir is None or cfg.ckpt_mode == "none":
        return None
    common: dict[str, Any] = {"groups": groups, "interval": cfg.ckpt_interval,
                              "keep_last": cfg.keep_last, "model_meta": cfg.model.to_dict()}
    if cfg.ckpt_mode == "moc":
        return TwoLevelCheckpointer(model, optimizer, cfg.ckpt_dir, policy=pec_policy(cfg),
                                    persist_policy=cfg.persist_policy,
                                    k_snapshot=cfg.k_snapshot, k_replica=cfg.k_replica,
                                    replica_jump=cfg.replica_jump,
                                    prefer=cfg.restore_prefer,
                                    replica_rate=cfg.replica_rate, **common)
    if cfg.ckpt_mode in DCP_MODES:
        # Imported here only: DCP's async API (DefaultStager, torch >= 2.9) is the
        # baseline's alone, and a moc run must start on a torch that lacks it.
        from moc.baselines.dcp import DCPCheckpointer

        return DCPCheckpointer(model, optimizer, cfg.ckpt_dir, mode=cfg.ckpt_mode, **common)
    if cfg.ckpt_mode == "blocking":
        return blocking_checkpointer(model, optimizer, cfg.ckpt_dir, **common)
    # pec; --no-shard keeps the baseline's placement (rank 0 and EP group 0 write)
    return Checkpointer(model, optimizer, cfg.ckpt_dir, policy=pec_policy(cfg),
                        mode=cfg.ckpt_mode,
                        placement=None if cfg.shard else MegatronPlacement(), **common)


def pec_policy(cfg: TrainConfig) -> PECPolicy:
    return PECPolicy(k=cfg.k_persist, selection=cfg.selection, apply_to=cfg.pec_apply,
                     dynamic_k=cfg.dynamic_k, plt_threshold=cfg.plt_threshold)


def agree_on_placement(groups: ParallelGroups, metrics: MetricsWriter, device: str,
                       generation: int = 0) -> tuple[int, list[int]]:
    """The job's attempt and every rank's process id, agreed by every rank; rank 0 logs
    where every rank runs: its node (GROUP_RANK), its node-local memory root (what a node
    fault wipes) and its process. Collective.

    The attempt is the largest of the agents' restart counts, plus the in-job
    `generation`: each agent counts only the failures of its own workers (one whose
    workers are still healthy when another node re-joins restarts them uncounted), and
    any restart after a fault has at least one agent counting it."""
    mine = {"node": node_rank(), "shm_root": str(node_memory_root()),
            "restart": restart_count(), "pid": os.getpid()}
    # moc's codec, never pickle (`all_gather_object`): docs/THREAT_MODEL.md.
    everyone = Dist(groups).all_gather(mine)
    attempt = max(r["restart"] for r in everyone) + generation
    pids = [r["pid"] for r in everyone]
    metrics.emit("placement", attempt=attempt, device=device,
                 nodes=[r["node"] for r in everyone],
                 restarts=[r["restart"] for r in everyone], generation=generation, pids=pids,
                 shm_roots=[r["shm_root"] for r in everyone])
    return attempt, pids
