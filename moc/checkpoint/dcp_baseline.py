"""PyTorch Distributed Checkpoint (DCP) as a baseline, given its best settings, behind the
interface the reference trainer drives every checkpointer through.

    dcp-sync   `dcp.save` of the whole training state; training waits for all of it
    dcp-async  `dcp.async_save` with the process executor (a checkpoint process per rank,
               with its own gloo process group) and `DefaultStager`: staging into shared
               memory on a background thread (pinned memory and non-blocking copies
               where CUDA is available); at most one save in flight

What is saved is `Checkpointer._local_state()` of every rank: parameters under stable
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
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import (
    AsyncCheckpointerType,
    AsyncSaveResponse,
)

from moc.checkpoint.checkpointer import (
    Checkpointer,
    RecoveryReport,
    SaveStats,
    _all_gather,
    _param_key,
)
from moc.checkpoint.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
)
from moc.checkpoint.manifest import MAX_DIFFS_SHOWN, _differences
from moc.checkpoint.recovery import DictReader, load_rank_state
from moc.checkpoint.spec import dense_key, expert_key, flatten_params, rng_key
from moc.checkpoint.storage import fsync_dir
from moc.checkpoint.twolevel import CheckpointRecord

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
    written for another model."""
    path = dcp_step_dir(root, step)
    meta = read_meta(path)
    diffs = _differences(meta.get("model"), model_meta)
    if diffs:
        shown = "; ".join(diffs[:MAX_DIFFS_SHOWN])
        raise IncompatibleCheckpointError(
            f"checkpoint {path} was written for a different model ({shown}); use the "
            "same model config or a different --ckpt-dir")
    return meta


def staging_options() -> StagingOptions:
    """DCP's best staging settings on this machine. Pinned memory and non-blocking copies
    need CUDA (DefaultStager refuses non-blocking copies without an accelerator); shared
    memory lets the checkpoint process read the staged tensors without a copy; async
    staging overlaps the copy with the next forward and backward pass."""
    cuda = torch.cuda.is_available()
    return StagingOptions(use_pinned_memory=cuda, use_shared_memory=True,
                          use_async_staging=True, use_non_blocking_copy=cuda)


@dataclass
class _InFlight:
    """The one async save not yet finished. The timestamps are set by the futures' done
    callbacks, on DCP's threads."""

    record: CheckpointRecord
    response: AsyncSaveResponse
    path: Path
    start: float
    staged_at: float | None = None
    uploaded_at: float | None = None
    staged: bool = False
    """Whether the caller has waited for staging (wait_for_snapshot or a later save)."""


