"""The contract every checkpoint engine keeps, and the results every engine returns.

    report = ckpt.restore()                  # RecoveryReport | None (a fresh start)
    start = report.step if report else 0
    ckpt.watch_routing(model)                # routed tokens counted for PLT, Dynamic-K
    for step in range(start + 1, steps + 1):
        loss = model(batch); loss.backward()
        ckpt.wait_for_snapshot()             # the only place training may wait
        optimizer.step(); optimizer.zero_grad()
        ckpt.maybe_save(step, extra_state={...}, final=step == steps)
        if ckpt.pending:                     # cheap: no work on ordinary steps
            for result in ckpt.drain_completed():
                log(result)
    ckpt.flush()                             # everything in flight is finished ...
    results = ckpt.drain_completed()         # ... and reported
    ckpt.close()                             # releases background work, raises its errors

moc's engines (`moc.Checkpointer`, `moc.TwoLevelCheckpointer`) count routed tokens
themselves: `ckpt.watch_routing(model)` once, before the loop, hooks the model's routers
(`moc.checkpoint.routing`); an engine that saves every expert (the DCP baseline) counts
nothing and returns None. `record_routing(counts)`, once a step after
`optimizer.step()`, is what a loop calls instead when a router cannot be hooked.

Three more calls serve fault drills and have do-nothing defaults: `wait_for_replicas()`,
`background_pids()` and `drop_node_memory()`. A trainer needs nothing else: `moc train`
holds a `CheckpointEngine` and never asks which one.

A failed checkpoint is logged and training goes on from the previous one; `max_failures`
(default 3) failed checkpoints in a row, or a failed final one, raise on the caller's
thread (`moc.checkpoint.failures`).

Engines: `moc.Checkpointer` (synchronous PEC with fully sharded writes),
`moc.TwoLevelCheckpointer` (a snapshot in memory + a background persist), and the
baselines in `moc.baselines` (blocking, PyTorch DCP). A synchronous engine's result is
in `drain_completed()` as soon as `save` returns; an asynchronous one's once its persist
has finished (or was skipped). Either way `save` returns nothing: a result is final only
once drained, so there is no half-filled record to misread.

The protocol is named `CheckpointEngine`, not `Checkpointer`: `moc.Checkpointer` is the
constructor users already call for the synchronous engine (docs/DECISIONS.md).
"""

from __future__ import annotations

import json
import math
from abc import abstractmethod
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from moc.checkpoint.plan.writes import imbalance


@dataclass(frozen=True)
class CheckpointResult:
    """One checkpoint, as every engine reports it once it is final."""

    step: int
    mode: str
    """The strategy that took it (pec, blocking, moc, dcp-sync, ...)."""
    k: int
    """K_pec in force: experts per MoE layer a partial checkpoint persists."""
    experts_saved: list[list[int]]
    """Global expert ids persisted per MoE layer (the first of a chain: all)."""
    save_s: float
    """Time the save call itself took."""
    wait_s: float = 0.0
    """Time `wait_for_snapshot` blocked for this checkpoint (asynchronous engines)."""
    bytes_per_rank: list[int] = field(default_factory=list)
    """Bytes each rank's file holds ([] when nothing was persisted)."""
    error: str | None = None
    """Why the checkpoint did not reach storage; None when it did (or was skipped)."""
    snapshot_s: float | None = None
    """Time the snapshot to host memory took (asynchronous engines; two-level: its
    capture and its seal)."""
    persist_s: float | None = None
    """Time the background persist took, write and commit (asynchronous engines)."""
    persist_skipped: bool = False
    """The snapshot was taken but not persisted (a persist was still running)."""
    k_snapshot: int | None = None
    """Experts per layer in the memory snapshot (two-level)."""
    k_snapshot_chosen: dict[str, Any] | None = None
    """Set when `k_snapshot="auto"` chose K_snapshot before this checkpoint: the choice
    and what it was measured from (window_s, plan_s, copy_Bps)."""
    replica_bytes: int | None = None
    """Bytes this rank sent to its peer node's memory (two-level across nodes; None:
    no replica)."""
    replica_s: float | None = None
    """Time this rank's replication round took, on the snapshot thread."""
    replica_error: str | None = None
    """Why this rank's replica, or the one it keeps for its peer, is not complete."""
    copy_Bps: float | None = None
    """This rank's snapshot capture bandwidth: its copies (two-level; on a CPU the
    checksums taken in the same pass are included)."""
    phases: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    """Where the checkpoint's time went (two-level): {"snapshot": this rank's snapshot
    thread, "persist": the persist process (rank 0: its node's files and the commit)},
    each {phase: [wall s, CPU s, page faults]} (`moc.checkpoint.phases`)."""
    persists_skipped_in_row: int = 0
    """Checkpoints in a row not persisted, this one included (two-level)."""
    storage_step: int | None = None
    """The newest step committed on storage when this checkpoint was planned (two-level;
    None: none yet, or an engine that does not say)."""
    storage_behind_steps: int | None = None
    """This checkpoint's step minus `storage_step`: the steps a crash would lose."""
    storage_behind_checkpoints: int | None = None
    """Checkpoints newer than `storage_step`, this one included (two-level)."""
    storage_behind_s: float | None = None
    """Seconds since the oldest checkpoint newer than `storage_step` was planned."""

    @property
    def cpu_s(self) -> dict[str, float]:
        """CPU seconds of this checkpoint's work, by where it ran ("snapshot",
        "persist"): what it took from training on a machine whose cores are busy."""
        return {where: sum(v[1] for v in p.values()) for where, p in self.phases.items()}

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def stall_s(self) -> float:
        """What training waited for this checkpoint: the save call plus the wait."""
        return self.save_s + self.wait_s

    @property
    def bytes(self) -> int:
        return sum(self.bytes_per_rank)

    @property
    def imbalance(self) -> float | None:
        """Busiest rank's bytes over the mean (1.0: every rank wrote the same); None
        when nothing was persisted."""
        return imbalance(self.bytes_per_rank) if self.bytes_per_rank else None

    @property
    def n_experts_saved(self) -> int:
        return sum(len(e) for e in self.experts_saved)

    def event(self) -> dict[str, Any]:
        """The checkpoint event of `moc train --metrics` (docs/guide/train.md, "Metrics events")."""
        return {"step": self.step, "stall_s": self.stall_s, "bytes": self.bytes,
                "bytes_per_rank": list(self.bytes_per_rank), "imbalance": self.imbalance,
                "mode": self.mode, "k": self.k, "experts_saved": self.n_experts_saved,
                "snapshot_s": self.snapshot_s, "persist_s": self.persist_s,
                "k_snapshot": self.k_snapshot, "persist_skipped": self.persist_skipped,
                "error": self.error,
                **({"copy_Bps": self.copy_Bps, "cpu_s": self.cpu_s, "phases": self.phases}
                   if self.phases else {}),
                "persists_skipped_in_row": self.persists_skipped_in_row,
                "storage_step": self.storage_step,
                "storage_behind_steps": self.storage_behind_steps,
                "storage_behind_checkpoints": self.storage_behind_checkpoints,
                "storage_behind_s": self.storage_behind_s,
                **({"replica_bytes": self.replica_bytes, "replica_s": self.replica_s,
                    "replica_error": self.replica_error}
                   if self.replica_bytes is not None or self.replica_error else {})}


