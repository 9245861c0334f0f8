"""moc in a training loop under `accelerate.Accelerator`, resumed exactly after a kill.

    accelerator = Accelerator(gradient_accumulation_steps=2, dataloader_config=
                              DataLoaderConfiguration(use_seedable_sampler=True))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, sched)
    ckpt = AcceleratorCheckpointer(accelerator, model, optimizer, "ckpt/", dataloader=loader,
                                   scheduler=scheduler, interval=5)
    step, epoch = ckpt.restore()                     # (0, 0) on a fresh start
    while step < steps:
        for batch in ckpt.batches(epoch):            # the resumed epoch: past what was used
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step(); scheduler.step(); optimizer.zero_grad()
            if accelerator.sync_gradients:
                step += 1
                ckpt.maybe_save(step, final=step == steps)
                if step == steps: break
        epoch += 1
    ckpt.close()

Why a wrapper and not Accelerate's own checkpoint hooks (docs/DECISIONS.md, "Trainer and
Accelerate"): `accelerator.save_state(dir)` writes every registered model, optimizer,
scheduler and sampler with `torch.save`, synchronously, whole, into one directory. Its
hooks (`register_save_state_pre_hook`, `register_load_state_pre_hook`) may only change
the list of models whose weights it writes; the optimizer is written in full either way.
A partial checkpoint of the experts, a snapshot in memory and a background persist
cannot pass through them. So the wrapper keeps the moc engine and takes from Accelerate
what it already does right: the prepared objects, `skip_first_batches` for the data
position, `gather` semantics for every rank.

What a resume restores: the model and the optimizer (moc), the scheduler, the gradient
scaler and any object with `state_dict`/`load_state_dict` passed as `objects` (e.g. what
you would `register_for_checkpointing`), every rank's RNGs, and the data position: the
epoch and the batches of it already used, recorded as the loop consumed them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch

from moc.checkpoint.api import CheckpointResult, RecoveryReport
from moc.checkpoint.policy.selection import PECPolicy
from moc.checkpoint.spec import ExpertSpec
from moc.checkpoint.twolevel.checkpointer import TwoLevelCheckpointer
from moc.integrations.loopstate import (
    check_rng,
    check_same,
    decode_state,
    encode_state,
    gather_rng,
    rng_of,
    set_rng,
)

log = logging.getLogger(__name__)


class Position(NamedTuple):
    """Where a loop resumes: after optimizer step `step`, in epoch `epoch`."""

    step: int
    epoch: int


class AcceleratorCheckpointer:
    """moc's two-level checkpoints for a loop under `accelerate.Accelerator` (module
    docstring). `model`, `optimizer` and `dataloader` (the training data) are the
    prepared ones; `scheduler` and `objects` (anything with `state_dict`/
    `load_state_dict`) are saved with each checkpoint.
    Other keyword arguments go to `moc.TwoLevelCheckpointer` (`keep_last`, `k_snapshot`,
    `persist_policy`, `max_failures`, `job`, ...)."""

    def __init__(self, accelerator: Any, model: torch.nn.Module, optimizer: Any,
                 directory: str | Path, *, dataloader: Any, scheduler: Any = None,
                 objects: Iterable[Any] = (), interval: int = 10,
                 policy: PECPolicy | None = None, experts: ExpertSpec | None = None,
                 watch_routing: bool = True, **engine_options: Any) -> None:
        _check_seeded(dataloader)
        self.accelerator, self.loader = accelerator, dataloader
        self.scheduler, self.objects = scheduler, list(objects)
        self.directory = Path(directory)
        inner = accelerator.unwrap_model(model)
        self.engine = TwoLevelCheckpointer(
            inner, getattr(optimizer, "optimizer", optimizer), directory,
            experts=experts or ExpertSpec.infer(inner),
            policy=policy if policy is not None else PECPolicy(k=1), interval=interval,
            **engine_options)
        self.interval = interval
        self.routing = self.engine.watch_routing(inner) if watch_routing else None
        self.recovery: RecoveryReport | None = None
        """What `restore()` resumed from (None: a fresh start)."""
        self.results: list[CheckpointResult] = []
        """Every checkpoint's result, once final, in the order they finished."""
        self._epoch, self._used = 0, 0  # the batches of `_epoch` the loop has taken
        self._resume: dict[str, Any] | None = None  # the position and RNGs to put back

    def restore(self) -> Position:
        """Restore moc's newest checkpoint (memory, a peer's replica or storage); the loop
        goes on after the returned step, in the returned epoch. Collective. Refuses (one
        line) a checkpoint of another model, of another loop, or of another data layout:
        processes, gradient accumulation, batches per epoch, sampler seed."""
        report = self.engine.restore()
        self.recovery = report
        if report is None:
            return Position(0, 0)
        saved = report.extra.get("accelerate")
        if saved is None:
            raise ValueError(f"moc's checkpoint of step {report.step} in {self.directory} "
                             "was not written by AcceleratorCheckpointer: resume it with the "
                             "loop that wrote it, or use another directory")
        check_same(saved["layout"], self._layout(), report.step, str(self.directory),
                   "resume with the settings that saved it, or start a new run in another "
                   "directory")
        if self.scheduler is not None and saved["scheduler"] is not None:
            self.scheduler.load_state_dict(decode_state(saved["scheduler"]))
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None and saved["scaler"] is not None:
            scaler.load_state_dict(decode_state(saved["scaler"]))
        if len(saved["objects"]) != len(self.objects):
            raise ValueError(f"moc's checkpoint of step {report.step} holds "
                             f"{len(saved['objects'])} objects, this loop passed "
                             f"{len(self.objects)}: pass the same objects= as the run that "
                             "saved it")
        for obj, text in zip(self.objects, saved["objects"], strict=True):
            obj.load_state_dict(decode_state(text))
        epoch, used = saved["epoch"], saved["used"]
        rng = rng_of(saved["rng"], self.accelerator.process_index)
        check_rng(rng)
        self._resume = {"epoch": epoch, "used": used, "torch": torch.get_rng_state(),
                        "rng": rng, "step": report.step}
        log.warning("moc: resumed from step %d (%s) in %.2f s", report.step, report.source,
                    report.recovery_s)
        return Position(report.step, epoch)

    def batches(self, epoch: int) -> Iterator[Any]:
        """The batches of `epoch`: in the epoch a resume continues, only those the
        checkpoint had not used, and the RNGs as they were when it was taken (put back
        where Trainer puts them: before the epoch's iterator when none was used, else
        after the first batch of the skipped one)."""
        dataloader = self.loader
        self._epoch, self._used = epoch, 0
        resume = self._resume
        if resume is not None and resume["epoch"] != epoch:
            raise ValueError(f"moc restored step {resume['step']}, which goes on in epoch "
                             f"{resume['epoch']}, but the loop asked for the batches of epoch "
                             f"{epoch}: start the loop at the epoch restore() returned")
        if resume is not None:
            self._resume = None
            self._used = resume["used"]
            if self._used:
                dataloader = self.accelerator.skip_first_batches(dataloader, self._used)
            else:
                self._put_back_rng(resume)
        if hasattr(dataloader, "set_epoch"):
            dataloader.set_epoch(epoch)
        for i, batch in enumerate(dataloader):
            if i == 0 and resume is not None and resume["used"]:
                self._put_back_rng(resume)
            self._used += 1
            yield batch

    def maybe_save(self, step: int, *, final: bool = False) -> bool:
        """Checkpoint after optimizer step `step` when it is due (every `interval`, or
        `final`); whether it did. No work on other steps. Collective."""
        if step % self.interval and not final:
            return False
        engine = self.engine
        engine.save(step, {"accelerate": self._loop_state()}, final=final)
        if engine.pending:
            self.results += engine.drain_completed()
        return True

    def close(self) -> None:
        """Everything in flight durable, the engine closed; results in `results`."""
        if self.routing is not None:
            self.routing.remove()
        self.engine.flush()
        self.results += self.engine.drain_completed()
        self.engine.close()

    # -- internals --------------------------------------------------------------------------

    def _loop_state(self) -> dict[str, Any]:
        used, epoch = self._used, self._epoch
        if used == _length(self.loader):
            epoch, used = epoch + 1, 0  # the epoch is over: the next one starts afresh
        scaler = getattr(self.accelerator, "scaler", None)
        return {"epoch": epoch, "used": used, "layout": self._layout(),
                "scheduler": (encode_state(self.scheduler.state_dict())
                              if self.scheduler is not None else None),
                "scaler": encode_state(scaler.state_dict()) if scaler is not None else None,
                "objects": [encode_state(o.state_dict()) for o in self.objects],
                "rng": gather_rng(self.accelerator.device)}

    def _layout(self) -> dict[str, Any]:
        """What fixes which samples a batch count means (`loopstate.check_same`)."""
        a = self.accelerator
        return {"num_processes": a.num_processes,
                "gradient_accumulation_steps": a.gradient_accumulation_steps,
                "batches_per_epoch": _length(self.loader),
                "sampler_seed": _sampler_seed(self.loader)}

    def _put_back_rng(self, resume: dict[str, Any]) -> None:
        torch.set_rng_state(resume["torch"])
        set_rng(resume["rng"])