class DCPCheckpointer(Checkpointer):
    def __init__(self, model: nn.Module, optimizer: object, directory: str | Path, *,
                 mode: str = "dcp-sync", executor: str = "process",
                 keep_last: int | None = None, **kwargs: Any) -> None:
        if mode not in DCP_MODES:
            raise ValueError(f"DCPCheckpointer mode must be one of {', '.join(DCP_MODES)}, "
                             f"got {mode!r}")
        if executor not in EXECUTORS:
            raise ValueError(f"DCPCheckpointer executor must be one of {', '.join(EXECUTORS)}, "
                             f"got {executor!r}")
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"Checkpointer keep_last must be >= 1 or None, got {keep_last}")
        # Our retention reads our manifests; DCP steps are pruned here (`_retain`).
        super().__init__(model, optimizer, directory, mode=mode, keep_last=None, **kwargs)
        self.keep_last = keep_last
        self.k = self.spec.n_experts  # every expert, every time
        # The process executor joins a process group of the trainer's ranks; a single
        # process without torch.distributed has none, so it stages and writes on a thread.
        self.executor = executor if self.groups.distributed else "thread"
        self._stager = DefaultStager(staging_options()) if mode == "dcp-async" else None
        self._inflight: _InFlight | None = None
        self._done: list[CheckpointRecord] = []
        self._error: str | None = None  # rank 0's, finishing a step; raised at the next save
        if self._uses_process:
            self._start_checkpoint_process()

    @property
    def _uses_process(self) -> bool:
        return self.mode == "dcp-async" and self.executor == "process"

    def _start_checkpoint_process(self) -> None:
        """Collective: start DCP's checkpoint process now, as moc's persist process is
        started, rather than at the first save. DCP starts it inside the first
        `async_save` (a spawned interpreter and a process group: seconds), so the first
        checkpoint would reach storage late; and a checkpoint process whose trainer dies
        while it starts waits for its peers for the process group's timeout (30 min)
        before it exits. The only public way to start it is a save: a tiny one, into a
        scratch directory removed afterwards."""
        g = self.groups
        if self._process_state() == "alive":
            return  # an earlier checkpointer of this process started it
        scratch = self.root / WARMUP_DIR
        if g.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(scratch, ignore_errors=True)
        dist.barrier(group=g.side_group)
        # Blocks until every rank's checkpoint process is up and has written its part.
        dcp.async_save({"warmup": torch.zeros(1)}, checkpoint_id=scratch,
                       process_group=g.side_group,
                       async_checkpointer_type=AsyncCheckpointerType.PROCESS).result()
        dist.barrier(group=g.side_group)
        if g.rank == 0:
            shutil.rmtree(scratch, ignore_errors=True)

    def _process_state(self) -> str | None:
        """Collective: the state of DCP's checkpoint process, the same on every rank
        ("none" before it starts, "alive"), or None without one. Raises CheckpointError
        when it is gone on some rank: that rank would never enter a save's collectives,
        and the others would wait for it for the process group's 30 minutes."""
        g = self.groups
        mine = _checkpoint_process_state() if self._uses_process else None
        states = set(_all_gather(mine, g.side_group, g))
        if len(states) > 1 or "dead" in states:
            raise CheckpointError(
                "DCP's checkpoint process is not running on every rank "
                f"({sorted(map(str, states))}); this job cannot take async checkpoints any "
                "more: restart it")
        return states.pop()

    # -- saving ----------------------------------------------------------------------------

    def _writer(self, path: Path) -> dcp.FileSystemWriter:
        return dcp.FileSystemWriter(path, single_file_per_rank=True, sync_files=True)

    def _state(self, step: int, extra_state: dict[str, Any] | None) -> dict[str, Any]:
        state: dict[str, Any] = dict(self._local_state())
        if self.groups.rank == 0:  # the loop state as rank 0 has it, like our manifests
            g = self.groups
            state[META_KEY] = json.dumps({
                "step": step, "mode": self.mode, "extra": extra_state or {},
                "model": self.model_meta, "layout": {"world_size": g.world_size,
                                                     "ep": g.layout.ep}})
        return state

    def _begin(self, step: int) -> tuple[Path, str | None]:
        """Collective: rank 0 removes an older copy of this step's directory (restore
        skipped it, or a crash left it: a rewrite must never look complete halfway), then
        every rank learns every problem so that all take the same path: this step's
        (returned), an older step's (raised) and a dead checkpoint process (raised)."""
        g = self.groups
        path = dcp_step_dir(self.root, step)
        error = None
        if g.rank == 0:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                if path.exists():
                    shutil.rmtree(path)
            except OSError as e:
                error = f"rank 0 could not prepare {path}: {e}"
        reports = _all_gather((error, self._error), g.side_group, g)
        self._error = None
        carried = [r[1] for r in reports if r[1]]
        if carried:  # an older step is committed but not durable, or retention failed
            raise CheckpointError("; ".join(carried))
        self._process_state()
        return path, next((r[0] for r in reports if r[0]), None)

    def save(self, step: int, extra_state: dict[str, Any] | None = None  # type: ignore[override]
             ) -> SaveStats | CheckpointRecord:
        """dcp-sync: write `step` and return its stats once it is complete (collective).
        dcp-async: start writing `step` and return its record at once; it lands in
        `drain_completed()` once its upload is done."""
        if self.mode == "dcp-sync":
            return self._save_sync(step, extra_state)
        return self._save_async(step, extra_state)

    def _all_experts(self) -> list[list[int]]:
        return [list(range(self.spec.n_experts)) for _ in range(self.spec.n_moe_layers)]

    def _save_sync(self, step: int, extra_state: dict[str, Any] | None) -> SaveStats:
        t0 = time.perf_counter()
        g = self.groups
        path, error = self._begin(step)
        if error is None:
            try:
                # Blocks until every rank's file and the metadata are written and fsynced.
                dcp.save(self._state(step, extra_state), storage_writer=self._writer(path),
                         process_group=g.side_group, no_dist=not g.distributed)
            except DCP_ERRORS as e:  # DCP raises the same CheckpointException on every rank
                error = f"dcp.save of step {step} failed: {_describe(e)}"
            error = next((e for e in _all_gather(error, g.side_group, g) if e), None)
        nbytes, written = [0] * g.world_size, [[] for _ in range(self.spec.n_moe_layers)]
        if error is None:
            self._committed(path)
            nbytes, written = _bytes_per_rank(path, g.world_size), self._all_experts()
        return SaveStats(step, time.perf_counter() - t0, nbytes, self.mode, self.k, written,
                         error)

    def _save_async(self, step: int, extra_state: dict[str, Any] | None) -> CheckpointRecord:
        t0 = time.perf_counter()
        g = self.groups
        self._finish(block=True)  # the staging buffers are reused: one save in flight
        path, error = self._begin(step)
        record = CheckpointRecord(step, self.k, self.k * self.spec.n_moe_layers, 0.0,
                                  error=error)
        if error is None:
            start = time.perf_counter()
            try:
                response = dcp.async_save(
                    self._state(step, extra_state), storage_writer=self._writer(path),
                    process_group=g.side_group, no_dist=not g.distributed,
                    async_checkpointer_type=(AsyncCheckpointerType.PROCESS
                                             if self.executor == "process"
                                             else AsyncCheckpointerType.THREAD),
                    async_stager=self._stager)
            except DCP_ERRORS as e:
                record.error = f"dcp.async_save of step {step} failed to start: {_describe(e)}"
            else:
                assert isinstance(response, AsyncSaveResponse)  # an async stager gives one
                flight = self._inflight = _InFlight(record, response, path, start)

                def staged(_: Future) -> None:
                    flight.staged_at = time.perf_counter()

                def uploaded(_: Future) -> None:
                    flight.uploaded_at = time.perf_counter()

                response.staging_completion.add_done_callback(staged)
                response.upload_completion.add_done_callback(uploaded)
        if record.error is not None:
            record.snapshot_s = 0.0
            self._done.append(record)
        record.save_s = time.perf_counter() - t0
        return record

    def wait_for_snapshot(self) -> CheckpointRecord | None:  # type: ignore[override]
        """Blocks until the state being saved is staged and may change: call it right
        before `optimizer.step()`. Returns the record of that save, or None."""
        flight = self._inflight
        if flight is None or flight.staged:
            return None
        t0 = time.perf_counter()
        try:
            flight.response.staging_completion.result()  # blocks until the copy is done
        except DCP_ERRORS as e:
            flight.record.error = f"staging step {flight.record.step} failed: {_describe(e)}"
        self._staged(flight)
        flight.record.wait_s = time.perf_counter() - t0
        return flight.record

    def _staged(self, flight: _InFlight) -> None:
        flight.staged = True
        end = flight.staged_at if flight.staged_at is not None else time.perf_counter()
        flight.record.snapshot_s = end - flight.start

    def _finish(self, block: bool) -> None:
        """Account the save in flight once its upload is done (waiting for it when
        `block`): its time, its bytes; the step directory's fsync and retention."""
        flight = self._inflight
        if flight is None or not (block or flight.response.upload_completion.done()):
            return
        rec = flight.record
        try:
            # Blocks until every rank's data and the metadata are written and fsynced.
            flight.response.upload_completion.result()
        except DCP_ERRORS as e:
            rec.error = rec.error or f"dcp.async_save of step {rec.step} failed: {_describe(e)}"
        if not flight.staged:
            self._staged(flight)
        end = flight.uploaded_at if flight.uploaded_at is not None else time.perf_counter()
        rec.persist_s = end - flight.start
        if rec.error is None:
            self._committed(flight.path)
            rec.bytes_per_rank = _bytes_per_rank(flight.path, self.groups.world_size)
        self._inflight = None
        self._done.append(rec)

    def _committed(self, path: Path) -> None:
        """Rank 0, once a step is complete: make its rename durable, prune old steps.
        Not collective; a failure is shared with every rank at the next save."""
        if self.groups.rank != 0:
            return
        try:
            fsync_dir(path)
            fsync_dir(self.root)
            self._retain()
        except OSError as e:
            self._error = f"rank 0 could not finish {path}: {e}"

    def _retain(self) -> None:
        """Keep the newest `keep_last` complete steps; delete older ones and incomplete
        directories older than the newest complete step (a newer one may be in flight)."""
        if self.keep_last is None:
            return
        complete, incomplete = dcp_steps(self.root)
        if not complete:
            return
        doomed = complete[:-self.keep_last] + [s for s in incomplete if s < complete[-1]]
        for step in sorted(doomed):
            # Drop the metadata first: a crash mid-delete leaves an incomplete directory.
            (dcp_step_dir(self.root, step) / METADATA).unlink(missing_ok=True)
            shutil.rmtree(dcp_step_dir(self.root, step))

    @property
    def pending(self) -> bool:
        """Whether a save is in flight or finished but not yet drained."""
        return self._inflight is not None or bool(self._done)

    def drain_completed(self) -> list[CheckpointRecord]:
        """Saves whose upload has finished (or that failed), oldest first. Not collective:
        an upload is done on every rank once it is done on one (DCP ends a save with a
        collective after the metadata is written)."""
        self._finish(block=False)
        out, self._done = self._done, []
        return out

    def flush(self) -> None:
        """Wait for the save in flight; its record is then in `drain_completed()`."""
        self._finish(block=True)

    def close(self) -> None:
        """Wait for the save in flight, release the staging buffers, end DCP's checkpoint
        process. Collective. Raises an error no save has reported yet."""
        g = self.groups
        self.flush()
        errors = [e for e in _all_gather(self._error, g.side_group, g) if e]
        self._error = None
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        if self._uses_process:
            _stop_checkpoint_process()
        super().close()
        if errors:
            raise CheckpointError("; ".join(errors))

    # -- recovery --------------------------------------------------------------------------

    def _placeholders(self, path: Path) -> dict[str, torch.Tensor]:
        """Empty tensors for the keys this rank restores, shaped as the checkpoint holds
        them: its parameters, the optimizer state of the parameters it owns (whatever
        the optimizer holds now: AdamW creates state lazily at the first step), its RNG.
        Raises IncompatibleCheckpointError for a key the model has and the step lacks."""
        stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        params = flatten_params(self.model, self.spec)
        experts = self.spec.by_name()
        owned: set[str] = set()
        for name in self.optimizer.owned_names():
            if name in experts:
                ep = experts[name]
                owned.update(expert_key("param", ep.stem, gid) for gid in ep.global_ids)
            else:
                owned.add(dense_key("param", name))
        keys = list(params)
        keys += [k for k in stored if k.startswith("optim/") and _param_key(k) in owned]
        if rng_key(self.groups.rank) in stored:  # absent after a restart on more ranks
            keys.append(rng_key(self.groups.rank))
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

    def _try_step(self, step: int) -> tuple[tuple[str, str], dict[str, Any] | None]:
        """Collective: load one step into this rank's model and optimizer. Everything is
        read before anything is installed, so a step that fails leaves the model as it
        was for the next older one. Returns every rank's agreed status and the meta."""
        g = self.groups
        path = dcp_step_dir(self.root, step)
        status, meta, state = ("ok", ""), None, None
        try:
            # This rank alone: nothing collective before the ranks agree.
            meta = check_dcp_step(self.root, step, self.model_meta)
            state = self._placeholders(path)
        except IncompatibleCheckpointError as e:
            status = ("incompatible", str(e))
        except DCP_ERRORS as e:  # unreadable metadata: a corrupt step
            status = ("corrupt", f"{path}: {_describe(e)}")
        statuses = _all_gather(status, g.side_group, g)
        if all(s[0] == "ok" for s in statuses):
            assert state is not None
            try:
                dcp.load(state, storage_reader=dcp.FileSystemReader(path),
                         process_group=g.side_group, no_dist=not g.distributed)
                load_rank_state(DictReader(state), self.model, self.optimizer, self.spec,
                                g.rank)
            except IncompatibleCheckpointError as e:
                status = ("incompatible", str(e))
            except DCP_ERRORS as e:  # DCP raises on every rank when one fails to read
                status = ("corrupt", f"{path}: {_describe(e)}")
            statuses = _all_gather(status, g.side_group, g)
        for kind, message in statuses:
            if kind == "incompatible":
                raise IncompatibleCheckpointError(message)
        bad = next((m for kind, m in statuses if kind != "ok"), None)
        return ("ok", "") if bad is None else ("corrupt", bad), meta

    def restore(self) -> RecoveryReport | None:
        """Load the newest complete step (one with `.metadata`) every rank can read; None
        if there is none. Collective. DCP stores no checksums: a step is corrupt only when
        its metadata or files cannot be read, never because a byte flipped."""
        t0 = time.perf_counter()
        g = self.groups
        steps = [list(reversed(complete_dcp_steps(self.root)))]  # rank 0's list for all
        if g.distributed:
            dist.broadcast_object_list(steps, src=0, group=g.side_group)
        skipped = []
        for step in steps[0]:
            (kind, message), meta = self._try_step(step)
            if kind == "ok":
                assert meta is not None
                n, layers = self.spec.n_experts, self.spec.n_moe_layers
                return RecoveryReport(step, meta["extra"], "storage",
                                      time.perf_counter() - t0, 0, [0] * layers, 0.0, n, n,
                                      skipped)
            skipped.append(f"step {step}: {message}")
        if skipped:
            raise CorruptCheckpointError(
                f"{self.root}: no readable DCP checkpoint; every step failed: "
                f"{'; '.join(skipped)}")
        return None


