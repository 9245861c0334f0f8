"""Two-level checkpointing: PEC + sharding + a snapshot in memory + a background persist.

    save(s)              hand step s to the snapshot thread and return at once; that
                         thread shares persist results and token counts (one small
                         all-reduce), chooses the experts and a free slot, and copies
                         this rank's state into node-local shared memory
    wait_for_snapshot()  right before optimizer.step(): blocks only if the copy is not
                         done yet; the stall is max(0, copy time - forward/backward time)
    persist process      writes the K_persist experts + non-expert share of each rank
                         from shared memory to storage and commits the manifest

The snapshot is complete (every expert: K_snapshot = N). Host memcpy is cheap, and a
complete snapshot makes recovery from a process crash exact: no tokens are lost. Only
what reaches storage is partial (K_persist), which bounds what a node loss costs.

Recovery: the ranks agree on the newest step every rank can restore. If every rank holds
a complete, checksum-clean snapshot of a step at least as new as the newest persisted
one, they restore from memory ("memory"); otherwise from storage ("storage").

When a new checkpoint comes while the previous persist is still running, `persist_policy`
decides: "skip" (the default) takes the snapshot but does not persist it, and the skip
is reported; "wait" makes the snapshot wait until the running persist is done, so
training waits for it in `wait_for_snapshot()`.
"""

from __future__ import annotations

import contextlib
import copy
import os
import pickle
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moc.checkpoint.checkpointer import Checkpointer, RecoveryReport, _all_gather
from moc.checkpoint.errors import CheckpointError
from moc.checkpoint.manifest import Manifest
from moc.checkpoint.persist import PersistRequest, connect
from moc.checkpoint.recovery import CheckpointReader, DictReader, load_rank_state
from moc.checkpoint.selection import SelectionContext, select_experts
from moc.checkpoint.snapshot import (
    N_SLOTS,
    SnapshotHandle,
    SnapshotJob,
    SnapshotStore,
    default_job_id,
    job_dir,
    remove_job,
    remove_stale_jobs,
)
from moc.checkpoint.spec import parse_expert_key
from moc.checkpoint.storage import complete_steps, remove_abandoned
from moc.checkpoint.tokens import PLTReport

PERSIST_POLICIES = ("skip", "wait")
PERSIST_GONE = "the persist process exited; checkpoints are kept in memory only"
PERSIST_TIMEOUT_S = 600.0
"""How long rank 0 waits for a persist that must finish (wait policy, flush, close)
before declaring the persist process hung; longer than writing any sane checkpoint."""


@dataclass
class CheckpointRecord:
    """One checkpoint as the training loop sees it, complete once its snapshot is taken
    and its persist has finished (or was skipped)."""

    step: int
    k: int
    experts_saved: int
    save_s: float
    """Time the save call itself took (choosing, planning, starting the copy)."""
    wait_s: float = 0.0
    """Time wait_for_snapshot blocked."""
    snapshot_s: float | None = None
    persist_skipped: bool = False
    persist_s: float | None = None
    bytes_per_rank: list[int] | None = None
    error: str | None = None
    k_snapshot: int | None = None
    """Experts per layer in this checkpoint's snapshot."""
    k_snapshot_chosen: dict[str, Any] | None = None
    """Set when `k_snapshot="auto"` chose K_snapshot before this checkpoint: the choice
    and what it was measured from (window_s, copy_Bps)."""

    @property
    def stall_s(self) -> float:
        return self.save_s + self.wait_s


