"""PyTorch Distributed Checkpoint (DCP) as a baseline, given its best settings, behind the
checkpoint contract (`moc.checkpoint.api.CheckpointEngine`) every engine keeps.

    dcp-sync   `dcp.save` of the whole training state; training waits for all of it
    dcp-async  `dcp.async_save` with the process executor (a checkpoint process per rank,
               with its own gloo process group) and `DefaultStager`: staging into shared
               memory on a background thread (pinned memory and non-blocking copies on
               a CUDA stream of its own where CUDA is available); at most one save in
               flight, and one result (a checkpoint or a failed one) per save

What is saved is `RankState.flatten()` of every rank: parameters under stable
global keys (an expert's key is unique to it; a dense key is the same on every rank and
DCP's planner picks one rank to write it), the optimizer state this rank owns under ZeRO
and this rank's RNG, plus the loop state as one JSON string from rank 0 (`META_KEY`).
Every expert, every time: DCP has no notion of partial checkpoints.

Layout under the checkpoint root, one directory per step:

    dcp-step-00000010/
        __0_0.distcp  __1_0.distcp   one file per rank (single_file_per_rank)
        .metadata                     written last, by rank 0 (DCP's coordinator)

A step is complete iff its `.metadata` exists. DCP's `finish` runs on the coordinator only
after every rank has reported its write results, writes `.metadata.tmp`, fsyncs it
(`sync_files=True`) and renames it into place; restore never reads a directory without it.
Every data file is fsynced before its rank reports (`sync_files=True`); DCP does not fsync
the directory after the rename, so rank 0 does once the step is complete.

Async, as DCP documents it: `async_save` returns an `AsyncSaveResponse` with two futures;
`wait_for_snapshot()` blocks on `staging_completion` right before `optimizer.step()` (the
staged copy must be taken before the weights change), and `upload_completion` resolves
when every rank's data and the metadata are on disk. The stager reuses its staging
buffers from one save to the next, so a save first waits for the previous upload (that
wait is stall, counted in `save_s`). Errors of either future land in the record's
`error`, which the trainer reports as a failed checkpoint; training goes on from the
previous complete step.

DCP's async API (`DefaultStager`, `StagingOptions`, `AsyncSaveResponse`: torch >= 2.9)
is imported where it is used, and the trainer imports this module only for a DCP mode:
a moc run never loads it.

The checkpoint process is DCP's, one per trainer process: spawned by the first
`async_save` (here a tiny one at construction, so that it is up before training starts,
as moc's persist process is), it joins a fresh gloo group over a TCP store that rank 0's
checkpoint process opens on a free port (not torchrun's store, whose keys outlive the
attempts of a restarted job: leave DCP_USE_PREFIX_STORE unset, or a restarted job's
checkpoint processes find the addresses of the dead ones), and it serves every later
save. DCP keeps it until the trainer process exits; `close()` ends it. It is spawned, so
it imports only what unpickling its target needs: the worker entry point
`moc.train.__main__` is never re-imported (multiprocessing skips the `__main__` module
of a package, and it is guarded).

Trust: DCP's own load trusts its directory. `torch.distributed.checkpoint` unpickles a
step's `.metadata` (and the non-tensor values, here `META_KEY`, are pickled in the data
files), so restoring a DCP step runs whatever its files say: restore only directories
you wrote. Only the restore (`load_step`, inside DCP's load) reads them; moc's own
tools never do: the launcher (`moc train`) only lists DCP steps (`complete_dcp_steps`)
and leaves a different model to the restore to report. moc's own format
(docs/FORMAT.md) is JSON and safetensors, read without unpickling anything.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from moc.checkpoint.api import CheckpointEngine, CheckpointResult, RecoveryReport, checked_save
from moc.checkpoint.dist import RankError
from moc.checkpoint.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
)
from moc.checkpoint.parts import EngineParts
from moc.checkpoint.recovery import DictReader, restore_loop
from moc.checkpoint.spec import ExpertSpec, dense_key, expert_key, param_key_of
from moc.checkpoint.state import RankState, flatten_params, shared_state
from moc.checkpoint.store.manifest import check_model
from moc.checkpoint.store.steps import fsync_dir
from moc.compat import has_dcp_async_staging
from moc.topology import ParallelGroups

if TYPE_CHECKING:  # torch >= 2.9: imported where used (module docstring)
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

DCP_MODES = ("dcp-sync", "dcp-async")
EXECUTORS = ("process", "thread")
META_KEY = "moc/meta"
"""The loop state, model config and layout, one JSON string saved by rank 0."""
METADATA = ".metadata"
"""DCP's metadata file: its existence is what makes a step directory complete."""
WARMUP_DIR = ".dcp-warmup"
"""Scratch checkpoint of the save that starts DCP's checkpoint process."""
_STEP_RE = re.compile(r"^dcp-step-(\d{8})$")
CHECKPOINT_PROCESS_STOP_S = 30.0
"""How long close() lets DCP's checkpoint process leave its process group and exit
before it is terminated."""
DCP_ERRORS = (Exception, CheckpointException)
"""What a DCP call may raise: its CheckpointException (every rank's failures, raised on
every rank) derives from BaseException, so `except Exception` would let it through."""