def _bytes_per_rank(path: Path, world_size: int) -> list[int]:
    """Bytes of the data files each rank wrote (`__<rank>_<i>.distcp`); the metadata is
    not counted, as our manifests are not."""
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


def _checkpoint_process_state() -> str:
    """This process's DCP checkpoint process: "none" (not started yet), "alive", "dead".
    Reads DCP's private module global (torch 2.13)."""
    from torch.distributed.checkpoint import _async_process_executor as executor

    proc = getattr(executor, "_CHECKPOINT_PROCESS", None)
    if proc is None:
        return "none"
    return "alive" if proc._save_process.is_alive() else "dead"


def _stop_checkpoint_process() -> None:
    """End DCP's checkpoint process of this trainer process, as DCP itself does only when
    its handle is garbage collected at exit: ask it to terminate, then SIGTERM. Private
    API of torch 2.13 (the module global and the control message)."""
    from torch.distributed.checkpoint import _async_process_executor as executor

    proc = getattr(executor, "_CHECKPOINT_PROCESS", None)
    if proc is None:
        return
    executor._CHECKPOINT_PROCESS = None
    process = proc._save_process
    if process.is_alive():
        with contextlib.suppress(OSError):  # already gone
            proc._send(executor._CheckpointSaveProcessControlOpts.TERMINATE)
        process.join(CHECKPOINT_PROCESS_STOP_S)
    if process.is_alive():
        process.terminate()
        process.join()