class TwoLevelCheckpointer(Checkpointer):
    def __init__(self, model: nn.Module, optimizer: object, directory: str | Path, *,
                 job: str | None = None, persist_policy: str = "skip",
                 k_snapshot: int | str | None = None, **kwargs: Any) -> None:
        if persist_policy not in PERSIST_POLICIES:
            raise ValueError(f"persist_policy must be one of {', '.join(PERSIST_POLICIES)}, "
                             f"got {persist_policy!r}")
        kwargs.setdefault("mode", "moc")
        super().__init__(model, optimizer, directory, sharded=True, **kwargs)
        g = self.groups
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", g.world_size))
        if local_world != g.world_size:
            raise ValueError("two-level checkpointing runs on one node in this release "
                             f"({g.world_size} ranks, {local_world} on this node); use "
                             "--ckpt-mode pec across nodes")
        self.job = job or default_job_id(directory)
        self.persist_policy = persist_policy
        n = self.spec.n_experts
        if k_snapshot in (None, "all", "auto"):
            self.k_snapshot = n
        elif isinstance(k_snapshot, int) and 1 <= k_snapshot:
            self.k_snapshot = min(k_snapshot, n)
        else:
            raise ValueError(f"k_snapshot must be an integer >= 1, 'all' or 'auto', "
                             f"got {k_snapshot!r}")
        self.auto_k_snapshot = k_snapshot == "auto"
        self._k_snapshot_choice: dict[str, Any] | None = None  # rank 0's measurement
        self._snap_index = 0  # partial snapshots so far (their sequential rotation's c)
        self._saved_at_time: float | None = None  # when save() returned
        self.k_snapshot_chosen: dict[str, Any] | None = None
        self.store = SnapshotStore(self.job, g.rank)
        self._handle: SnapshotHandle | None = None
        self._newest_slot: int | None = None  # the newest complete snapshot: recovery
        self._persist_slot: int | None = None  # read by the persist process
        self._persist_step: int | None = None  # the persist in flight
        self._persist_step_of_slot: int | None = None
        self._persist_alive = True  # rank 0's view, shared at each save
        self._records: dict[int, CheckpointRecord] = {}
        self._done: list[tuple] = []  # rank 0: persist results not yet shared
        self._send_lock = threading.Lock()
        # Held by the snapshot thread while it plans a checkpoint (`_plan`: the chain and
        # persist state change), tried by the caller's thread in drain_completed(). The
        # caller's other uses of that state (flush, restore) come after wait_for_snapshot,
        # when no plan runs.
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        if g.rank == 0:
            remove_stale_jobs(keep=self.job)
            jdir = job_dir(self.job)
            jdir.mkdir(parents=True, exist_ok=True)
            # The job's owner outlives restarts of the workers: torchrun's agent.
            owner = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else os.getpid()
            (jdir / "owner.pid").write_text(str(owner))
            self._process = subprocess.Popen(
                [sys.executable, "-c", "import sys; from moc.checkpoint.persist import serve; "
                 "serve(sys.argv[1], sys.argv[2], int(sys.argv[3]))",
                 self.job, str(self.root), str(os.getpid())])
        self._conn: Connection = connect(job_dir(self.job))
        self._send(("hello", g.rank))

    def _send(self, msg: tuple) -> None:
        with self._send_lock:  # the snapshot thread and the caller share the connection
            self._conn.send(msg)

    # -- persist results -------------------------------------------------------------------

    def _receive(self, block: bool) -> None:
        """Rank 0: take the persist results that have arrived (all of them, waiting for
        the one in flight when `block`) into `_done`, to be shared at the next save."""
        while self._persist_step is not None and (block or self._conn.poll()):
            try:
                # Blocks until the running persist reports, for PERSIST_TIMEOUT_S at most.
                if not self._conn.poll(PERSIST_TIMEOUT_S):
                    raise TimeoutError
                msg = self._conn.recv()
            except (EOFError, OSError):  # TimeoutError is an OSError
                msg = ("done", self._persist_step, False, PERSIST_GONE, 0.0, None)
                self._persist_alive = False
                if self._process is not None:
                    self._process.kill()  # hung (a stuck disk): never let it commit late
            self._done.append(msg)
            self._record_persist(msg)
            if msg[1] == self._persist_step:
                self._persist_step = None

    def _record_persist(self, msg: tuple) -> None:
        _, step, ok, error, seconds, bytes_per_rank = msg
        rec = self._records.get(step)
        if rec is not None:
            rec.error = None if ok else error
            rec.bytes_per_rank = bytes_per_rank
            # Last: the caller's thread may drain the record as soon as this is set.
            rec.persist_s = seconds

    def _share_done(self, block: bool, counts: torch.Tensor | None = None) -> None:
        """Collective: every rank learns the same persist results and applies them; with
        `counts` (this rank's routed tokens since the last save), the same collective
        also sums them into the ledger."""
        g = self.groups
        if g.rank == 0:
            self._receive(block)
        share = (self._done, self._persist_step, self._persist_alive, self._k_snapshot_choice)
        done, in_flight, alive, choice = _exchange(share, counts, g)
        if counts is not None:
            self.ledger.add_synced(counts)
        self._persist_alive = alive
        self._k_snapshot_choice = None
        if choice is not None:
            self.k_snapshot = choice["k_snapshot"]
            self.k_snapshot_chosen = choice
        self._done = []
        for msg in done:
            if g.rank != 0:
                self._record_persist(msg)
            if msg[1] == self._persist_step_of_slot:
                self._persist_slot = None
            if msg[2]:
                self._on_committed(msg[1])
        self._persist_step = in_flight

    def _on_committed(self, step: int) -> None:
        """The chain now continues from `step`'s manifest."""
        manifest = Manifest.load(self.root, step)
        self._manifest = manifest
        self._index = int(manifest.policy.get("index", -1)) + 1
        self.ledger.at_save = torch.tensor(manifest.tokens["at_save"], dtype=torch.int64)
        self._saved_at = self._newest_copies(manifest.entries)
        if self._retention is not None:
            self._retention.request()

    @property
    def pending(self) -> bool:
        """Whether a checkpoint is still being taken or persisted."""
        return bool(self._records)

    def drain_completed(self) -> list[CheckpointRecord]:
        """Checkpoints whose snapshot is taken and whose persist has finished or was
        skipped. Rank 0 hears of persists; the other ranks report snapshots only."""
        # Rank 0 reads the persist results that have arrived, unless the snapshot
        # thread is sharing them right now (it takes them itself then).
        if self.groups.rank == 0 and self._lock.acquire(blocking=False):
            try:
                self._receive(block=False)
            finally:
                self._lock.release()
        out = []
        for step in sorted(self._records):
            rec = self._records[step]
            persisted = (rec.persist_skipped or rec.persist_s is not None
                         or self.groups.rank != 0)
            if rec.snapshot_s is not None and persisted:
                out.append(self._records.pop(step))
        return out

    # -- saving ----------------------------------------------------------------------------

    def save(self, step: int, extra_state: dict[str, Any] | None = None  # type: ignore[override]
             ) -> CheckpointRecord:
        """Start a checkpoint of `step` and return at once.

        This thread only takes what cannot wait (the routed-token counts and the RNG
        state of this step, a copy of `extra_state`) and hands the checkpoint to the
        snapshot thread, which does the rest behind the next forward and backward pass:
        the collective that shares persist results and sums the token counts, choosing
        the experts, planning the writes, the copy, and the persist request. Training
        waits only in `wait_for_snapshot()`, and only if all that outlasts the window.
        The record's fields are final once `drain_completed()` returns it."""
        t0 = time.perf_counter()
        if step in self._records:
            raise ValueError(f"step {step} is already being checkpointed (its persist is "
                             "not reported yet); save each step once")
        self.wait_for_snapshot()  # the previous checkpoint's copy (normally done)
        record = CheckpointRecord(step, self.k, 0, 0.0)
        self._records[step] = record
        counts = self.ledger.take_pending()
        rng = torch.get_rng_state()
        extra = copy.deepcopy(extra_state) if extra_state else {}
        ready = None
        if any(p.is_cuda for p in self.model.parameters()):
            ready = torch.cuda.Event()  # the copy waits for the work queued so far
            ready.record(torch.cuda.current_stream())
        self._handle = SnapshotHandle(
            self.store, step, lambda: self._plan(record, counts, rng, extra), ready)
        record.save_s = time.perf_counter() - t0
        self._saved_at_time = time.perf_counter()
        return record

    def _plan(self, record: CheckpointRecord, counts: torch.Tensor, rng: torch.Tensor,
              extra: dict[str, Any]) -> SnapshotJob:
        """On the snapshot thread: what `record.step`'s snapshot copies and where, and
        its persist request. Collective (one small all-reduce), entered by every rank in
        the order of their saves."""
        with self._lock:
            return self._plan_locked(record, counts, rng, extra)

    def _plan_locked(self, record: CheckpointRecord, counts: torch.Tensor,
                     rng: torch.Tensor, extra: dict[str, Any]) -> SnapshotJob:
        g, step = self.groups, record.step
        self._share_done(block=self.persist_policy == "wait", counts=counts)
        # Without a persist process (it died), training goes on with snapshots only:
        # each checkpoint is reported as not persisted, and memory still recovers crashes.
        persist_now = self._persist_step is None and self._persist_alive
        selected = self._select(step)
        prev = self._manifest.entries if self._manifest is not None else {}
        wanted = self._wanted([set(s) for s in selected], prev, step)
        state = self._local_state(rng)
        write = self._sharded_keys(wanted, state) if persist_now else []
        written = (selected if prev else
                   [list(range(self.spec.n_experts)) for _ in range(self.spec.n_moe_layers)])
        record.k = self.k
        record.experts_saved = sum(len(e) for e in written)
        record.persist_skipped = not persist_now
        record.error = None if self._persist_alive else PERSIST_GONE
        slot = next(s for s in range(N_SLOTS) if s not in (self._newest_slot,
                                                             self._persist_slot))
        held = list(state)
        snapshot_experts = self._snapshot_experts(prev, written if persist_now else None)
        snapshot = self._snapshot_keys(state, snapshot_experts, set(write))
        meta = {"extra": extra, "ledger": self.ledger.to_json(), "k": self.k,
                "lost_base": self._lost_base.tolist(), "snap_index": self._snap_index,
                "k_snapshot": self.k_snapshot, "model": self.model_meta,
                "layout": {"world_size": g.world_size, "ep": g.layout.ep}}
        record.k_snapshot = self.k_snapshot
        record.k_snapshot_chosen, self.k_snapshot_chosen = self.k_snapshot_chosen, None
        self._snap_index += 1

        def on_done(header: Any) -> None:  # on the snapshot thread
            if persist_now:
                # A dead persist process is noticed by rank 0 and shared at the next save;
                # the snapshot itself is complete either way.
                with contextlib.suppress(OSError):
                    self._send(("ready", g.rank, step, slot, write, held))

        def on_error(error: BaseException) -> None:  # on the snapshot thread
            if persist_now:
                # The persist process gives up on this step instead of waiting for a
                # snapshot that will never be ready; the chain goes on from the last one.
                with contextlib.suppress(OSError):
                    self._send(("failed", g.rank, step, f"{type(error).__name__}: {error}"))

        if persist_now:
            self._persist_slot, self._persist_step_of_slot = slot, step
            self._persist_step = step
            if g.rank == 0:
                prev_step = self._manifest.step if self._manifest is not None else None
                template = self._template(step, extra, written)
                with contextlib.suppress(OSError):  # reported as failed by _receive
                    self._send(("persist", PersistRequest(step, prev_step, template,
                                                          g.world_size)))
        return SnapshotJob(slot, snapshot, meta, sizing=state, on_done=on_done,
                           on_error=on_error)

    def _snapshot_experts(self, prev: dict, persisted: list[list[int]] | None
                          ) -> list[set[int]]:
        """Experts per layer in this snapshot: K_snapshot of them in sequential rotation,
        plus those this checkpoint persists (the persist reads them from the snapshot);
        all of them when K_snapshot = N or the chain has no older copy yet."""
        spec = self.spec
        if not prev or self.k_snapshot >= spec.n_experts:
            return [set(range(spec.n_experts)) for _ in range(spec.n_moe_layers)]
        ctx = SelectionContext(self._snap_index, spec.n_experts, spec.n_moe_layers,
                               self.k_snapshot, ep=self.groups.layout.ep)
        chosen = [set(e) for e in select_experts("sequential", ctx)]
        for m, extra in enumerate(persisted or []):
            chosen[m].update(extra)
        return chosen

    def _snapshot_keys(self, state: dict[str, torch.Tensor], experts: list[set[int]],
                       write: set[str]) -> dict[str, torch.Tensor]:
        out = {}
        for key, t in state.items():
            parsed = parse_expert_key(key)
            if parsed is None or key in write or parsed[2] in experts[self._stems[parsed[1]]]:
                out[key] = t
        return out

    def _template(self, step: int, extra_state: dict[str, Any] | None,
                  written: list[list[int]]) -> dict[str, Any]:
        """The manifest of `step` but its entries (the persist process adds them)."""
        g = self.groups
        return {
            "step": step, "mode": self.mode,
            "layout": {"world_size": g.world_size, "ep": g.layout.ep},
            "model": self.model_meta, "extra": extra_state or {},
            "experts": {"n_experts": self.spec.n_experts,
                        "n_moe_layers": self.spec.n_moe_layers, "stems": self._stems},
            "policy": {**self.policy.to_dict(), "k": self.k, "index": self._index,
                       "lost_base": self._lost_base.tolist()},
            "experts_saved": {str(m): list(e) for m, e in enumerate(written)},
            "tokens": {**self.ledger.to_json(),
                       "at_save": self._at_save_after(written).tolist()},
        }

    def wait_for_snapshot(self) -> CheckpointRecord | None:  # type: ignore[override]
        """Blocks until the snapshot being taken is complete: the only place training
        waits on a checkpoint. Returns its record, or None when nothing was pending."""
        handle = self._handle
        if handle is None:
            return None
        t0 = time.perf_counter()
        window = t0 - self._saved_at_time if self._saved_at_time is not None else None
        try:
            header = handle.wait()
        except BaseException:
            # Raised once, here: the checkpointer stays usable (restore, close), and the
            # failed checkpoint is not reported again as pending.
            self._handle = None
            self._records.pop(handle.step, None)
            raise
        self._handle = None
        self._newest_slot = handle.slot
        if self.auto_k_snapshot and window is not None:
            # Measured once, on the first snapshot (a complete one), and shared by rank 0
            # at the next save so that every rank uses the same K_snapshot.
            self.auto_k_snapshot = False
            if self.groups.rank == 0:
                self._k_snapshot_choice = self._size_snapshot(
                    header, handle.seconds, window, handle.plan_s)
        rec = self._records.get(handle.step)
        if rec is not None:
            rec.wait_s = time.perf_counter() - t0
            rec.snapshot_s = handle.seconds
        return rec

    def _size_snapshot(self, header: Any, seconds: float, window: float, plan_s: float
                       ) -> dict[str, Any]:
        """The paper's adaptive configuration: the largest K_snapshot whose copy still
        hides behind a forward and backward pass, from the copy just measured (its bytes
        and time) and the time training ran meanwhile (save() returning to
        wait_for_snapshot()) less the time the snapshot thread spent planning before the
        copy. Never below K_persist: the persist reads from it."""
        nbytes = {k: torch.Size(e.shape).numel() * _itemsize(e.dtype)
                  for k, e in header.entries.items()}
        dense = sum(b for k, b in nbytes.items() if parse_expert_key(k) is None)
        experts: dict[tuple[int, int], int] = {}
        for k, b in nbytes.items():
            parsed = parse_expert_key(k)
            if parsed is not None:
                at = (self._stems[parsed[1]], parsed[2])
                experts[at] = experts.get(at, 0) + b
        per_k = (sum(experts.values()) / max(1, len(experts))) * self.spec.n_moe_layers
        bandwidth = sum(nbytes.values()) / max(seconds, 1e-9)
        budget = bandwidth * max(0.0, window - plan_s) - dense
        k = int(budget // per_k) if per_k else self.spec.n_experts
        floor = min(self.k, self.spec.n_experts)
        k = max(floor, min(self.spec.n_experts, k))
        return {"k_snapshot": k, "window_s": window, "plan_s": plan_s,
                "copy_Bps": bandwidth, "snapshot_s": seconds}

    # -- recovery --------------------------------------------------------------------------

    def restore(self) -> RecoveryReport | None:
        """Restore the newest step every rank can restore, each rank from its node's
        memory when its snapshot there is complete and its checksums hold, from storage
        otherwise ("memory", "mixed" or "storage"). Collective.

        A partial snapshot (K_snapshot < N) holds some experts only; each of the others
        comes from its newest copy in an older snapshot slot or in storage, and the
        tokens routed to it since that copy are counted as lost. When the replicas of an
        expert came back from different sources ("mixed"), the ones restored from
        storage take the weights of one restored from memory, so replicas never diverge.

        A checkpoint still being taken or persisted finishes first (a rollback in the
        middle of a run must not race the snapshot thread's collective, nor leave a
        persist that commits after the restore).
        """
        g = self.groups
        self.flush()
        if g.rank == 0:
            remove_abandoned(self.root)
        storage = _broadcast(complete_steps(self.root), g)
        newest_storage = storage[-1] if storage else None
        layout = {"world_size": g.world_size, "ep": g.layout.ep}
        if not self.root.exists():
            # The checkpoint directory is gone (a fresh start was asked for): snapshots
            # left in memory by an earlier run of it must not be resumed.
            self.store.invalidate_newer_than(-1)
        headers = {slot: h for slot, h in self.store.headers().items()
                   if h.meta.get("layout") == layout and h.meta.get("model") == self.model_meta}
        mine = {h.step: slot for slot, h in headers.items()}
        everyone = [set(m) for m in _all_gather(sorted(mine), g.side_group, g)]
        candidates = set().union(*everyone)
        for step in sorted(candidates, reverse=True):
            if newest_storage is not None and step < newest_storage:
                break
            if not all(step in m or step in storage for m in everyone):
                continue  # a rank without this snapshot has no other copy of it
            t0 = time.perf_counter()
            status, copies = "memory" if step in mine else "storage", None
            try:
                if status == "memory":
                    reader, copies = self._memory_reader(step, headers, newest_storage)
                else:
                    reader = CheckpointReader(self.root, Manifest.load(self.root, step))
                    copies = {k: (e.step, "storage")
                              for k, e in reader.manifest.entries.items()}
                load_rank_state(reader, self.model, self.optimizer, self.spec, g.rank)
            except Exception as e:  # any failure here is agreed on, never left to one rank
                status = f"failed: {e}"
            statuses = _all_gather(status, g.side_group, g)
            if all(st in ("memory", "storage") for st in statuses):
                if "storage" in statuses:
                    self._align_expert_replicas(statuses)
                source = "memory" if "storage" not in statuses else "mixed"
                meta = _broadcast_from(headers[mine[step]].meta if step in mine else None,
                                       statuses.index("memory"), g)
                self.store.invalidate_newer_than(step)
                return self._from_memory(step, mine.get(step), meta, headers, copies,
                                         time.perf_counter() - t0, newest_storage, source)
        self._newest_slot = self._persist_slot = None
        report = super().restore()
        self.store.invalidate_newer_than(report.step if report is not None else -1)
        return report

    @torch.no_grad()
    def _align_expert_replicas(self, statuses: list[str]) -> None:
        """Within each EDP group, replicas restored from storage take the expert weights
        of the first replica restored from memory (collective over the EDP group)."""
        g = self.groups
        if not g.distributed or g.layout.edp == 1:
            return
        members = g.layout.edp_groups()[g.ep_rank]
        from_memory = [r for r in members if statuses[r] == "memory"]
        if not from_memory or len(from_memory) == len(members):
            return
        experts = self.spec.by_name()
        for name, p in self.model.named_parameters():
            if name in experts:
                buf = p.detach().cpu().clone()
                dist.broadcast(buf, src=from_memory[0], group=g.edp_side_group)
                p.copy_(buf)

    def _memory_reader(self, step: int, headers: dict[int, Any], newest_storage: int | None
                       ) -> tuple[DictReader, dict[str, tuple[int, str]]]:
        """Every key at its newest copy no newer than `step`: the snapshot of `step`,
        older snapshots, the newest persisted manifest. Also returns, per key, the step
        and the source ("slot-i" or "storage") of the copy used."""
        tensors: dict[str, Any] = {}
        copies: dict[str, tuple[int, str]] = {}
        if newest_storage is not None:
            reader = CheckpointReader(self.root, Manifest.load(self.root, newest_storage))
            for key, entry in reader.manifest.entries.items():
                tensors[key] = _Lazy(reader, key)
                copies[key] = (entry.step, "storage")
        for slot, header in sorted(headers.items(), key=lambda kv: kv[1].step):
            if header.step > step:
                continue
            try:
                snap = self.store.read(slot, header)
            except CheckpointError:
                if header.step == step:
                    raise
                continue  # an older snapshot that does not verify is simply not used
            for key, t in snap.items():
                if key not in copies or header.step >= copies[key][0]:
                    tensors[key], copies[key] = t, (header.step, f"slot-{slot}")
        return _LazyDictReader(tensors), copies

    def _from_memory(self, step: int, slot: int | None, meta: dict[str, Any],
                     headers: dict[int, Any], copies: dict[str, tuple[int, str]],
                     seconds: float, newest_storage: int | None, source: str
                     ) -> RecoveryReport:
        """Account a recovery from memory (on some ranks at least): experts whose newest
        copy is older than `step` lose the tokens routed to them since."""
        g, spec = self.groups, self.spec
        self._newest_slot, self._persist_slot = slot, None
        self._snap_index = int(meta.get("snap_index", -1)) + 1
        self.ledger.load_json(meta["ledger"])
        cumulative = self.ledger.cumulative.clone()
        manifest = None
        if newest_storage is not None:
            self._on_committed(newest_storage)  # the chain continues from storage
            manifest = self._manifest
        # Per (layer, expert) held here: cumulative count at the copy restored.
        at_copy = torch.full_like(cumulative, -1)
        kind = self._tracked_kind()
        held = set(self._local_state())
        for key, (_, origin) in copies.items():
            parsed = parse_expert_key(key)
            if parsed is None or parsed[0] != kind or key not in held:
                continue
            m, e = self._stems[parsed[1]], parsed[2]
            if origin == "storage":
                value = int(manifest.tokens["at_save"][m][e]) if manifest else 0
            else:
                slot_meta = headers[int(origin.split("-")[1])].meta
                value = int(slot_meta["ledger"]["cumulative"][m][e])
            at_copy[m, e] = value if at_copy[m, e] < 0 else min(int(at_copy[m, e]), value)
        # Every rank knows only its own experts; together they know all of them.
        at_copy = torch.stack(_all_gather(at_copy, g.side_group, g)).max(dim=0).values
        at_copy = torch.where(at_copy < 0, cumulative, at_copy)
        lost_per_layer = (cumulative - at_copy).sum(dim=1)
        self.ledger.lost += lost_per_layer
        if self.policy.dynamic_k:
            self.k = max(self.k, int(meta["k"]))
            self._lost_base = torch.tensor(meta["lost_base"], dtype=torch.int64)
        k_before = self.k
        if (self.policy.dynamic_k and self.k < spec.n_experts
                and self.ledger.plt(self._lost_base) > self.policy.plt_threshold):
            self.k = min(2 * self.k, spec.n_experts)
            self._lost_base = self.ledger.lost.clone()
        plt = PLTReport(int(lost_per_layer.sum()), lost_per_layer.tolist(), self.ledger.plt())
        return RecoveryReport(step, meta["extra"], source, seconds, plt.lost_tokens,
                              plt.lost_per_layer, plt.plt, self.k, k_before, [])

    def host_memory(self) -> dict[str, int]:
        """This rank's shared memory for checkpointing (all slots) and one snapshot's
        size: the first is bounded by N_SLOTS times the second."""
        slots = [self.store.bin_path(s) for s in range(N_SLOTS)]
        sizes = [p.stat().st_size for p in slots if p.exists()]
        return {"ckpt_host_bytes": sum(sizes), "snapshot_bytes": max(sizes, default=0)}

    def flush(self) -> None:
        """Wait for the snapshot and the persist in flight (collective); their records
        are then in `drain_completed()`."""
        self.wait_for_snapshot()
        self._share_done(block=True)

    def close(self, keep_snapshots: bool = False) -> None:
        """Wait for the snapshot and the persist in flight, stop the persist process and
        remove this job's shared memory (unless `keep_snapshots`). Collective."""
        g = self.groups
        try:
            self.flush()
            if g.distributed:
                dist.barrier(group=g.side_group)
        finally:
            self._shutdown(keep_snapshots)
        super().close()

    def _shutdown(self, keep_snapshots: bool) -> None:
        """Stop the persist process (rank 0), the snapshot thread and the mappings, also
        after a failed flush."""
        g = self.groups
        try:
            if g.rank == 0:
                with contextlib.suppress(OSError):
                    self._send(("stop",))
                if self._process is not None:
                    try:
                        self._process.wait(timeout=60)
                    except subprocess.TimeoutExpired:
                        self._process.kill()
                        self._process.wait()
        finally:
            self.store.release()
            self._conn.close()
            if g.rank == 0 and not keep_snapshots:
                remove_job(self.job)


class _Lazy:
    """A key of a storage checkpoint, read (and checked) only if it is used."""

    def __init__(self, reader: CheckpointReader, key: str) -> None:
        self.reader, self.key = reader, key

    def load(self) -> torch.Tensor:
        return self.reader.get(self.key)


class _LazyDictReader(DictReader):
    def get(self, key: str) -> torch.Tensor:
        t = super().get(key)
        return t.load() if isinstance(t, _Lazy) else t


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def _broadcast_from(obj: Any, src: int, groups) -> Any:
    if not groups.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=groups.side_group)
    return box[0]