def dcp_step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"dcp-step-{step:08d}"


def dcp_steps(root: str | Path) -> tuple[list[int], list[int]]:
    """(complete, incomplete) steps under `root`, oldest first."""
    root = Path(root)
    complete: list[int] = []
    incomplete: list[int] = []
    if not root.is_dir():
        return complete, incomplete
    for d in root.iterdir():
        m = _STEP_RE.match(d.name)
        if m and d.is_dir():
            (complete if (d / METADATA).is_file() else incomplete).append(int(m.group(1)))
    return sorted(complete), sorted(incomplete)


def complete_dcp_steps(root: str | Path) -> list[int]:
    """Steps whose `.metadata` exists, oldest first."""
    return dcp_steps(root)[0]


def read_meta(path: Path) -> dict[str, Any]:
    """The `META_KEY` record of one step directory, read by this process alone (no
    collective): DCP loads a non-tensor value by replacing the placeholder given."""
    state: dict[str, Any] = {META_KEY: ""}
    with warnings.catch_warnings():  # DCP warns that no_dist means a single process
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return json.loads(state[META_KEY])


def check_dcp_step(root: str | Path, step: int, model_meta: dict[str, Any]) -> dict[str, Any]:
    """The `META_KEY` record of `step`; raises IncompatibleCheckpointError when it was
    written for another model. Reads through DCP, which unpickles the step's files:
    call it only where DCP's load would read them anyway (the restore)."""
    path = dcp_step_dir(root, step)
    meta = read_meta(path)
    check_model(meta.get("model"), model_meta, f"checkpoint {path}")
    return meta


def staging_options() -> StagingOptions:
    """DCP's best staging settings on this machine. What each does (torch 2.13,
    `torch/distributed/checkpoint/staging.py` and `_state_dict_stager.py`):

    use_async_staging      the copy runs on a one-thread pool, behind the caller; where an
                           accelerator is available DefaultStager also makes a stream of
                           its own (at construction, on the caller's thread) and issues
                           the copies on it: the CUDA-stream overlap DCP offers
    use_non_blocking_copy  device-to-host copies are queued non-blocking on that stream,
                           which is synchronized once at the end; needs an accelerator
                           (DefaultStager raises without one)
    use_pinned_memory      each staged host storage is page-locked (cudaHostRegister), so
                           those copies are DMA at the pinned bandwidth; needs CUDA
                           (ignored, with a warning, without it)
    use_shared_memory      staged storages live in shared memory, so the checkpoint
                           process receives them by file descriptor, without a copy

    The staged storages are cached and reused from one save to the next: the first save
    allocates (and pins) them, the later ones only copy."""
    from torch.distributed.checkpoint.staging import StagingOptions

    cuda = torch.cuda.is_available()
    return StagingOptions(use_pinned_memory=cuda, use_shared_memory=True,
                          use_async_staging=True, use_non_blocking_copy=cuda)


def new_stager() -> DefaultStager:
    """A `DefaultStager` with `staging_options()`. Made after the model is on its device:
    its stream is created on the current device, which must then be the training one."""
    from torch.distributed.checkpoint.staging import DefaultStager

    return DefaultStager(staging_options())