@dataclass(frozen=True)
class RecoveryReport:
    step: int
    """The step restored (training continues after it)."""
    extra: dict[str, Any]
    """The loop state passed to `maybe_save(extra_state=...)` at that step."""
    source: str
    """Where the state came from: "storage", "memory" (every rank its own node's
    memory), "peer" (no rank needed storage, some used another node's memory), or
    "mixed" (some ranks from storage, some from memory)."""
    recovery_s: float
    lost_tokens: int | None
    """Expert token assignments whose updates this recovery lost (0 when every expert
    came back at `step`); None when unknown: some expert came back older than `step`
    and no routing was ever recorded (`record_routing`), so nothing says what it lost."""
    lost_per_layer: list[int] | None
    plt: float | None
    """Cumulative proportion of lost tokens of the run, this recovery included; None
    when unknown (see `lost_tokens`): never a 0 that was not measured."""
    k: int
    """K in force after this recovery (Dynamic-K may have raised it)."""
    k_before: int
    skipped: list[str] = field(default_factory=list)
    """Newer steps found corrupt and skipped, with the reason."""
    sources: dict[str, list[int]] = field(default_factory=dict)
    """The ranks that restored from each source ("memory", "peer", "storage"; a restore
    from storage: every rank under "storage"); empty for the baselines."""
    passed_over: str | None = None
    """Why a newer step was not restored, and what that saves and costs: some rank had
    only a partial copy of it, and an older step was exact on every rank (the two-level
    engine's `prefer="exact"`, its default). None: the newest step was restored."""


