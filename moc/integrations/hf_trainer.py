"""moc inside `transformers.Trainer`: two-level checkpoints every N steps, and a restart
that resumes from moc's newest checkpoint with all of Trainer's state.

    from moc.integrations.hf_trainer import MocArguments, MocTrainer

    trainer = MocTrainer(model=model, args=TrainingArguments(...), train_dataset=data,
                         moc=MocArguments(interval=5, policy=moc.PECPolicy(k=1)))
    trainer.train()     # the same command again resumes: memory, a peer's replica, storage
    trainer.recovery    # the moc.RecoveryReport of that resume (None: a fresh start)

A Trainer of your own (TRL's SFTTrainer, a subclass): `class MyTrainer(MocTrainerMixin,
SFTTrainer)`, and pass `moc=MocArguments(...)` to its constructor.

What a resume restores: the model and the optimizer (moc, in place, before Trainer wraps
them), the lr scheduler and the gradient scaler, every rank's RNGs (torch's by moc,
python's, numpy's and CUDA's from `loopstate`), Trainer's state (global step, epoch, log
history, the stateful callbacks) and so the data position: Trainer skips the batches the
restored step consumed, gradient accumulation included, as it does for its own
checkpoints.

Why a mixin and not a `TrainerCallback` (docs/DECISIONS.md, "Trainer and Accelerate"):
Trainer resumes only from a directory given to `train(resume_from_checkpoint=...)`. It
reads the global step from it in `_init_training_state`, decides there how many batches
to skip, and loads the optimizer and scheduler after creating them. A callback's first
call (`on_train_begin`) comes after all of that, too late to change the data position.
So the mixin restores moc's checkpoint before `Trainer.train` starts, hands Trainer a
directory holding only `trainer_state.json` (its state at that step), and overrides the
four loaders Trainer calls on that directory (`_load_from_checkpoint`,
`_load_optimizer_and_scheduler`, `_load_scaler`, `_load_rng_state`) to take the rest
from moc instead of from files. It saves where Trainer saves its own checkpoints: after
the step's log (`_maybe_log_save_evaluate`), so the log history holds that step.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moc.checkpoint.api import CheckpointEngine, CheckpointResult, RecoveryReport
from moc.checkpoint.policy.selection import PECPolicy
from moc.checkpoint.spec import ExpertSpec
from moc.checkpoint.twolevel.checkpointer import TwoLevelCheckpointer
from moc.integrations.loopstate import (
    check_rng,
    check_same,
    decode_state,
    encode_state,
    gather_json,
    gather_rng,
    rng_of,
    set_rng,
)

log = logging.getLogger(__name__)
STATE_FILE = "trainer_state.json"  # transformers.trainer.TRAINER_STATE_NAME


@dataclass
class MocArguments:
    """How moc checkpoints a Trainer.

    `dir`: moc's checkpoint directory (default: `<output_dir>/moc`). `interval`: optimizer
    steps between checkpoints (default: Trainer's `save_steps`, when `save_strategy` is
    "steps"). `policy`: experts persisted per checkpoint (default `PECPolicy(k=1)`: one
    per MoE layer; the memory snapshot holds them all). `experts`: which parameters are
    experts (default `ExpertSpec.infer`). `watch_routing`: count routed tokens for PLT
    and Dynamic-K by hooks (the families `watch_routing` knows). `engine_options`: any
    other argument of `moc.TwoLevelCheckpointer` (`k_snapshot`, `persist_policy`,
    `max_failures`, `job`, ...).

    `engine`: an engine made and owned by another (`moc.run`'s `gen.engine`, for in-job
    recovery under `moc run`): the Trainer saves to it and restores from it, and
    neither builds nor closes nor abandons it, so that on a lost peer its owner lets
    go of it after the process groups are dropped. It saves the model and optimizer it
    was built over: give Trainer that optimizer (`optimizers=(optimizer, None)`).
    `dir`, `interval`, `policy`, `keep_last`, `experts` and `engine_options` are then
    the engine's own, not these."""

    dir: str | Path | None = None
    interval: int | None = None
    policy: PECPolicy | None = field(default_factory=lambda: PECPolicy(k=1))
    keep_last: int | None = 2
    experts: ExpertSpec | None = None
    watch_routing: bool = True
    engine_options: dict[str, Any] = field(default_factory=dict)
    engine: CheckpointEngine | None = None