def settle_device_work() -> None:
    """Blocks until the kernels queued on this thread's CUDA stream (the optimizer step's)
    are done; nothing on the CPU, or before CUDA is initialized. DefaultStager copies on
    a stream of its own that does not wait for the training stream: without this, a
    staged copy could be taken before the step's update lands (a torn checkpoint, not
    an error). The reference trainer has already waited (it reads the loss with
    `.item()` after the step), so this costs it nothing; a loop that has not gives up
    here, once per checkpoint, the lead its CPU had over its GPU."""
    if torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()


@dataclass
class _InFlight:
    """The one async save not yet finished. The timestamps are set by the futures' done
    callbacks, on DCP's threads; everything else by the caller's thread."""

    step: int
    response: AsyncSaveResponse
    path: Path
    start: float
    save_s: float = 0.0
    wait_s: float = 0.0
    error: str | None = None
    staged_at: float | None = None
    uploaded_at: float | None = None
    staged: bool = False
    """Whether the caller has waited for staging (wait_for_snapshot or a later save)."""


class DCPCheckpointer(CheckpointEngine):
    """PyTorch DCP's `save` (dcp-sync) or `async_save` (dcp-async) of the whole training
    state; implements `moc.checkpoint.api.CheckpointEngine`. Every expert, every time:
    DCP has no notion of partial checkpoints, nor of routed tokens."""

    def __init__(self, model: nn.Module, optimizer: object, directory: str | Path, *,
                 experts: ExpertSpec | None = None, groups: ParallelGroups | None = None,
                 interval: int = 10, keep_last: int | None = None,
                 model_meta: dict[str, Any] | None = None, mode: str = "dcp-sync",
                 executor: str = "process") -> None:
        if mode not in DCP_MODES:
            raise ValueError(f"DCPCheckpointer mode must be one of {', '.join(DCP_MODES)}, "
                             f"got {mode!r}")
        if mode == "dcp-async" and not has_dcp_async_staging():
            raise ValueError(f"mode='dcp-async' needs DCP's DefaultStager, which torch "
                             f"{torch.__version__} lacks (torch 2.9 added it); use "
                             "mode='dcp-sync', or upgrade torch to 2.9+")
        if executor not in EXECUTORS:
            raise ValueError(f"DCPCheckpointer executor must be one of {', '.join(EXECUTORS)}, "
                             f"got {executor!r}")
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"Checkpointer keep_last must be >= 1 or None, got {keep_last}")
        # moc's retention reads moc's manifests; DCP steps are pruned here (`retain_newest`).
        self.parts = EngineParts.build(model, optimizer, directory, experts=experts,
                                       groups=groups, policy=None, interval=interval,
                                       keep_last=None, model_meta=model_meta, mode=mode)
        self.root, self.spec, self.interval = self.parts.root, self.parts.spec, interval
        self.mode, self.keep_last = mode, keep_last
        # The process executor joins a process group of the trainer's ranks; a single
        # process without torch.distributed has none, so it stages and writes on a thread.
        self.executor = executor if self.parts.groups.distributed else "thread"
        self._stager = new_stager() if mode == "dcp-async" else None
        self._inflight: _InFlight | None = None
        self._done: list[CheckpointResult] = []
        self._error: str | None = None  # rank 0's, finishing a step; raised at the next save
        if self._uses_process:
            start_checkpoint_process(self.parts)

    @property
    def _uses_process(self) -> bool:
        return self.mode == "dcp-async" and self.executor == "process"

    # -- the training loop's calls -------------------------------------------------------

    def record_routing(self, counts: torch.Tensor) -> None:
        """Nothing to record: every expert is saved every time, so no token is lost."""

    def save(self, step: int, extra_state: dict[str, Any] | None = None, *,
             final: bool = False) -> None:
        """dcp-sync: write `step` and return once it is complete (collective).
        dcp-async: start writing `step` and return at once; its result comes out of
        `drain_completed()` once its upload is done. Every DCP checkpoint is complete,
        so `final` changes nothing."""
        extra_state = checked_save(step, extra_state)
        if self.mode == "dcp-sync":
            self._save_sync(step, extra_state)
        else:
            self._save_async(step, extra_state)

    def _writer(self, path: Path) -> dcp.FileSystemWriter:
        return dcp.FileSystemWriter(path, single_file_per_rank=True, sync_files=True)

    def _state(self, step: int, extra_state: dict[str, Any] | None) -> dict[str, Any]:
        p = self.parts
        state: dict[str, Any] = dict(p.state.flatten())
        if p.groups.rank == 0:  # the loop state as rank 0 has it, like moc's manifests
            state[META_KEY] = json.dumps({"step": step, "mode": self.mode,
                                          "extra": extra_state or {},
                                          "model": p.model_meta, "layout": p.layout})
        return state

    def _begin(self, step: int) -> tuple[Path, str | None]:
        """Collective: rank 0 removes an older copy of this step's directory (restore
        skipped it, or a crash left it: a rewrite must never look complete halfway), then
        every rank learns every problem so that all take the same path: this step's
        (returned), an older step's (raised) and a dead checkpoint process (raised)."""
        p = self.parts
        path = dcp_step_dir(self.root, step)
        error = None
        if p.groups.rank == 0:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                if path.exists():
                    shutil.rmtree(path)
            except OSError as e:
                error = f"rank 0 could not prepare {path}: {e}"
        reports = p.dist.all_gather((error, self._error))
        self._error = None
        carried = [r[1] for r in reports if r[1]]
        if carried:  # an older step is committed but not durable, or retention failed
            raise CheckpointError("; ".join(carried))
        agree_process_state(self.parts, self._uses_process)
        return path, next((r[0] for r in reports if r[0]), None)

    def _save_sync(self, step: int, extra_state: dict[str, Any] | None) -> None:
        t0 = time.perf_counter()
        p = self.parts
        path, error = self._begin(step)
        if error is None:
            try:
                # Blocks until every rank's file and the metadata are written and fsynced.
                dcp.save(self._state(step, extra_state), storage_writer=self._writer(path),
                         process_group=p.groups.side_group, no_dist=not p.groups.distributed)
            except DCP_ERRORS as e:  # DCP raises the same CheckpointException on every rank
                error = f"dcp.save of step {step} failed: {_describe(e)}"
            error = next((e for e in p.dist.all_gather(error) if e), None)
        if error is None:
            self._committed(path)
        self._done.append(_result(self.mode, self.parts, step, time.perf_counter() - t0, error,
                                  path))

    def _save_async(self, step: int, extra_state: dict[str, Any] | None) -> None:
        from torch.distributed.checkpoint.state_dict_saver import (
            AsyncCheckpointerType,
            AsyncSaveResponse,
        )

        t0 = time.perf_counter()
        p = self.parts
        # The staging buffers are reused: one save in flight. Blocks until the previous
        # upload is done, so that every save gives exactly one result, none is skipped.
        self._finish(block=True)
        path, error = self._begin(step)
        if error is None:
            settle_device_work()
            start = time.perf_counter()
            try:
                response = dcp.async_save(
                    self._state(step, extra_state), storage_writer=self._writer(path),
                    process_group=p.groups.side_group, no_dist=not p.groups.distributed,
                    async_checkpointer_type=(AsyncCheckpointerType.PROCESS
                                             if self.executor == "process"
                                             else AsyncCheckpointerType.THREAD),
                    async_stager=self._stager)
            except DCP_ERRORS as e:
                error = f"dcp.async_save of step {step} failed to start: {_describe(e)}"
            else:
                assert isinstance(response, AsyncSaveResponse)  # an async stager gives one
                flight = self._inflight = _InFlight(step, response, path, start)

                def staged(_: Future) -> None:
                    flight.staged_at = time.perf_counter()

                def uploaded(_: Future) -> None:
                    flight.uploaded_at = time.perf_counter()

                response.staging_completion.add_done_callback(staged)
                response.upload_completion.add_done_callback(uploaded)
                flight.save_s = time.perf_counter() - t0
                return
        self._done.append(_result(self.mode, self.parts, step, time.perf_counter() - t0, error,
                                  None, snapshot_s=0.0))

    def wait_for_snapshot(self) -> None:
        """Blocks until the state being saved is staged and may change: call it right
        before `optimizer.step()`."""
        flight = self._inflight
        if flight is None or flight.staged:
            return
        t0 = time.perf_counter()
        try:
            flight.response.staging_completion.result()  # blocks until the copy is done
        except DCP_ERRORS as e:
            flight.error = f"staging step {flight.step} failed: {_describe(e)}"
        flight.staged = True
        flight.wait_s = time.perf_counter() - t0

    def _finish(self, block: bool) -> None:
        """Account the save in flight once its upload is done (waiting for it when
        `block`): its time, its bytes; the step directory's fsync and retention."""
        flight = self._inflight
        if flight is None or not (block or flight.response.upload_completion.done()):
            return
        error = flight.error
        try:
            # Blocks until every rank's data and the metadata are written and fsynced.
            flight.response.upload_completion.result()
        except DCP_ERRORS as e:
            error = error or f"dcp.async_save of step {flight.step} failed: {_describe(e)}"
        now = time.perf_counter()
        staged = flight.staged_at if flight.staged_at is not None else now
        uploaded = flight.uploaded_at if flight.uploaded_at is not None else now
        if error is None:
            self._committed(flight.path)
        self._inflight = None
        self._done.append(_result(
            self.mode, self.parts, flight.step, flight.save_s, error, flight.path,
            wait_s=flight.wait_s, snapshot_s=staged - flight.start,
            persist_s=uploaded - flight.start))

    def _committed(self, path: Path) -> None:
        """Rank 0, once a step is complete: make its rename durable, prune old steps.
        Not collective; a failure is shared with every rank at the next save."""
        if self.parts.groups.rank != 0:
            return
        try:
            fsync_dir(path)
            fsync_dir(self.root)
            retain_newest(self.root, self.keep_last)
        except OSError as e:
            self._error = f"rank 0 could not finish {path}: {e}"

    @property
    def pending(self) -> bool:
        """Whether a save is in flight or finished but not yet drained."""
        return self._inflight is not None or bool(self._done)

    def drain_completed(self) -> list[CheckpointResult]:
        """Saves whose upload has finished (or that failed), oldest first. Not collective:
        an upload is done on every rank once it is done on one (DCP ends a save with a
        collective after the metadata is written)."""
        self._finish(block=False)
        out, self._done = self._done, []
        return out

    def flush(self) -> None:
        """Wait for the save in flight; its result is then in `drain_completed()`."""
        self._finish(block=True)

    def host_memory(self) -> dict[str, int]:
        return {}  # DCP's staging buffers are its own; it does not say how large

    def abandon(self) -> None:
        """`CheckpointEngine.abandon`: the staging buffers and the directory's lock go;
        a save in flight is not waited for (its step has no `.metadata` and is never
        restored)."""
        try:
            if self._stager is not None:
                self._stager.close()
                self._stager = None
            if self._uses_process:
                stop_checkpoint_process()
        finally:
            self.parts.release()

    def close(self) -> None:
        """Wait for the save in flight, release the staging buffers, end DCP's checkpoint
        process. Collective. Raises an error no save has reported yet."""
        try:
            self.flush()
            errors = [e for e in self.parts.dist.all_gather(self._error) if e]
            self._error = None
        finally:
            self.abandon()  # what is left to release once nothing is in flight
        if errors:
            raise CheckpointError("; ".join(errors))

    # -- recovery --------------------------------------------------------------------------

    def restore(self, step: int | None = None) -> RecoveryReport | None:
        """Load the newest complete step (one with `.metadata`) every rank can read; None
        if there is none. Collective. DCP stores no checksums: a step is corrupt only when
        its metadata or files cannot be read, never because a byte flipped. `step`: that
        step only (a baseline: newer steps are left where they are)."""
        t0 = time.perf_counter()
        p = self.parts
        self.flush()
        steps = p.dist.broadcast(list(reversed(complete_dcp_steps(self.root))))
        if step is not None:
            if step not in steps:
                raise ValueError(f"cannot restore step {step}: {self.root} holds no "
                                 f"complete DCP checkpoint of it")
            steps = [step]
        meta, skipped = restore_loop(steps, lambda step: load_step(self.root, step, p),
                                     p.dist, skip=DCP_ERRORS,
                                     label=lambda step: f"DCP checkpoint step {step}")
        reasons = [f"step {step}: {reason}" for step, reason in skipped]
        if meta is None:
            if skipped:
                raise CorruptCheckpointError(
                    f"{self.root}: no readable DCP checkpoint; every step failed: "
                    f"{'; '.join(reasons)}")
            return None
        n, layers = self.spec.n_experts, self.spec.n_moe_layers
        return RecoveryReport(meta["step"], meta["extra"], "storage", time.perf_counter() - t0,
                              0, [0] * layers, 0.0, n, n, reasons)



