"""moc for a torchtitan run: the whole training state, with torchtitan's own objects.

In a loop of your own (the objects torchtitan's Trainer builds, handed as they are):

    ckpt = TitanCheckpointer("ckpt/", model_parts=[model], optimizers=optimizers,
                             lr_schedulers=lr_schedulers, dataloader=dataloader,
                             policy=moc.PECPolicy(k=1), interval=10)
    step = ckpt.restore()                  # 0 on a fresh start
    while step < steps:
        loss = train_step(...)             # forward and backward
        ckpt.wait_for_snapshot()           # right before the optimizer step
        optimizers.step(); lr_schedulers.step(); optimizers.zero_grad()
        step += 1
        ckpt.maybe_save(step, final=step == steps)
    ckpt.close()

In torchtitan's own Trainer, with no code: `MocCheckpointManager`, a torchtitan
`BaseCheckpointManager` configured the torchtitan way (`checkpoint=MocCheckpointManager
.Config(enable=True, interval=10, k=1)` in the job config; docs/guide/torchtitan.md).
With in-job recovery, under `moc run` (a lost rank replaced, the others keep their
processes): `run(lambda gen: config.build())` instead of building and training it.

What is saved, and by whom:

    the model (one part)         moc: experts found by their structure (torchtitan
                                 0.3.0's `moe.routed_experts.inner_experts`, 0.2.x's
                                 `moe.experts`), K of them per checkpoint, FSDP2 + EP
                                 DTensors as they are; `expert_bias_E` (load balancing)
                                 as a persistent buffer
    the OptimizersContainer      moc: each of its inner optimizers, read through
                                 (`moc.checkpoint.optimizers`); never an empty state
    routed tokens (PLT)          moc: the routers' outputs, by forward hooks
    lr_schedulers, train_state   their `state_dict()`, in the checkpoint's loop state
    the dataloader               every data-parallel rank's `state_dict()`, gathered

The loop state is JSON (`extra_state`): a state dict travels as base64 of `torch.save`,
read back with `weights_only=True`. torchtitan's dataloader state holds its own pickled
bytes, which its `load_state_dict` unpickles, as it does from torchtitan's own
checkpoints: load only checkpoints you trust (docs/THREAT_MODEL.md).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torchtitan.components.checkpointer.base import BaseCheckpointManager

from moc.checkpoint.api import RecoveryReport
from moc.checkpoint.policy.selection import PECPolicy
from moc.checkpoint.routing import RoutingRecorder
from moc.checkpoint.shards import local
from moc.checkpoint.twolevel.checkpointer import TwoLevelCheckpointer
from moc.integrations.loopstate import decode_state, encode_state, gather_json

if TYPE_CHECKING:
    from moc.injob.loop import Generation

log = logging.getLogger(__name__)


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def one_model(model_parts: nn.Module | list[nn.Module]) -> nn.Module:
    """The model of a run without pipeline parallelism (torchtitan's `model_parts` holds
    one module then); several parts are refused in one line."""
    if isinstance(model_parts, nn.Module):
        return model_parts
    parts = list(model_parts)
    if len(parts) != 1:
        raise ValueError(f"moc checkpoints one model part per rank; this run has {len(parts)} "
                         "(pipeline parallelism), which moc does not support yet: train "
                         "without pipeline parallelism, or use torchtitan's CheckpointManager")
    return parts[0]


class TitanCheckpointer:
    """A torchtitan run's whole state through a moc engine (`TwoLevelCheckpointer` by
    default): the model and every optimizer of the container by moc, the LR schedulers,
    the dataloader's position on every data-parallel rank and any other `states`
    (torchtitan's `train_state`) in the checkpoint's loop state. The routers are
    watched for PLT and Dynamic-K from construction on.

    Every rank makes the same calls (save and restore are collective). `options` go to
    the engine (`k_snapshot`, `keep_last`, `persist_policy`, ...)."""

    def __init__(self, directory: str | Path, *, model_parts: nn.Module | list[nn.Module],
                 optimizers: object, lr_schedulers: Stateful | None = None,
                 dataloader: Stateful | None = None,
                 states: dict[str, Stateful] | None = None,
                 policy: PECPolicy | None = None, interval: int = 10,
                 engine: type = TwoLevelCheckpointer, **options: Any) -> None:
        self.model = one_model(model_parts)
        # The default group's device: NCCL gathers device tensors, gloo host ones.
        first = next(self.model.parameters(), None)
        self._device = local(first).device if first is not None else torch.device("cpu")
        self.lr_schedulers, self.dataloader = lr_schedulers, dataloader
        self.states = dict(states or {})
        bad = [n for n, s in self.states.items() if not callable(getattr(s, "state_dict", None))]
        if bad:
            raise TypeError(f"states {bad} have no state_dict(); pass objects with "
                            "state_dict() and load_state_dict() (torch's Stateful)")
        self.engine = engine(self.model, optimizers, directory, policy=policy,
                             interval=interval, **options)
        self.interval = interval
        self.report: RecoveryReport | None = None
        """The last restore's report (its source, PLT and lost tokens); None before."""
        self.recorder: RoutingRecorder | None = self.engine.watch_routing(self.model)
        self._owns_engine = True

    # -- the loop's calls -----------------------------------------------------------------

    def wait_for_snapshot(self) -> None:
        """Block until the state being checkpointed may change: right before
        `optimizers.step()` (torchtitan's `maybe_wait_for_staging`)."""
        self.engine.wait_for_snapshot()

    def save(self, step: int, *, final: bool = False) -> None:
        """Checkpoint `step` (collective: every rank gathers the dataloaders' states)."""
        self.engine.save(step, self.loop_state(), final=final)

    def maybe_save(self, step: int, *, final: bool = False) -> bool:
        """`save(step)` when `step` is a multiple of `interval` or `final`; whether it did."""
        if step % self.interval and not final:
            return False
        self.save(step, final=final)
        return True

    def restore(self, step: int | None = None) -> int:
        """Restore the newest checkpoint every rank can (or `step`, from storage), the
        loop state included; the step to continue after, 0 when there is none."""
        self.report = report = self.engine.restore(step)
        if report is None:
            return 0
        self.load_loop_state(report)
        return report.step

    def flush(self) -> None:
        self.engine.flush()

    def close(self) -> None:
        if self.recorder is not None:
            self.recorder.remove()
        if self._owns_engine:
            self.engine.close()

    def hand_over(self) -> TwoLevelCheckpointer:
        """The engine, which whoever takes it now closes (or abandons): `close` leaves
        it. In-job recovery's generation takes it (`run`), since it must abandon the
        engine when a peer is lost, after the process groups are dropped."""
        self._owns_engine = False
        return self.engine

    # -- the loop state -------------------------------------------------------------------

    def loop_state(self) -> dict[str, Any]:
        """What the engine keeps beside the model and optimizer, as JSON."""
        out: dict[str, Any] = {
            "states": {n: encode_state(s.state_dict()) for n, s in self.states.items()}}
        if self.lr_schedulers is not None:
            out["lr_schedulers"] = encode_state(self.lr_schedulers.state_dict())
        if self.dataloader is not None:
            # Each data-parallel rank reads its own samples: every rank's position.
            out["dataloader"] = gather_json(encode_state(self.dataloader.state_dict()),
                                            self._device)
        return out

    def load_loop_state(self, report: RecoveryReport) -> None:
        """Put back what `loop_state` saved at `report.step`. A state the checkpoint
        lacks for an object passed here is an error: it would resume from where the
        object stands now, silently."""
        extra = report.extra
        missing = [n for n in self.states if n not in extra.get("states", {})]
        if self.lr_schedulers is not None and "lr_schedulers" not in extra:
            missing.append("lr_schedulers")
        if self.dataloader is not None and "dataloader" not in extra:
            missing.append("dataloader")
        if missing:
            raise ValueError(f"the checkpoint of step {report.step} holds no state for "
                             f"{', '.join(missing)}: it was written without them; pass "
                             "None for those to restore the rest")
        if self.dataloader is not None:
            saved = extra["dataloader"]
            rank, world = _rank_world()
            if len(saved) != world:
                raise ValueError(
                    f"the checkpoint of step {report.step} holds the dataloader positions of "
                    f"{len(saved)} ranks, this run has {world}: each rank's samples "
                    "would differ; resume on as many ranks, or pass dataloader=None to "
                    "restore the rest")
            self.dataloader.load_state_dict(decode_state(saved[rank]))
        if self.lr_schedulers is not None:
            self.lr_schedulers.load_state_dict(decode_state(extra["lr_schedulers"]))
        for name, s in self.states.items():
            s.load_state_dict(decode_state(extra["states"][name]))


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class MocCheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpoint manager, done by moc: set the job config's `checkpoint` to
    `MocCheckpointManager.Config(enable=True, interval=..., k=...)` and torchtitan's
    Trainer builds it with the objects it builds (`config.checkpoint.build(...)`), saves
    after each step and restores at the start of `train()`, as with its own manager.

    From torchtitan's config it reads `enable`, `folder` (under the dump folder),
    `interval`, `keep_latest_k` (0: keep every checkpoint), `load_step`,
    `enable_first_step_checkpoint` and `load_only`. The options of DCP files
    (`initial_load_*`, `last_save_in_hf`, `create_seed_checkpoint`,
    `exclude_from_loading`) are refused in one line: they name torchtitan's format. The
    last checkpoint is complete (every expert), whatever `last_save_model_only` says: a
    model-only copy is `moc export`'s job."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        k: int | None = 1
        """Experts per MoE layer in each checkpoint (Partial Experts Checkpointing);
        None: all of them."""
        selection: str = "sequential"
        """Which K: "sequential" (round robin) or "load" (most tokens routed since saved)."""
        dynamic_k: bool = False
        """Raise K when the proportion of lost tokens passes `plt_threshold`."""
        plt_threshold: float = 0.0375
        k_snapshot: int | str | None = None
        """Experts per MoE layer in each snapshot to memory: None (all), an int, "auto"."""
        persist_policy: str = "skip"
        """A persist still running at the next checkpoint: "skip" it or "wait"."""

    def __init__(self, config: Config, *, dataloader: Stateful | None,
                 model_parts: list[nn.Module], optimizers: object,
                 lr_schedulers: Stateful | None, states: dict[str, Stateful],
                 sd_adapter: object = None, base_folder: str = "", **_: Any) -> None:
        self.enable = config.enable
        self.save_future = None
        if not self.enable:
            return
        unsupported = [n for n in ("initial_load_path", "initial_load_in_hf", "last_save_in_hf",
                                   "create_seed_checkpoint", "exclude_from_loading")
                       if getattr(config, n)]
        if unsupported:
            raise ValueError(f"MocCheckpointManager does not support {', '.join(unsupported)} "
                             "(options of torchtitan's DCP checkpoints); unset them, or use "
                             "torchtitan's CheckpointManager")
        self.config = config
        self.ckpt = TitanCheckpointer(
            os.path.join(base_folder, config.folder), model_parts=model_parts,
            optimizers=optimizers, lr_schedulers=lr_schedulers, dataloader=dataloader,
            states=states, interval=config.interval,
            policy=PECPolicy(k=config.k, selection=config.selection,
                             dynamic_k=config.dynamic_k, plt_threshold=config.plt_threshold),
            keep_last=config.keep_latest_k or None, k_snapshot=config.k_snapshot,
            persist_policy=config.persist_policy)

    def _load(self, step: int = -1) -> bool:
        return self.ckpt.restore(None if step == -1 else step) > 0

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if self.config.load_only:
            return False
        if curr_step == 1 and self.config.enable_first_step_checkpoint:
            self.ckpt.save(curr_step, final=last_step)
            return True
        return self.ckpt.maybe_save(curr_step, final=last_step)

    def _maybe_wait_for_staging(self) -> None:
        self.ckpt.wait_for_snapshot()

    def maybe_wait_for_saving(self) -> None:
        """Block until every save is durable. torchtitan's base waits only while its
        `save_future` is set; moc's saves run in its own background process and keep no
        such future, so the base would return at once, with a save still in flight."""
        if self.enable:
            self.ckpt.flush()

    def _wait_for_saving(self) -> None:
        self.ckpt.flush()

    def _close(self) -> None:
        self.ckpt.close()


T = TypeVar("T")


def run(build: Callable[[Generation], T]) -> T:
    """torchtitan's Trainer with in-job recovery, under `moc run` (its rank hosts):

        trainer = moc.integrations.torchtitan.run(lambda gen: config.build())

    In each generation of the job, `build(gen)` makes the Trainer: torchtitan's
    `init_distributed` finds the generation's process group formed and keeps it, and
    the model is parallelised over it. Its `MocCheckpointManager`'s engine is handed to
    the generation (`Generation.own`), `train()` runs, and the Trainer is closed. When a
    peer is lost, the survivors keep their processes: the Trainer of the lost
    generation is dropped (its process groups are gone, and FSDP's and EP's meshes with
    them), its engine abandoned (its snapshots stay in memory), and the next
    generation's Trainer restores from them. Returns the last Trainer, trained.

    Without a rank host (plain torchrun) it trains once, as `moc.run` does."""
    from moc.injob.loop import run as run_in_job

    def train(gen: Generation) -> T:
        trainer = build(gen)
        manager = getattr(trainer, "checkpointer", None)
        if not (isinstance(manager, MocCheckpointManager) and manager.enable):
            raise ValueError(
                "moc.integrations.torchtitan.run needs the Trainer's checkpointer to be "
                "moc's: checkpoint=MocCheckpointManager.Config(enable=True, ...) in the "
                f"job config (got {type(manager).__name__})")
        gen.own(manager.ckpt.hand_over())
        trainer.train()  # type: ignore[attr-defined]
        trainer.close()  # type: ignore[attr-defined]
        return trainer

    return run_in_job(train)