SHARE_BYTES = 8192
"""Room for rank 0's pickled persist results inside the all-reduce that sums the token
counts; results that do not fit (long error messages) take a second collective."""


def _exchange(share: Any, counts: torch.Tensor | None, groups) -> Any:
    """Rank 0's `share` to every rank and `counts` summed over ranks (in place), in one
    all-reduce on the gloo side group instead of three collectives (a broadcast of the
    pickled size, one of the bytes, an all-reduce of the counts): a checkpoint's save()
    pays for each collective in stall. Rank 0's bytes travel as int64 words that every
    other rank contributes as zeros, so the sum is rank 0's bytes, exactly."""
    if not groups.distributed:
        return share
    n = 0 if counts is None else counts.numel()
    buf = torch.zeros(n + 1 + SHARE_BYTES // 8, dtype=torch.int64)
    if counts is not None:
        buf[:n] = counts.flatten()
    if groups.rank == 0:
        data = pickle.dumps(share)
        if len(data) <= SHARE_BYTES:
            buf[n] = len(data)
            words = buf[n + 1:].view(torch.uint8)
            words[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            buf[n] = -1
    dist.all_reduce(buf, group=groups.side_group)
    if counts is not None:
        counts.copy_(buf[:n].view(counts.shape))
    length = int(buf[n])
    if length < 0:
        return _broadcast(share, groups)
    return pickle.loads(buf[n + 1:].view(torch.uint8)[:length].numpy().tobytes())


def _broadcast(obj: Any, groups) -> Any:
    if not groups.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=groups.side_group)
    return box[0]
