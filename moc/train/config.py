"""A training run is one `TrainConfig`; the CLI overrides a few of its fields.

Presets (`--config`):
    tiny   a model that finishes 200 steps on 2 CPU ranks in about a minute (tests, demo)
    small  a model big enough for accuracy studies on CPU
    bench  expert state dominates (as in the paper: most bytes are expert optimizer
           state) and a full checkpoint is a few hundred MB, for checkpoint benchmarks
    gpu-400m, gpu-800m
           the two models measured on one H200 (387M and 773M parameters, 16 experts);
           a full checkpoint is 4.6 and 9.3 GB: sized for a GPU, far too large for the
           CPU machines of the test suite
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

from moc.model import ModelConfig

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "model": ModelConfig(seq_len=64, d_model=64, n_layers=2, n_heads=4, d_ffn=128,
                             n_experts=4, top_k=2),
        "batch_size": 8, "steps": 200, "lr": 3e-3, "warmup_steps": 20, "ckpt_interval": 50,
    },
    "small": {
        "model": ModelConfig(seq_len=128, d_model=128, n_layers=4, n_heads=4, d_ffn=256,
                             n_experts=8, top_k=2),
        "batch_size": 8, "steps": 1000, "lr": 1e-3, "warmup_steps": 50, "ckpt_interval": 100,
    },
    "bench": {
        # 16 experts x 4 MoE layers x (2 x 256 x 1024) = 33.5M expert parameters against
        # 1.2M dense ones: a full checkpoint (weights + AdamW moments) is ~420 MB, 96% of
        # it expert state, most of that expert optimizer state, as in the paper.
        "model": ModelConfig(seq_len=128, d_model=256, n_layers=4, n_heads=8, d_ffn=1024,
                             n_experts=16, top_k=2),
        "batch_size": 4, "steps": 100, "lr": 1e-3, "warmup_steps": 10, "ckpt_interval": 10,
    },
    "gpu-400m": {
        # 16 experts x 4 MoE layers x (2 x 1024 x 2816) = 369.1M expert parameters against
        # 17.9M dense ones (387.0M in all): a full checkpoint (weights + AdamW moments, 12
        # bytes a parameter) is 4.64 GB, 95% of it expert state. One H200 trains a step of
        # 32 x 512 tokens in tens of milliseconds, so a snapshot's device-to-host copy is
        # what bounds checkpointing there. lr below `bench`'s: ten times the parameters.
        "model": ModelConfig(seq_len=512, d_model=1024, n_layers=4, n_heads=16, d_ffn=2816,
                             n_experts=16, top_k=2),
        "batch_size": 32, "steps": 100, "lr": 3e-4, "warmup_steps": 10, "ckpt_interval": 10,
    },
    "gpu-800m": {
        # gpu-400m with 8 MoE layers: 738.2M expert + 34.8M dense = 772.9M parameters, a
        # full checkpoint of 9.28 GB.
        "model": ModelConfig(seq_len=512, d_model=1024, n_layers=8, n_heads=16, d_ffn=2816,
                             n_experts=16, top_k=2),
        "batch_size": 32, "steps": 100, "lr": 3e-4, "warmup_steps": 10, "ckpt_interval": 10,
    },
}

DCP_MODES = ("dcp-sync", "dcp-async")
"""The PyTorch DCP baselines (`moc.baselines.dcp`, imported only when one is chosen)."""
CKPT_MODES = ("none", "blocking", "pec", "moc", *DCP_MODES)
FAULT_KINDS = ("process", "node", "machine", "persist", "hang")
RECOVERIES = ("auto", "restart", "in-job")
DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class TrainConfig:
    preset: str = "tiny"
    """Name of the preset the model and defaults came from."""
    model: ModelConfig = field(default_factory=ModelConfig)
    steps: int = 200
    """Optimizer steps to train in total (a resumed run continues to this count)."""
    batch_size: int = 8
    """Sequences per rank per step; the global batch is batch_size * world size."""
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr * min_lr_ratio."""
    warmup_steps: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    ep: int | None = None
    """Expert-parallel degree; None picks the largest that divides both the number of
    ranks and the expert count."""
    data: str | None = None
    """Text file or directory; None uses the Python standard library's sources."""
    eval_batches: int = 8
    """Validation batches per rank for the final validation loss."""
    ckpt_dir: str | None = None
    ckpt_interval: int = 50
    ckpt_blocks: int = 0
    """A benchmark's A/B switch: with B > 0, checkpoints (every `ckpt_interval` steps)
    are taken only in every other block of B steps (steps B..2B-1, 3B..4B-1, ...), so
    one run holds steps with and without checkpointing side by side, under the same
    load of the host and the same phase of training (`moc bench overhead --paired`).
    0: every interval. The run's last step checkpoints either way."""
    ckpt_mode: str = "moc"
    """none; blocking (the Megatron-DeepSpeed baseline: every expert, rank 0 and EP group
    0 write, training waits); pec (partial experts checkpointing, sharded, synchronous);
    moc (pec + a complete snapshot in shared memory + a background persist process);
    dcp-sync and dcp-async (the PyTorch DCP baselines: dcp.save, and dcp.async_save with
    the process executor and DefaultStager; every expert, every checkpoint)."""
    persist_policy: str = "skip"
    """moc: when a checkpoint comes while the previous persist runs: skip or wait."""
    k_snapshot: int | str = "all"
    """moc: experts per MoE layer in the memory snapshot: an integer, all (exact
    recovery from a process crash) or auto (the largest whose copy hides behind a
    forward and backward pass, measured on the first three checkpoints)."""
    k_replica: int | str = "all"
    """moc across nodes: experts per MoE layer in each rank's peer replica: all, an
    integer, or none (no replicas)."""
    replica_jump: int = 1
    """moc across nodes: node i keeps the replicas of node i - jump."""
    replica_rate: float | None = None
    """moc across nodes: bytes/s each rank may send to its peer (None: unlimited)."""
    restore_prefer: str = "exact"
    """moc: a restore's choice between an older step exact on every rank and a newer one
    some rank has only a partial copy of (`TwoLevelCheckpointer(prefer=...)`)."""
    k_persist: int | None = 1
    """pec: experts saved per MoE layer per checkpoint; None saves all (K = N)."""
    selection: str = "sequential"
    """pec: sequential or load-aware."""
    pec_apply: str = "both"
    """pec: which expert state is partial: weights, optimizer or both."""
    dynamic_k: bool = False
    """pec: double K when a recovery's PLT exceeds plt_threshold."""
    plt_threshold: float = 0.0375
    shard: bool = True
    """pec: every rank writes an equal share (the sharded planner); False keeps the
    baseline placement (rank 0 and expert-parallel group 0 write) for comparison."""
    keep_last: int | None = None
    """Keep the newest N checkpoints (and every older step they still reference)."""
    metrics: str | None = None
    """JSON-lines file that rank 0 appends events to."""
    fault_at: int | None = None
    """Kill `fault_rank` with SIGKILL when it reaches this step (first attempt only)."""
    fault_every: int | None = None
    """Kill `fault_rank` with SIGKILL at every multiple of this many steps (the first
    attempt at step F, the restart after it at 2F, ...): a run with recurring faults."""
    fault_rank: int = 0
    fault_kind: str = "process"
    """process: SIGKILL the rank; node: also wipe this node's shared-memory snapshots;
    persist: SIGKILL rank 0's persist process (two-level mode only), the ranks live on."""
    fault_node: int | None = None
    """With fault_kind node: the node (torchrun's GROUP_RANK) to lose, all its ranks and
    its persist process at once; None loses fault_rank's node through fault_rank alone."""
    device: str = "cpu"
    """cpu (gloo) or cuda (NCCL; each rank on GPU LOCAL_RANK). The checkpoint engines
    take the state from wherever it is."""
    progress: bool = True
    """A progress bar with the ETA on rank 0 when stderr is a terminal (not under CI);
    False (`--no-progress`) keeps the plain line every 10%, as in a log."""
    grace_s: float = 30.0
    """On SIGTERM or SIGINT every rank stops at an agreed step boundary and takes a final
    complete checkpoint; if that is not durable this many seconds after the signal, the
    job exits anyway (what is durable stays so). A second signal exits at once."""
    recovery: str = "auto"
    """How a fault is recovered: "restart" (torchrun restarts every worker, up to
    --max-restarts), "in-job" (each rank's host replaces only the lost or hung
    process; the survivors keep theirs: moc.train.host), or "auto": in-job for more
    than one rank on cpu, restart for one and on cuda until in-job over NCCL has run on
    GPUs (see `resolve_recovery`)."""
    spares: int | None = None
    """in-job: standby processes per rank, imported and waiting (0 or 1). None: one on
    cuda, none on cpu (see `resolve_spares`)."""
    hang_timeout: float | None = None
    """in-job: seconds without a heartbeat, or without a step while not waiting for a
    peer, after which a rank is killed and replaced (None: from the step time)."""
    max_replacements: int = 100
    """in-job: processes a rank's host replaces before it gives up (then torchrun)."""
    resume_step: int | None = None
    """Roll back: resume from this complete step on storage instead of the newest, and
    set the newer steps aside (first attempt only: a restart after a fault resumes from
    the newest step of the rolled-back run)."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "ckpt_interval", "eval_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, "
                                 f"got {getattr(self, name)}")
        if self.warmup_steps < 0:
            raise ValueError(f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        if self.lr <= 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        if self.ckpt_mode not in CKPT_MODES:
            raise ValueError(f"--ckpt-mode must be one of {', '.join(CKPT_MODES)}, "
                             f"got {self.ckpt_mode!r}")
        if self.k_persist is not None and self.k_persist < 1:
            raise ValueError(f"--k-persist must be >= 1 or 'all', got {self.k_persist}")
        if self.ckpt_blocks < 0:
            raise ValueError(f"--ckpt-blocks must be >= 0 (0: no blocks), got {self.ckpt_blocks}")
        if self.keep_last is not None and self.keep_last < 1:
            raise ValueError(f"--keep-last must be >= 1, got {self.keep_last}")
        if self.ep is not None and self.ep < 1:
            raise ValueError(f"--ep must be >= 1, got {self.ep}")
        if self.fault_at is not None and not 1 <= self.fault_at <= self.steps:
            raise ValueError(f"--fault-at must be a step in 1..{self.steps}, got {self.fault_at}")
        if self.fault_every is not None and self.fault_every < 1:
            raise ValueError(f"--fault-every must be >= 1, got {self.fault_every}")
        if self.fault_every is not None and self.fault_at is not None:
            raise ValueError("--fault-at and --fault-every exclude each other: give one")
        if self.fault_kind not in FAULT_KINDS:
            raise ValueError(f"--fault-kind must be one of {', '.join(FAULT_KINDS)}, "
                             f"got {self.fault_kind!r}")
        if not (self.k_snapshot in ("all", "auto")
                or (isinstance(self.k_snapshot, int) and self.k_snapshot >= 1)):
            raise ValueError(f"--k-snapshot must be an integer >= 1, all or auto, "
                             f"got {self.k_snapshot!r}")
        if not (self.k_replica in ("all", "none")
                or (isinstance(self.k_replica, int) and self.k_replica >= 1)):
            raise ValueError(f"--k-replica must be an integer >= 1, all or none, "
                             f"got {self.k_replica!r}")
        if self.replica_jump < 1:
            raise ValueError(f"--replica-jump must be >= 1, got {self.replica_jump}")
        if self.replica_rate is not None and self.replica_rate <= 0:
            raise ValueError(f"--replica-rate must be > 0 bytes/s, got {self.replica_rate}")
        if self.persist_policy not in ("skip", "wait"):
            raise ValueError(f"--persist-policy must be skip or wait, got {self.persist_policy!r}")
        if self.fault_rank < 0:
            raise ValueError(f"--fault-rank must be >= 0, got {self.fault_rank}")
        if self.fault_kind == "persist" and (self.ckpt_mode != "moc" or self.fault_rank != 0):
            raise ValueError("--fault-kind persist kills rank 0's persist process: it needs "
                             f"--ckpt-mode moc and --fault-rank 0, got --ckpt-mode "
                             f"{self.ckpt_mode} --fault-rank {self.fault_rank}")

        if self.fault_node is not None and (self.fault_kind not in ("node", "machine")
                                            or self.fault_node < 0):
            raise ValueError(f"--fault-node {self.fault_node} loses a whole node: it needs "
                             f"--fault-kind node or machine (got {self.fault_kind}) and a "
                             "node index >= 0")
        if self.fault_kind == "machine" and (self.fault_node is None
                                             or self.recovery == "restart"):
            raise ValueError("--fault-kind machine loses a simulated machine, agent and "
                             "hosts included: it needs --fault-node J and --recovery in-job "
                             "(with --spare-nodes to take its place)")
        if not self.grace_s > 0:
            raise ValueError(f"--grace-s must be > 0 seconds, got {self.grace_s}")
        if self.recovery not in RECOVERIES:
            raise ValueError(f"--recovery must be one of {', '.join(RECOVERIES)}, got "
                             f"{self.recovery!r}")
        if self.spares not in (None, 0, 1):
            raise ValueError(f"--spares must be 0 or 1, got {self.spares}")
        if self.hang_timeout is not None and not self.hang_timeout > 0:
            raise ValueError(f"--hang-timeout must be > 0 seconds, got {self.hang_timeout}")
        if self.max_replacements < 0:
            raise ValueError(f"--max-replacements must be >= 0, got {self.max_replacements}")
        if self.recovery == "restart" and (self.spares or self.hang_timeout is not None):
            raise ValueError("--spares and --hang-timeout are for --recovery in-job (a "
                             "restart starts every process anew and detects no hang)")
        if self.fault_kind == "hang" and self.recovery == "restart":
            raise ValueError("--fault-kind hang stops a rank (SIGSTOP): only --recovery "
                             "in-job detects a hang; under restart the job would wait for "
                             "the collective timeout")
        if self.recovery == "in-job" and self.ckpt_mode in DCP_MODES:
            raise ValueError(f"--recovery in-job needs a moc engine (--ckpt-mode moc, pec, "
                             f"blocking or none), got {self.ckpt_mode}")
        if self.resume_step is not None and self.resume_step < 0:
            raise ValueError(f"--resume-step must be a step >= 0, got {self.resume_step}")
        if self.resume_step is not None and self.ckpt_dir is None:
            raise ValueError("--resume-step rolls a checkpoint directory back: give its "
                             "--ckpt-dir")
        if self.resume_step is not None and self.ckpt_mode in ("none", *DCP_MODES):
            raise ValueError(f"--resume-step rolls a moc checkpoint directory back; "
                             f"--ckpt-mode {self.ckpt_mode} cannot")
        if self.device not in DEVICES:
            raise ValueError(f"--device must be one of {', '.join(DEVICES)}, "
                             f"got {self.device!r}")

    def resolve_recovery(self, world: int) -> str:
        """The recovery a job of `world` ranks gets: the one asked for, or for "auto"
        in-job when there is more than one rank on cpu (a fault costs the lost rank
        only: the survivors keep their processes and memory) or when an option that
        only in-job has was given (spares, a hang timeout, a hang or machine fault: an
        explicit ask, on cuda too), and restart otherwise. On cuda in-job is opt-in
        until a run on two GPUs has shown it: a survivor's NCCL communicators are
        aborted and re-formed (`moc.injob.membership.Communicators`), which only gloo has run
        (`injob.nccl_note` says so when it runs). One rank gains nothing from a host:
        torchrun's restart is the same single replacement without the extra process.
        The DCP baselines restart."""
        if self.recovery != "auto":
            return self.recovery
        if self.spares or self.hang_timeout is not None or self.fault_kind in ("hang",
                                                                               "machine"):
            return "in-job"
        if self.device == "cuda":
            return "restart"
        return "in-job" if world > 1 and self.ckpt_mode not in DCP_MODES else "restart"

    def resolve_spares(self, recovery: str) -> int:
        """The standbys per rank: the number asked for, or, not given, one per rank under
        in-job recovery on cuda (asked for: "auto" restarts there) and none otherwise. A
        standby has imported torch and moc and loaded the data, and holds no CUDA context
        until it takes a rank's place, so on a GPU node it costs host memory only (measured
        on cpu: 295 MB private, plus 203 MB for its persist process) and cuts a fault's
        downtime to the rejoin (0.43-0.62 s against 3.7-4.7 s from a new process, on the
        project's VM); a new process on a GPU also pays CUDA's start-up. On cpu, where moc
        trains small models on a few cores, the standbys' start-up competes with the ranks'
        own: none by default."""
        if self.spares is not None:
            return self.spares
        return 1 if recovery == "in-job" and self.device == "cuda" else 0

    def for_world(self, world: int) -> TrainConfig:
        """This config with its recovery and spares resolved for `world` ranks
        (re-checked)."""
        recovery = self.resolve_recovery(world)
        return replace(self, recovery=recovery, spares=self.resolve_spares(recovery))

    @classmethod
    def from_preset(cls, preset: str, **overrides: Any) -> TrainConfig:
        if preset not in PRESETS:
            raise ValueError(f"--config must be one of {', '.join(PRESETS)}, got {preset!r}")
        known = {f.name for f in fields(cls)}
        unknown = set(overrides) - known
        if unknown:
            raise ValueError(f"unknown TrainConfig fields: {', '.join(sorted(unknown))}")
        # None means "not given" for the fields a preset sets; elsewhere it is a value
        # (k_persist=None: every expert).
        given = {k: v for k, v in overrides.items() if v is not None or k not in PRESETS[preset]}
        values = {**PRESETS[preset], **given}
        return cls(preset=preset, **values)

    def with_model(self, **changes: Any) -> TrainConfig:
        return replace(self, model=replace(self.model, **changes))

    def resolve_ep(self, world_size: int) -> int:
        if self.ep is not None:
            return self.ep
        return max(d for d in range(1, world_size + 1)
                   if world_size % d == 0 and self.model.n_experts % d == 0)

    def checkpoints_at(self, step: int) -> bool:
        """Whether step `step` (1-based) checkpoints: a multiple of the interval, and in a
        checkpointing block when `ckpt_blocks` is set (the last step is the loop's)."""
        return step % self.ckpt_interval == 0 and in_checkpoint_block(step, self.ckpt_blocks)

    def checkpoint_steps(self) -> list[int]:
        """The steps a run from step 0 to `steps` checkpoints (with a checkpointing
        mode): every `checkpoints_at` step and the last, which the loop always saves."""
        return [s for s in range(1, self.steps + 1)
                if self.checkpoints_at(s) or s == self.steps]

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step `step` (1-based): linear warmup, cosine decay."""
        if step <= self.warmup_steps:
            return self.lr * step / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * cosine)


def in_checkpoint_block(step: int, blocks: int) -> bool:
    """Whether `step` lies in a checkpointing block of `blocks` steps (the odd ones: the
    run starts with a block without checkpoints); always, when `blocks` is 0."""
    return not blocks or (step // blocks) % 2 == 1