def _length(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:  # an iterable dataset
        return None


def _samplers(loader: Any) -> Iterator[Any]:
    """The loader and every sampler inside it (accelerate wraps them: a BatchSamplerShard
    around a BatchSampler around the sampler)."""
    seen, todo = set(), [loader]
    while todo:
        obj = todo.pop()
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        yield obj
        todo += [getattr(obj, name, None) for name in ("batch_sampler", "sampler")]


def _sampler_seed(loader: Any) -> int | None:
    """The seed a seedable sampler shuffles each epoch from (`set_seed` sets it): another
    seed, and the batches skipped on a resume are other samples."""
    return next((int(s.initial_seed) for s in _samplers(loader)
                 if getattr(s, "initial_seed", None) is not None), None)


def _check_seeded(loader: Any) -> None:
    """Refuse a loader that shuffles with torch's global RNG: a resumed epoch's order
    would then come from the RNG at the restart, not at the epoch's start, and the
    skipped batches would be other samples than those the checkpoint used."""
    from torch.utils.data import RandomSampler

    for obj in _samplers(loader):
        if isinstance(obj, RandomSampler) and not hasattr(obj, "set_epoch"):
            raise ValueError("the dataloader shuffles with torch's global RNG (a plain "
                             "RandomSampler): a resumed epoch would be in another order; "
                             "prepare it under Accelerator(dataloader_config="
                             "DataLoaderConfiguration(use_seedable_sampler=True))")