def start_checkpoint_process(parts: EngineParts) -> None:
    """Collective: start DCP's checkpoint process now, as moc's persist process is
    started, rather than at the first save. DCP starts it inside the first `async_save`
    (a spawned interpreter and a process group: seconds), so the first checkpoint would
    reach storage late; and a checkpoint process whose trainer dies while it starts waits
    for its peers for the process group's timeout (30 min) before it exits. The only
    public way to start it is a save: a tiny one, into a scratch directory removed
    afterwards."""
    if agree_process_state(parts, True) == "alive":
        return  # an earlier checkpointer of this process started it
    scratch = parts.root / WARMUP_DIR
    if parts.groups.rank == 0:
        parts.root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(scratch, ignore_errors=True)
    parts.dist.barrier()
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    # Blocks until every rank's checkpoint process is up and has written its part.
    dcp.async_save({"warmup": torch.zeros(1)}, checkpoint_id=scratch,
                   process_group=parts.groups.side_group,
                   async_checkpointer_type=AsyncCheckpointerType.PROCESS).result()
    parts.dist.barrier()
    if parts.groups.rank == 0:
        shutil.rmtree(scratch, ignore_errors=True)


def agree_process_state(parts: EngineParts, uses_process: bool) -> str | None:
    """Collective: the state of DCP's checkpoint process, the same on every rank ("none"
    before it starts, "alive"), or None without one. Raises CheckpointError when it is
    gone on some rank: that rank would never enter a save's collectives, and the others
    would wait for it for the process group's 30 minutes."""
    mine = checkpoint_process_state() if uses_process else None
    states = set(parts.dist.all_gather(mine))
    if len(states) > 1 or "dead" in states:
        raise CheckpointError(
            "DCP's checkpoint process is not running on every rank "
            f"({sorted(map(str, states))}); this job cannot take async checkpoints any "
            "more: restart it")
    return states.pop()