class MocTrainerMixin:
    """Put before a `transformers.Trainer` class: moc's checkpoints, and resumes from
    them (module docstring). Takes `moc=MocArguments(...)` beside Trainer's arguments.

    Trainer's own checkpointing (`save_strategy`) may stay on, for `load_best_model_at_end`
    or an export: the two live side by side, in different directories. A restart takes
    moc's newest checkpoint; `train(resume_from_checkpoint=PATH)` takes Trainer's
    checkpoint at PATH instead, and is refused when moc's directory already holds one (the
    two runs would fork)."""

    def __init__(self, *args: Any, moc: MocArguments | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.moc = moc or MocArguments()
        self.checkpointer: TwoLevelCheckpointer | None = None
        """The engine of the current `train()` call (None outside it)."""
        self.recovery: RecoveryReport | None = None
        """What the last `train()` resumed from (None: a fresh start)."""
        self.checkpoint_results: list[CheckpointResult] = []
        """Every checkpoint's result, once final, in the order they finished."""
        self._resume: _Resume | None = None
        self._saved_step: int | None = None
        self._deferred: int | None = None  # a due step whose save waits for Trainer's 2nd call

    # -- train ----------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any,
              **kwargs: Any) -> Any:
        """`Trainer.train`, with moc's engine around it: built and restored first (a
        resume hands Trainer moc's state), finished and closed last (the final step
        durable on storage)."""
        args_ = self.args
        _check_arguments(self)
        directory = Path(self.moc.dir or os.path.join(args_.output_dir, "moc"))
        interval = _interval(self.moc, args_)
        owned = self.moc.engine is None  # else its owner's to close or abandon
        if not owned and self.optimizer is None:
            raise ValueError("MocArguments(engine=...) saves the optimizer the engine was "
                             "built with: give Trainer that one, optimizers=(optimizer, None)")
        if self.optimizer is None:
            self.create_optimizer()  # moc restores into it; Trainer's prepare keeps it
        self.checkpointer = engine = self.moc.engine or TwoLevelCheckpointer(
            self.model, self.optimizer, directory,
            experts=self.moc.experts or ExpertSpec.infer(self.model), policy=self.moc.policy,
            interval=interval, keep_last=self.moc.keep_last, **self.moc.engine_options)
        self._saved_step = self._deferred = None
        routing = None
        try:
            report = engine.restore()
            self.recovery = report
            if report is not None and isinstance(resume_from_checkpoint, str):
                raise ValueError(
                    f"train(resume_from_checkpoint={resume_from_checkpoint!r}) asks for "
                    f"Trainer's checkpoint, but moc's directory {directory} already holds "
                    f"step {report.step} of this run: pass resume_from_checkpoint=None to "
                    "resume from moc, or give moc another directory (MocArguments.dir)")
            if report is not None:
                self._resume = _agreed(lambda: _Resume.from_report(report, self, directory),
                                       args_.device)
                self._saved_step = report.step
                resume_from_checkpoint = self._resume.dir
                log.warning("moc: resumed from step %d (%s) in %.2f s", report.step,
                            report.source, report.recovery_s)
                if 0 < args_.max_steps <= report.step:
                    # Finished: Trainer would re-enter the last epoch when max_steps does
                    # not end one, and train a step past it.
                    return self._already_done(report.step, close=owned)
            elif resume_from_checkpoint is True and not _trainer_checkpoint(args_):
                resume_from_checkpoint = None  # nothing to resume: a fresh start
            routing = engine.watch_routing(self.model) if self.moc.watch_routing else None
            out = super().train(resume_from_checkpoint, *args, **kwargs)
            self._moc_finish(close=owned)
            return out
        except BaseException:
            if owned and args_.world_size == 1:  # alone, closing waits for no peer
                _close_quietly(engine)
            raise  # several ranks: the snapshots stay in memory for the restart
        finally:
            if routing is not None:
                routing.remove()
            if self._resume is not None:
                self._resume.cleanup()
                self._resume = None
            self.checkpointer = None

    def _already_done(self, step: int, close: bool) -> Any:
        """A run resumed at or past `max_steps`: nothing to train; Trainer's state as saved."""
        from transformers import TrainerState
        from transformers.trainer_utils import TrainOutput

        assert self._resume is not None
        self.state = TrainerState(**json.loads(self._resume.saved["state"]))
        log.warning("moc: step %d is at or past max_steps=%d: nothing to train", step,
                    self.args.max_steps)
        self._moc_finish(close)
        return TrainOutput(step, 0.0, {})

    def _moc_finish(self, close: bool) -> None:
        """The last step saved (if the run stopped between checkpoints), everything in
        flight durable, the engine closed when it is this Trainer's (`close`); results
        kept in `checkpoint_results`."""
        engine = self.checkpointer
        assert engine is not None
        step = self.state.global_step
        if step > 0 and step != self._saved_step:
            engine.save(step, self._loop_state(), final=True)
        engine.flush()
        self.checkpoint_results += engine.drain_completed()
        if close:
            engine.close()

    # -- saving ---------------------------------------------------------------------------

    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
        """Trainer's log, evaluation and own save, then moc's checkpoint when one is due
        (here Trainer's state holds the step's log, as in its own checkpoints).

        Trainer calls this twice at an epoch's last step and at the run's last step (an
        early stop included): after the step, and after `on_epoch_end`, where an epoch's
        evaluation, its log and Trainer's own epoch save happen (and the evaluation's
        dataloader draws from the RNG). A checkpoint due there waits for that second
        call, so that it holds all of it."""
        super()._maybe_log_save_evaluate(*args, **kwargs)
        engine, step = self.checkpointer, self.state.global_step
        if engine is None or step == self._saved_step:
            return
        final = step >= self.state.max_steps or self.control.should_training_stop
        if step % engine.interval and not final:
            return  # no work on ordinary steps
        ends_epoch = self.state.epoch is not None and float(self.state.epoch).is_integer()
        if (final or ends_epoch) and self._deferred != step:
            self._deferred = step
            return
        engine.save(step, self._loop_state(), final=final)
        self._saved_step = step
        if engine.pending:
            self.checkpoint_results += engine.drain_completed()

    def _loop_state(self) -> dict[str, Any]:
        """Everything of Trainer's a resume needs and moc's engine does not save itself,
        as `extra_state` (collective: the RNGs of every rank are gathered)."""
        from transformers.trainer_callback import ExportableState

        # The stateful callbacks as they are now, one entry per instance (as TrainerState
        # builds them; Trainer's own save appends to a list at every save instead).
        states: dict[str, Any] = {}
        for cb in [*self.callback_handler.callbacks, self.control]:
            if isinstance(cb, ExportableState):
                name = type(cb).__name__
                if name in states:
                    if not isinstance(states[name], list):
                        states[name] = [states[name]]
                    states[name].append(cb.state())
                else:
                    states[name] = cb.state()
        self.state.stateful_callbacks = states
        scaler = getattr(self.accelerator, "scaler", None)
        return {"trainer": {
            "state": json.dumps(dataclasses.asdict(self.state), sort_keys=True),
            "data": _data_layout(self),
            "scheduler": (encode_state(self.lr_scheduler.state_dict())
                          if self.lr_scheduler is not None else None),
            "scaler": encode_state(scaler.state_dict()) if scaler is not None else None,
            "rng": gather_rng(self.args.device)}}

    # -- Trainer's loaders, on the directory a moc resume hands it ---------------------

    def _moc_resumed(self, checkpoint: object) -> bool:
        return self._resume is not None and checkpoint == self._resume.dir

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if not self._moc_resumed(resume_from_checkpoint):
            super()._load_from_checkpoint(resume_from_checkpoint, model)
        # else: moc restored the model in place before Trainer started

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if not self._moc_resumed(checkpoint):
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        assert self._resume is not None
        self._resume.load_scheduler(self.optimizer, self.lr_scheduler)

    def _load_scaler(self, checkpoint: str | None) -> None:
        if not self._moc_resumed(checkpoint):
            super()._load_scaler(checkpoint)
            return
        assert self._resume is not None
        self._resume.load_scaler(getattr(self.accelerator, "scaler", None))

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if not self._moc_resumed(checkpoint):
            super()._load_rng_state(checkpoint)
            return
        assert self._resume is not None
        self._resume.load_rng(self.args.process_index)