def checked_save(step: object, extra_state: object) -> dict[str, Any]:
    """Validate a save's arguments before anything is written; the loop state as it will
    be restored (a JSON round trip: a copy the caller may go on changing).

    `step` is a non-negative int. `extra_state` is None or a JSON object: str keys only
    (json would turn an int key into a string, and the restored state would differ from
    the saved one without a word), JSON values (no tensors: those belong to the model or
    optimizer), and a `"step"` key, if present, equal to `step` (a restore resumes after
    the manifest's step; a loop counter that disagrees with it is a bug).
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"save step must be an int >= 0, got {step!r}")
    if extra_state is None:
        return {}
    if not isinstance(extra_state, dict):
        raise ValueError(f"extra_state must be a dict (JSON object), got "
                         f"{type(extra_state).__name__}")
    _check_json(extra_state, "extra_state")
    if "step" in extra_state and extra_state["step"] != step:
        raise ValueError(f"extra_state['step'] is {extra_state['step']!r} but the step saved "
                         f"is {step}: a restore resumes after the saved step; keep other "
                         "counters under another key")
    return json.loads(json.dumps(extra_state))


def _check_json(value: object, path: str) -> None:
    if value is None or isinstance(value, (bool, int, str)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{path} is {value}: JSON has no NaN or infinity; store it as "
                             "a string or None")
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_json(v, f"{path}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{path} has the key {k!r} of type {type(k).__name__}: "
                                 "JSON keys are strings, and a restore would hand back "
                                 f"{str(k)!r}; use str keys")
            _check_json(v, f"{path}[{k!r}]")
        return
    raise ValueError(f"{path} is a {type(value).__name__}, which is not JSON: extra_state "
                     "holds the loop's JSON state (ints, floats, strings, lists, dicts); "
                     "tensors belong to the model, optimizer or a buffer")


@runtime_checkable
class CheckpointEngine(Protocol):
    """What the training loop may call on any checkpoint engine, and nothing else.

    Engines subclass it explicitly: every method but `maybe_save` is abstract, so an
    engine that misses one cannot be built. Collective calls (`restore`, `save` /
    `maybe_save` on a checkpoint step, `flush`, `close`) are made by every rank, for the
    same steps, in the same order.
    """

    interval: int
    """Steps between checkpoints (`maybe_save`)."""

    @abstractmethod
    def restore(self, step: int | None = None) -> RecoveryReport | None:
        """Load the newest checkpoint every rank can restore into the model and the
        optimizer; None when there is none. Finishes any checkpoint in flight first.

        `step`: roll back to that step instead (it must be a complete checkpoint on
        storage, ValueError otherwise): the run continues from it, and a training engine
        sets every newer step aside (`step-N.rolledback`), so that no later save
        replaces a step they read. Without it, the saves of an engine must be after the
        directory's newest step: restore() first, or the save is refused."""

    @abstractmethod
    def record_routing(self, counts: torch.Tensor) -> None:
        """Tokens this rank routed to each (MoE layer, global expert) this step."""

    @abstractmethod
    def wait_for_snapshot(self) -> None:
        """Block until the state being checkpointed may change: call it right before
        `optimizer.step()`. Raises, once, what the background copy met."""

    @abstractmethod
    def save(self, step: int, extra_state: dict[str, Any] | None = None, *,
             final: bool = False) -> None:
        """Checkpoint `step` (with the JSON loop state `extra_state`, see
        `checked_save`); the result comes out of `drain_completed()`.

        `final`: the last checkpoint of the run. It is complete (every expert of every
        MoE layer, whatever K is), it is persisted (never skipped), and if it fails,
        `flush`/`close` raise: whoever continues or exports a finished run gets every
        expert from the same step."""

    def maybe_save(self, step: int, extra_state: dict[str, Any] | None = None, *,
                   final: bool = False) -> bool:
        """`save(step, ...)` when `step` is a multiple of `interval` or `final` (the
        last step of the run); whether it did."""
        if step % self.interval and not final:
            return False
        self.save(step, extra_state, final=final)
        return True

    @property
    @abstractmethod
    def pending(self) -> bool:
        """Whether a checkpoint is in flight or finished but not drained yet."""

    @abstractmethod
    def drain_completed(self) -> list[CheckpointResult]:
        """Checkpoints that are final, oldest first; each is returned once."""

    @abstractmethod
    def flush(self) -> None:
        """Finish every checkpoint in flight; their results are then drainable."""

    @abstractmethod
    def host_memory(self) -> dict[str, int]:
        """Host memory the engine holds for checkpoints, in bytes, by what it is for
        (e.g. `ckpt_host_bytes`, `snapshot_bytes`); {} when it holds none it can count."""

    def watch_routing(self, model: torch.nn.Module, **options: Any) -> Any:
        """Count the tokens `model`'s routers send to each expert, by forward hooks, for
        PLT and Dynamic-K: once, before the loop. moc's engines return the recorder
        (`moc.RoutingRecorder`, whose `remove()` ends it); an engine that saves every
        expert of every checkpoint counts nothing and returns None."""
        return None

    def wait_for_replicas(self) -> None:
        """Block until this rank's copies to other nodes' memory in flight are done
        (local: no collective). Engines that keep no replicas return at once."""

    def background_pids(self) -> list[int]:
        """Process ids of the background processes this rank runs for checkpoints (a
        persist process): for fault drills and monitoring; [] when it runs none."""
        return []

    def drop_node_memory(self) -> None:
        """Delete what the engine keeps in this node's memory, as losing the machine
        would (fault drills); nothing for an engine that keeps none."""

    @abstractmethod
    def close(self) -> None:
        """Flush, stop background work, release its resources; raise any error it met
        that was not raised yet."""

    def abandon(self) -> None:
        """The job's process groups are gone (a peer was lost and they were destroyed,
        for in-job recovery): stop the engine's background work and release its
        resources without a collective and without raising, keeping everything a
        restore reads (snapshots in memory, storage). The engine is not used again; a
        new one is built on the new process groups and restores. Nothing here: an
        engine with background work or a lock (every engine of moc's) overrides it."""