def retain_newest(root: Path, keep_last: int | None) -> None:
    """Keep the newest `keep_last` complete steps; delete older ones and incomplete
    directories older than the newest complete step (a newer one may be in flight)."""
    if keep_last is None:
        return
    complete, incomplete = dcp_steps(root)
    if not complete:
        return
    doomed = complete[:-keep_last] + [s for s in incomplete if s < complete[-1]]
    for step in sorted(doomed):
        # Drop the metadata first: a crash mid-delete leaves an incomplete directory.
        (dcp_step_dir(root, step) / METADATA).unlink(missing_ok=True)
        shutil.rmtree(dcp_step_dir(root, step))


def load_step(root: Path, step: int, parts: EngineParts) -> dict[str, Any]:
    """Load one step into this rank's model and optimizer (collective: `dcp.load`);
    its loop state. Everything is read before anything is installed, so a step that
    fails leaves the model as it was for the next older one. Every rank checks what it
    can alone first and the ranks agree on it, so none enters `dcp.load` alone."""
    path = dcp_step_dir(root, step)
    error: RankError | None = None
    meta, state = None, None
    try:
        meta = check_dcp_step(root, step, parts.model_meta)
        state = _placeholders(path, parts.state)
    except DCP_ERRORS as e:  # kept as data, not the exception: see recovery.restore_loop
        error = RankError.of(parts.dist.rank, e if isinstance(e, CheckpointError) else
                             CorruptCheckpointError(f"{path}: {_describe(e)}"))
    parts.dist.raise_if_any(error)
    assert meta is not None and state is not None
    try:
        dcp.load(state, storage_reader=dcp.FileSystemReader(path),
                 process_group=parts.groups.side_group, no_dist=not parts.groups.distributed)
    except DCP_ERRORS as e:  # DCP raises on every rank when one fails to read
        raise CorruptCheckpointError(f"{path}: {_describe(e)}") from None
    parts.state.load(DictReader(state))
    return {"step": step, **meta}