def _make_trainer_class() -> type:
    from transformers import Trainer

    class MocTrainer(MocTrainerMixin, Trainer):
        """`transformers.Trainer` with moc's checkpoints (`MocTrainerMixin`)."""

    MocTrainer.__module__ = __name__
    return MocTrainer


def __getattr__(name: str) -> Any:
    """`MocTrainer`, built on first use: importing this module needs no transformers."""
    if name == "MocTrainer":
        cls = _make_trainer_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass
class _Resume:
    """What a moc resume hands Trainer: a directory with its state at the restored step,
    and what its loaders take from moc instead of files."""

    dir: str
    step: int
    groups: list[dict[str, Any]]
    """The optimizer's param groups as moc restored them, less their params: Trainer's
    scheduler, built after the restore, resets each group's lr to the schedule's start."""
    torch_rng: torch.Tensor
    saved: dict[str, Any]

    @classmethod
    def from_report(cls, report: RecoveryReport, trainer: Any, where: Path) -> _Resume:
        saved = report.extra.get("trainer")
        if saved is None:
            raise ValueError(f"moc's checkpoint of step {report.step} in {where} was not "
                             "written by MocTrainer (no Trainer state in it): resume it with "
                             "the loop that wrote it, or give MocArguments another dir")
        check_same(saved["data"], _data_layout(trainer), report.step, str(where),
                   "resume with the settings that saved it, or start a new run in another "
                   "directory (MocArguments.dir)")
        state = json.loads(saved["state"])
        if state.get("global_step") != report.step:
            raise ValueError(f"moc's checkpoint of step {report.step} in {where} holds "
                             f"Trainer's state of step {state.get('global_step')}: it was "
                             "not written by MocTrainer's save")
        # Rank 0's state, as every rank's (Trainer's own resume does the same); which
        # process this is stays this process's.
        state["is_world_process_zero"] = trainer.is_world_process_zero()
        state["is_local_process_zero"] = trainer.is_local_process_zero()
        check_rng(rng_of(saved["rng"], trainer.args.process_index))
        directory = tempfile.mkdtemp(prefix="moc-trainer-resume-")
        Path(directory, STATE_FILE).write_text(json.dumps(state))
        groups = [{k: v for k, v in g.items() if k != "params"}
                  for g in trainer.optimizer.param_groups]
        return cls(directory, report.step, groups, torch.get_rng_state(), saved)

    def load_scheduler(self, optimizer: Any, scheduler: Any) -> None:
        if self.saved["scheduler"] is not None and scheduler is not None:
            scheduler.load_state_dict(decode_state(self.saved["scheduler"]))
        for group, restored in zip(optimizer.param_groups, self.groups, strict=True):
            group.update(restored)

    def load_scaler(self, scaler: Any) -> None:
        if self.saved["scaler"] is not None and scaler is not None:
            scaler.load_state_dict(decode_state(self.saved["scaler"]))

    def load_rng(self, rank: int) -> None:
        torch.set_rng_state(self.torch_rng)
        set_rng(rng_of(self.saved["rng"], rank))

    def cleanup(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def _data_layout(trainer: Any) -> dict[str, Any]:
    """What fixes which samples a global step has consumed: a resume with other values
    would skip to the wrong batch."""
    args = trainer.args
    try:
        samples = len(trainer.train_dataset)
    except TypeError:  # an iterable dataset: Trainer skips by batches, as recorded
        samples = None
    return {"world_size": args.world_size,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "train_batch_size": trainer._train_batch_size,
            "dataset_samples": samples, "seed": args.seed, "data_seed": args.data_seed}


def _check_arguments(trainer: Any) -> None:
    """Refuse what moc cannot resume exactly, before anything is built."""
    args = trainer.args
    if trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
        raise ValueError("MocTrainer checkpoints DDP and single-process training; with "
                         "FSDP or DeepSpeed, use moc.TwoLevelCheckpointer in your own loop "
                         "(examples/train_fsdp2_ep.py)")
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world != args.world_size:
        raise ValueError(f"torch.distributed has {world} ranks but Trainer trains on "
                         f"{args.world_size} ({args.parallel_mode}): each rank would train "
                         "alone; on the CPU, TrainingArguments(use_cpu=True) makes Trainer "
                         "use DDP over gloo")
    if trainer.model_init is not None:
        raise ValueError("MocTrainer restores into the model it was given; model_init (and "
                         "hyperparameter search) would build another after the restore: "
                         "pass model= instead")
    if args.auto_find_batch_size:
        raise ValueError("MocTrainer keeps the batch size fixed, since the data position "
                         "depends on it; auto_find_batch_size=True may change it on a retry: "
                         "set per_device_train_batch_size and auto_find_batch_size=False")
    if args.ignore_data_skip:
        raise ValueError("MocTrainer resumes the data position; ignore_data_skip=True would "
                         "train the resumed epoch's first batches again: set it to False")


def _interval(moc: MocArguments, args: Any) -> int:
    """moc's interval: `MocArguments.interval`, else Trainer's `save_steps` when it saves
    every N steps."""
    if moc.interval is not None:
        if isinstance(moc.interval, bool) or not isinstance(moc.interval, int) \
                or moc.interval < 1:
            raise ValueError(f"MocArguments.interval must be an int >= 1, got {moc.interval!r}")
        return moc.interval
    strategy = str(getattr(args.save_strategy, "value", args.save_strategy))
    if strategy != "steps":
        raise ValueError(f"moc needs a step interval and save_strategy={strategy!r} gives "
                         "none: pass MocArguments(interval=N), or save_strategy='steps' with "
                         "save_steps=N")
    steps = args.save_steps
    if steps < 1:  # a fraction of the run, as Trainer reads it
        if args.max_steps <= 0:
            raise ValueError(f"save_steps={steps} is a fraction of max_steps, which is not "
                             "set: pass MocArguments(interval=N)")
        return max(1, math.ceil(args.max_steps * steps))
    return int(steps)


def _agreed(build: Any, device: Any) -> Any:
    """`build()` on every rank; when it raises ValueError on any, the same error on all
    (collective): a rank that failed alone would leave the others waiting in Trainer's
    first collective."""
    result, error = None, None
    try:
        result = build()
    except ValueError as e:
        error = str(e)
    first = next((e for e in gather_json(error, device) if e is not None), None)
    if first is not None:
        if result is not None:
            result.cleanup()
        raise ValueError(first)
    return result


def _trainer_checkpoint(args: Any) -> str | None:
    from transformers.trainer_utils import get_last_checkpoint

    return get_last_checkpoint(args.output_dir) if os.path.isdir(args.output_dir) else None


def _close_quietly(engine: TwoLevelCheckpointer) -> None:
    """Close after an error (one process): keep the snapshots for the restart, and let the
    original error be the one raised."""
    try:
        engine.close(keep_snapshots=True)
    except Exception:  # the training error is what the caller must see
        log.exception("moc: closing the checkpointer after an error failed")