def _result(mode: str, parts: EngineParts, step: int, save_s: float, error: str | None,
            path: Path | None, *, wait_s: float = 0.0, snapshot_s: float | None = None,
            persist_s: float | None = None) -> CheckpointResult:
    """A DCP save's result: every expert, when it reached storage."""
    n, layers, world = parts.spec.n_experts, parts.spec.n_moe_layers, parts.groups.world_size
    ok = error is None and path is not None
    return CheckpointResult(
        step, mode, n, [list(range(n)) if ok else [] for _ in range(layers)], save_s, wait_s,
        bytes_per_rank=_bytes_per_rank(path, world) if ok and path else [0] * world,
        error=error, snapshot_s=snapshot_s, persist_s=persist_s)


def _placeholders(path: Path, state: RankState) -> dict[str, torch.Tensor]:
    """Empty tensors for the keys this rank restores, shaped as the checkpoint holds them:
    its parameters, the optimizer state of the parameters it owns (whatever the optimizer
    holds now: AdamW creates state lazily at the first step), its RNG. Raises
    IncompatibleCheckpointError for a key the model has and the step lacks."""
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    params = flatten_params(state.named, state.spec)
    experts = state.spec.by_name()
    owned: set[str] = set()
    for name in state.optimizer.owned_names():
        if name in experts:
            ep = experts[name]
            owned.update(expert_key("param", ep.stem, gid) for gid in ep.global_ids)
        else:
            owned.add(dense_key("param", name))
    keys = list(params)
    keys += [k for k in stored if k.startswith("optim/") and param_key_of(k) in owned]
    keys += [k for k in shared_state(state) if k in stored]  # absent in older checkpoints
    # Its generators' states: absent after a restart on more ranks, or for an
    # accelerator the run that saved did not use (load_rank_state leaves those as they are).
    keys += [k for k in state.generators if k in stored]
    out = {}
    for key in keys:
        entry = stored.get(key)
        if not isinstance(entry, TensorStorageMetadata):
            raise IncompatibleCheckpointError(f"{path} holds no tensor {key!r}")
        if key in params and tuple(entry.size) != tuple(params[key].shape):
            raise IncompatibleCheckpointError(
                f"{path}: {key} has shape {tuple(entry.size)}, the model "
                f"{tuple(params[key].shape)}")
        out[key] = torch.empty(entry.size, dtype=entry.properties.dtype)
    return out


def _bytes_per_rank(path: Path, world_size: int) -> list[int]:
    """Bytes of the data files each rank wrote (`__<rank>_<i>.distcp`); the metadata is
    not counted, as moc's manifests are not."""
    out = [0] * world_size
    for f in path.glob("__*_*.distcp"):
        m = re.match(r"^__(\d+)_\d+\.distcp$", f.name)
        if m and int(m.group(1)) < world_size:
            out[int(m.group(1))] += f.stat().st_size
    return out


def _describe(e: BaseException) -> str:
    """One line per failing rank instead of DCP's tracebacks."""
    if isinstance(e, CheckpointException):
        return "; ".join(f"rank {rank}: {type(exc).__name__}: {exc}"
                         for rank, (exc, _) in sorted(e.failures.items()))
    return f"{type(e).__name__}: {e}"


# DCP keeps its checkpoint process in a module global and offers no public way to ask
# about it or stop it (torch 2.13); these two functions are the only places moc touches
# that private API, and both degrade to doing nothing if it changes.


def checkpoint_process_state() -> str:
    """This process's DCP checkpoint process: "none" (not started yet), "alive", "dead"."""
    from torch.distributed.checkpoint import _async_process_executor as executor

    proc = getattr(executor, "_CHECKPOINT_PROCESS", None)
    if proc is None:
        return "none"
    process = getattr(proc, "_save_process", None)
    return "alive" if process is None or process.is_alive() else "dead"


def stop_checkpoint_process() -> None:
    """End DCP's checkpoint process of this trainer process, as DCP itself does only when
    its handle is garbage collected at exit: ask it to terminate, then SIGTERM."""
    from torch.distributed.checkpoint import _async_process_executor as executor

    proc = getattr(executor, "_CHECKPOINT_PROCESS", None)
    process = getattr(proc, "_save_process", None)
    if proc is None or process is None:
        return
    executor._CHECKPOINT_PROCESS = None
    if process.is_alive():
        with contextlib.suppress(OSError, AttributeError):  # already gone; another torch
            proc._send(executor._CheckpointSaveProcessControlOpts.TERMINATE)
        process.join(CHECKPOINT_PROCESS_STOP_S)
    if process.is_alive():
        process.terminate()
        process.join()
