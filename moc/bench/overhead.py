"""`moc bench overhead`: what checkpointing costs training, each strategy in turn, one run.

Every strategy trains the same model on the same data with the same seed, W ranks, a
checkpoint every `interval` steps, and a SIGKILL of the last rank (W - 1: rank 0 itself
on one process) at the last step so that the restart measures recovery (from memory
where the strategy keeps snapshots). Strategies:

    none            no checkpoints: the reference step time
    blocking        Megatron-DeepSpeed style: training waits while rank 0 and EP group 0
                    write every expert
    moc-base-async  two levels (snapshot in memory, background persist) without PEC:
                    every expert persisted
    moc             two levels + PEC (K_persist = 1, a complete snapshot) + sharding

Per strategy: median and p90 stall per checkpoint, median step time of steps without and
with a checkpoint, throughput against `none` (over all steps, and in the steady state
after the first checkpoints' one-time costs), bytes per checkpoint, per-rank imbalance,
persist time, restore time from storage and from memory, the fault's downtime (from the
last step before it to the first after it: detection, restart, restore; `moc simulate`
takes it for R), and the host memory that checkpointing holds.

Each strategy's row starts with its checkpoint count: the steps it checkpointed against
the steps due (`moc.train.metrics.checkpoint_counts`: every save ends in a `checkpoint`
or a `checkpoint_failed` event), with the failed ones and the skipped persists. A ratio
between strategies (vs blocking, throughput against `none`, CPU against `none`) is
printed only where the counts are equal: a strategy that wrote fewer checkpoints did
less work, and the notes under the table say so instead.

Under "limits", the same run measures the disk's sequential write bandwidth with fsync,
the host's memcpy bandwidth and, where torch sees CUDA, the device-to-host copy into
pinned and into pageable host memory, with each strategy's snapshot copy as a share of
the pinned figure (the bound of a GPU snapshot); "n/a (no GPU)" otherwise.
"""

from __future__ import annotations

import itertools
import mmap
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moc.bench.plots import publish, train_run
from moc.cliparse import OneLineParser
from moc.progress import progress
from moc.train.cli_args import default_device
from moc.train.config import TrainConfig, in_checkpoint_block
from moc.train.metrics import checkpoint_counts

STRATEGIES: dict[str, list[str]] = {
    "none": ["--ckpt-mode", "none"],
    "blocking": ["--ckpt-mode", "blocking"],
    "dcp-sync": ["--ckpt-mode", "dcp-sync"],
    "dcp-async": ["--ckpt-mode", "dcp-async"],
    "moc-base-async": ["--ckpt-mode", "moc", "--k-persist", "all"],
    "moc": ["--ckpt-mode", "moc", "--k-persist", "1", "--k-snapshot", "auto",
            "--k-replica", "none"],
    # Across nodes only (--nodes > 1): moc with a peer replica of every snapshot in the
    # next node's memory.
    "moc-peers": ["--ckpt-mode", "moc", "--k-persist", "1", "--k-snapshot", "auto",
                  "--k-replica", "all"],
}
PEERS = ("moc-peers",)
"""Strategies that need more than one node."""
SYNCHRONOUS = ("blocking", "dcp-sync")
"""Strategies that write while training waits: their persist time is the stall."""

WARMUP_CHECKPOINTS = 3
"""Checkpoints before the steady state: one-time costs (reserving the snapshot slots,
the chain's first persist of every expert, the persist process starting) fall there."""


def disk_write_bandwidth(directory: Path, nbytes: int = 256 << 20) -> float:
    """Sequential write with fsync, bytes per second."""
    path = directory / "disk-probe.bin"
    block = os.urandom(8 << 20)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(nbytes // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - t0
    path.unlink()
    return nbytes / seconds


def disk_read_bandwidth(directory: Path, nbytes: int = 256 << 20) -> float:
    """Sequential read from the disk, not the page cache: O_DIRECT into an aligned buffer
    where the filesystem supports it, else after asking the kernel to drop the file's
    cached pages (posix_fadvise DONTNEED, which works once the data is on disk)."""
    path = directory / "disk-probe-read.bin"
    block = os.urandom(8 << 20)
    with open(path, "wb") as f:
        for _ in range(nbytes // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    buf = mmap.mmap(-1, len(block))  # page-aligned, as O_DIRECT needs
    try:
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
            os.preadv(fd, [buf], 0)
        except OSError:  # no O_DIRECT here (tmpfs, some overlays)
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        offset = 0
        while offset < nbytes:
            n = os.preadv(fd, [buf], offset)
            if n <= 0:
                break
            offset += n
        seconds = time.perf_counter() - t0
        os.close(fd)
    finally:
        buf.close()
        path.unlink()
    return offset / seconds


def drop_page_cache(root: Path) -> None:
    """Ask the kernel to forget the cached pages of every file under `root` (fsynced
    files' pages are clean, so it can): the next read of them comes from the disk.
    posix_fadvise DONTNEED needs no privilege, unlike /proc/sys/vm/drop_caches."""
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def memcpy_bandwidth(nbytes: int = 256 << 20) -> float:
    """This host's memcpy: torch's copy of `nbytes`, on as many threads as torch uses."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return _copy_rate(lambda: dst.copy_(src), nbytes)


def thread_memcpy_bandwidth(nbytes: int = 256 << 20) -> float:
    """One thread's memcpy (numpy copies on the calling thread alone): the reference for
    a snapshot copy, which each rank makes on one thread. `memcpy_bandwidth` may use
    every core (torch splits a large copy over its thread pool): 20-21 GB/s against one
    thread's 16-17 here."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    return _copy_rate(lambda: np.copyto(dst, src), nbytes)


D2H_PROBE_BYTES = 1 << 30
"""The device-to-host probe's size: 1 GiB, far above the size where a copy's fixed
cost (tens of microseconds) shows, and small beside any GPU's memory."""


def d2h_bandwidth(pinned: bool, nbytes: int = D2H_PROBE_BYTES, repeats: int = 3
                  ) -> float | None:
    """Copy of `nbytes` from the current CUDA device into a pinned (page-locked) or a
    pageable host buffer, bytes per second: the best of `repeats` copies after one to
    warm up, each timed with CUDA events around it on the current stream. None without
    CUDA; nothing touches CUDA then. A snapshot's copy off the GPU cannot beat the
    pinned figure; the pageable one is what a copy into ordinary memory gets."""
    if not torch.cuda.is_available():
        return None
    src = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    best = 0.0
    for i in range(repeats + 1):
        start.record()
        dst.copy_(src, non_blocking=pinned)
        end.record()
        end.synchronize()  # blocks until the copy is done
        if i:  # the first copy warms up (page faults of a pageable buffer, DMA mappings)
            best = max(best, nbytes / (start.elapsed_time(end) / 1e3))
    del src, dst
    torch.cuda.empty_cache()
    return best


def gpu_limits() -> dict[str, float | None]:
    """The device-to-host bandwidths, pinned and pageable (None each without CUDA)."""
    return {"d2h_pinned_Bps": d2h_bandwidth(pinned=True),
            "d2h_pageable_Bps": d2h_bandwidth(pinned=False)}


def _copy_rate(copy: Callable[[], object], nbytes: int) -> float:
    """Bytes per second of `copy` (of `nbytes`): once to warm, then three timed."""
    copy()
    t0 = time.perf_counter()
    for _ in range(3):
        copy()
    return 3 * nbytes / (time.perf_counter() - t0)


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def paired_steps(step_times: dict[int, float], blocks: int, after: int
                 ) -> tuple[list[float], list[float]]:
    """Step times of a `--ckpt-blocks` run after step `after`, split into those of the
    checkpointing blocks and those of the blocks between, each block's first step left
    out (it carries the previous block's regime: the persist of its last checkpoint, or
    the first snapshot's wait)."""
    on, off = [], []
    for s, t in sorted(step_times.items()):
        if s > after and s % blocks:
            (on if in_checkpoint_block(s, blocks) else off).append(t)
    return on, off


def fault_rank(world: int) -> int:
    """The rank the fault kills: the job's last, so not rank 0 (the metrics writer)
    unless it is alone; then rank 0 closes its metrics file before the SIGKILL and its
    restart logs the recovery, as another rank's would."""
    return world - 1


def run_strategy(name: str, common: list[str], steps: int, interval: int, workdir: Path,
                 nodes: int = 1, paired: int = 0, nproc: int = 2) -> dict[str, Any]:
    """One run of `name` and its figures. With `paired` = B > 0 the run checkpoints in
    every other block of B steps (`--ckpt-blocks B`); its throughput is then also taken
    inside the run, blocks without checkpoints over blocks with them, and its
    step-time means (and `none`'s) are over the checkpointing blocks' steps alone."""
    blocks = ["--ckpt-blocks", str(paired)] if paired and name != "none" else []
    fault = [] if name == "none" else ["--fault-at", str(steps), "--fault-rank",
                                       str(fault_rank(nodes * nproc)), "--max-restarts", "1"]
    if name in PEERS:  # the last node is lost: its ranks come back from their peers
        fault = ["--fault-at", str(steps), "--fault-kind", "node", "--fault-node",
                 str(nodes - 1), "--max-restarts", "1"]
    events = train_run([*common, *STRATEGIES[name], *blocks, *fault], workdir)
    first_attempt = []
    for e in events:
        if e["event"] == "recovery":
            break
        first_attempt.append(e)
    step_times = {e["step"]: e["step_time_s"] for e in first_attempt if e["event"] == "step"}
    ckpts = [e for e in events if e["event"] == "checkpoint"]
    counts = checkpoint_counts(events)
    due_count = (None if name == "none" else
           len(TrainConfig(steps=steps, ckpt_interval=interval, ckpt_blocks=paired)
               .checkpoint_steps()))
    recoveries = [e for e in events if e["event"] == "recovery"]
    summary = [e for e in events if e["event"] == "summary"][-1]
    partial = name == "moc"
    later = ckpts[1:] if partial and len(ckpts) > 1 else ckpts
    figures = recovery_figures(recoveries)
    if name.startswith("moc"):
        # The job finished and removed its snapshots: a new start reads storage, from
        # the disk rather than the page cache. Its restore time counts; its "downtime"
        # does not (no fault: it spans this function's own work between the runs). It
        # trains one step more: the trainer logs a recovery once the first step after
        # it is done, and a run already at its last step has none.
        drop_page_cache(workdir / "ckpt")
        before = len(recoveries)
        more = [e for e in train_run([*common, *STRATEGIES[name], *blocks,
                                      "--steps", str(steps + 1)], workdir)
                if e["event"] == "recovery"][before:]
        if more:
            figures["restore_storage_s"] = more[0]["recovery_s"]
    # The steps that checkpoint (that would, in `none`).
    due = {s for s in step_times if s % interval == 0 and in_checkpoint_block(s, paired)}
    plain = [t for s, t in step_times.items() if s not in due]
    with_ckpt = [t for s, t in step_times.items() if s in due]
    # Steady state: after the third checkpoint every snapshot slot has been reserved and
    # the chain's first (complete) persist is written; what a long run pays per interval.
    warm = WARMUP_CHECKPOINTS * interval
    regime = step_times  # the steps whose mean is the strategy's step time
    paired_figures: dict[str, float | None] = {}
    if paired:
        # The first checkpointing block holds the warm-up; `none` is measured on the
        # same steps as the others' checkpointing blocks.
        warm = max(warm, 2 * paired)
        regime = {s: t for s, t in step_times.items() if in_checkpoint_block(s, paired)}
        on, off = paired_steps(step_times, paired, warm)
        paired_figures = {"paired_on_s": statistics.mean(on) if on else None,
                          "paired_off_s": statistics.mean(off) if off else None,
                          "paired_steps": min(len(on), len(off))}
        if name != "none" and on and off:
            paired_figures["paired_throughput"] = statistics.mean(off) / statistics.mean(on)
    steady = [t for s, t in regime.items() if s > warm]
    stalls = [e["stall_s"] for e in ckpts]
    # Rank 0's process CPU per step (every thread: training, snapshot, collectives), and
    # each checkpoint's own accounting: rank 0's snapshot thread, its node's persist.
    cpu = [e.get("cpu_s") for e in first_attempt if e["event"] == "step"]
    steady_cpu = [b - a for i, (a, b) in enumerate(itertools.pairwise(cpu), 2)
                  if a is not None and b is not None and i > warm and i in regime]
    steady_ckpts = [e for e in ckpts if e["step"] > warm]
    persisted = [(e, e["stall_s"] if name in SYNCHRONOUS else e.get("persist_s"))
                 for e in ckpts]
    persist = [t for _, t in persisted if t is not None]
    # Bytes over time per checkpoint (the first of a PEC chain writes every expert).
    rates = [e["bytes"] / t for e, t in persisted if t and e.get("bytes")]
    return {
        "stall_median_s": statistics.median(stalls) if stalls else None,
        "stall_p90_s": _quantile(stalls, 0.9),
        "step_time_s": statistics.median(plain) if plain else None,
        "step_time_ckpt_s": statistics.median(with_ckpt) if with_ckpt else None,
        "mean_step_time_s": statistics.mean(regime.values()),
        "mean_step_time_steady_s": statistics.mean(steady) if steady else None,
        "bytes_per_ckpt": int(statistics.median(e["bytes"] for e in later)) if later else None,
        "imbalance": (statistics.median(e["imbalance"] for e in later if e.get("imbalance"))
                      if later else None),
        "persist_s": statistics.median(persist) if persist else None,
        "persist_Bps": statistics.median(rates) if rates else None,
        "persist_skipped": counts.persist_skipped,
        **figures,
        # This rank's (rank 0's) peer replica per checkpoint: bytes sent to the next
        # node's memory, and the time its round took on the snapshot thread.
        "replica_bytes_per_rank": (int(statistics.median(replicas))
                                   if (replicas := [e["replica_bytes"] for e in ckpts
                                                    if e.get("replica_bytes")]) else None),
        "replica_s": (statistics.median(times)
                      if (times := [e["replica_s"] for e in ckpts
                                    if e.get("replica_s") is not None]) else None),
        "cpu_per_step_s": statistics.mean(steady_cpu) if steady_cpu else None,
        "snapshot_cpu_s": _median([e.get("cpu_s", {}).get("snapshot") for e in steady_ckpts]),
        "persist_cpu_s": _median([e.get("cpu_s", {}).get("persist") for e in steady_ckpts]),
        "copy_Bps": _median([e.get("copy_Bps") for e in steady_ckpts]),
        "copy_cpu_Bps": _median([copy_cpu_bandwidth(e) for e in steady_ckpts]),
        "k_snapshot": next((e["k"] for e in events if e["event"] == "k_snapshot"), None),
        "k_snapshot_reason": next((e.get("reason") for e in events
                                   if e["event"] == "k_snapshot"), None),
        "peak_host_mem_bytes": summary.get("ckpt_host_bytes"),
        "snapshot_bytes": summary.get("snapshot_bytes"),
        "peak_rss_bytes": summary.get("peak_rss_bytes"),
        # Checkpointed steps (each once, whatever the restarts), those that failed and
        # those due: ratios between strategies need equal counts (`markdown`).
        "checkpoints": counts.written,
        "checkpoints_failed": counts.failed,
        "checkpoints_due": due_count,
        "checkpoint_error": counts.first_error,
        **paired_figures,
    }


SOURCES = ("memory", "storage", "peer")
"""Where a recovery's restore read, as its event says ("mixed" ones are not reported)."""


def recovery_figures(recoveries: list[dict[str, Any]]) -> dict[str, Any]:
    """From a run's `recovery` events: per source, the restore time (`recovery_s`) and the
    downtime (`downtime_s`: from the last step before the fault to the first after it,
    detection + restart or re-formation + restore; None in events written before it was
    logged), and the recovery's kind ("restart" or "in-job"). The last event of a source
    wins."""
    out: dict[str, Any] = {f"{what}_{source}_s": None for what in ("restore", "downtime")
                           for source in SOURCES}
    out["recovery_kind"] = None
    for r in recoveries:
        if r["source"] in SOURCES:
            out[f"restore_{r['source']}_s"] = r["recovery_s"]
            out[f"downtime_{r['source']}_s"] = r.get("downtime_s")
        out["recovery_kind"] = r.get("kind") or out["recovery_kind"]
    return out


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def copy_cpu_bandwidth(event: dict[str, Any]) -> float | None:
    """A checkpoint event's snapshot copy in bytes per CPU second of its thread: what
    the copy itself costs, apart from the time it waited for a core (the snapshot thread
    yields to training: `copy_Bps` over wall time includes that wait)."""
    phases = event.get("phases", {}).get("snapshot", {})
    wall = sum(phases[p][0] for p in ("copy", "checksum") if p in phases)
    cpu = sum(phases[p][1] for p in ("copy", "checksum") if p in phases)
    if not event.get("copy_Bps") or not cpu:
        return None
    return event["copy_Bps"] * wall / cpu


WORST_OF_ROUNDS: dict[str, Callable[[list[Any]], Any]] = {
    "checkpoints": min, "checkpoints_failed": max, "persist_skipped": max}
"""Counts taken over rounds as their worst, not their median: a ratio is printed only
when every round of both strategies took the same checkpoints."""


def _median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for key in runs[0]:
        values = [r[key] for r in runs if r.get(key) is not None]
        if values and isinstance(values[0], str):
            out[key] = values[0]
        elif key in WORST_OF_ROUNDS:
            out[key] = WORST_OF_ROUNDS[key](values) if values else None
        else:
            out[key] = statistics.median(values) if values else None
    return out


def same_checkpoints(r: dict[str, Any], other: dict[str, Any] | None) -> bool:
    """Whether a ratio of `r`'s figures to `other`'s compares like with like: both
    wrote the same number of checkpoints. Against `none` (which takes none: its
    `checkpoints_due` is None), `r` must have written every checkpoint due. Results
    written before the counts were recorded (no `checkpoints`) compare as before."""
    if other is None or "checkpoints" not in r or "checkpoints" not in other:
        return True
    if r.get("checkpoints_due") is None:  # r is `none`: the reference itself
        return True
    if other.get("checkpoints_due") is None:  # against `none`
        return r["checkpoints"] == r["checkpoints_due"]
    return r["checkpoints"] == other["checkpoints"]


def count_text(r: dict[str, Any]) -> str:
    """A row's checkpoint count: "8/8", "1/8, 7 failed", "8/8, 2 persist skipped"."""
    if r.get("checkpoints_due") is None:
        return "-"
    text = f"{r['checkpoints']}/{r['checkpoints_due']}"
    if r.get("checkpoints_failed"):
        text += f", {r['checkpoints_failed']} failed"
    if r.get("persist_skipped"):
        text += f", {r['persist_skipped']} persist skipped"
    return text


def count_notes(s: dict[str, dict[str, Any]]) -> list[str]:
    """Why a row has no ratio, and what its count hides (failures, skipped persists)."""
    notes = []
    blocking = s.get("blocking")
    for name, r in s.items():
        if r.get("checkpoints_due") is None:
            continue
        why = []
        if r["checkpoints"] != r["checkpoints_due"]:
            why.append(f"it wrote {r['checkpoints']} of the {r['checkpoints_due']} "
                       "checkpoints due, so no throughput against none")
        if blocking is not None and not same_checkpoints(r, blocking):
            why.append(f"blocking wrote {blocking['checkpoints']}, so no stall ratio")
        if r.get("checkpoints_failed"):
            why.append(f"{r['checkpoints_failed']} failed, the first with: "
                       f"{r.get('checkpoint_error')}")
        if r.get("persist_skipped"):
            why.append(f"{r['persist_skipped']} of its {r['checkpoints']} checkpoints "
                       "skipped the persist (the previous persist still ran): those are "
                       "in memory only")
        if why:
            notes.append(f"- {name}: " + "; ".join(why))
    return notes


def markdown(result: dict[str, Any]) -> str:
    s = result["strategies"]
    base = s.get("blocking", {}).get("stall_median_s")
    ref = s.get("none", {}).get("mean_step_time_s")
    ref_steady = s.get("none", {}).get("mean_step_time_steady_s")

    def fmt(v: float | None, unit: str = "s", digits: int = 4) -> str:
        return "-" if v is None else f"{v:.{digits}f} {unit}".strip()

    # Across nodes: the peer tier's columns (replica bytes and time, restore from a peer).
    peers = any(r.get("replica_bytes_per_rank") or r.get("restore_peer_s") for r in s.values())
    extra = " replica/ckpt/rank | replica time | restore peer |" if peers else ""
    # Results with the recovery's downtime (older ones lack it: no column).
    downtime = any(downtime_text(r) != "-" for r in s.values())
    extra += " downtime |" if downtime else ""
    # With --paired: each strategy's throughput inside its own run.
    paired = any("paired_on_s" in r for r in s.values())
    lines = ["| strategy | checkpoints | stall median | stall p90 | vs blocking | step "
             "| step w/ ckpt "
             "| throughput | steady |" + (" paired |" if paired else "")
             + " bytes/ckpt | imbalance | persist | persist/disk "
             "| restore storage | restore memory | ckpt host memory |" + extra,
             "| --- | " + " | ".join(["---:"] * (15 + 3 * peers + paired + downtime))
             + " |"]
    for name, r in s.items():
        ratio = (r["stall_median_s"] / base if base and r["stall_median_s"] is not None
                 and same_checkpoints(r, s.get("blocking")) else None)
        vs_none = same_checkpoints(r, s.get("none"))
        thr = ref / r["mean_step_time_s"] if ref and vs_none else None
        steady = r.get("mean_step_time_steady_s")
        thr_steady = ref_steady / steady if ref_steady and steady and vs_none else None
        mem = r["peak_host_mem_bytes"]
        mem_text = "-" if mem is None else (
            f"{mem / 1e6:.0f} MB = {mem / r['snapshot_bytes']:.2f} snapshots"
            if r.get("snapshot_bytes") else f"{mem / 1e6:.0f} MB")
        lines.append(
            f"| {name} | {count_text(r)} | {fmt(r['stall_median_s'])} "
            f"| {fmt(r['stall_p90_s'])} "
            f"| {fmt(ratio, '', 4) if ratio is not None else '-'} "
            f"| {fmt(r['step_time_s'])} | {fmt(r['step_time_ckpt_s'])} "
            f"| {fmt(thr, '', 3) if thr else '-'} "
            f"| {fmt(thr_steady, '', 3) if thr_steady else '-'} "
            + (f"| {fmt(r.get('paired_throughput'), '', 3)} " if paired else "")
            + f"| {fmt(_mb(r['bytes_per_ckpt']), 'MB', 1)} "
            f"| {fmt(r['imbalance'], '', 3)} | {fmt(r['persist_s'])} "
            f"| {fmt(r.get('persist_fraction_of_disk'), '', 2)} "
            f"| {fmt(r['restore_storage_s'])} | {fmt(r['restore_memory_s'])} | {mem_text} |"
            + (f" {fmt(_mb(r.get('replica_bytes_per_rank')), 'MB', 1)} "
               f"| {fmt(r.get('replica_s'))} | {fmt(r.get('restore_peer_s'))} |"
               if peers else "")
            + (f" {downtime_text(r)} |" if downtime else ""))
    notes = count_notes(s)
    return ("\n".join(lines + (["", *notes] if notes else [])) + "\n\n"
            + cost_table(result))


def downtime_text(figures: dict[str, Any]) -> str:
    """A strategy's measured downtimes, e.g. "5.31 s (storage, restart)"; "-": none."""
    kind = figures.get("recovery_kind")
    parts = [f"{figures[key]:.2f} s ({source}{', ' + kind if kind else ''})"
             for source in SOURCES
             if (key := f"downtime_{source}_s") in figures and figures[key] is not None]
    return ", ".join(parts) or "-"


def cost_table(result: dict[str, Any]) -> str:
    """What a checkpoint costs the CPU and how fast its snapshot copies: K_snapshot
    (auto's choice), the copy's bandwidth against this host's memcpy, CPU seconds per
    checkpoint of rank 0's snapshot thread and of its node's persist process, and rank
    0's whole process CPU per step against the run without checkpoints."""
    limits = result.get("limits", {})
    # One thread's memcpy: what a rank's copy (one thread) can reach; older results
    # have only the all-threads figure.
    memcpy = limits.get("thread_memcpy_Bps") or limits.get("memcpy_Bps")
    s = result["strategies"]
    none_cpu = s.get("none", {}).get("cpu_per_step_s")
    lines = ["| strategy | K_snapshot | copy (wall) | copy (CPU) | copy / memcpy, wall / CPU "
             "| snapshot CPU/ckpt (rank 0) | persist CPU/ckpt | rank-0 CPU/step | vs none |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]

    def ratio(bps: float | None) -> str:
        return "-" if bps is None or not memcpy else f"{bps / memcpy:.2f}"

    for name, r in s.items():
        copy, cpu = r.get("copy_Bps"), r.get("cpu_per_step_s")
        copy_cpu = r.get("copy_cpu_Bps")
        extra = (f"{cpu - none_cpu:+.4f} s" if cpu is not None and none_cpu is not None
                 and name != "none" and same_checkpoints(r, s.get("none")) else "-")
        lines.append(
            f"| {name} | {'-' if r.get('k_snapshot') is None else int(r['k_snapshot'])} "
            f"| {'-' if copy is None else f'{copy / 1e9:.2f} GB/s'} "
            f"| {'-' if copy_cpu is None else f'{copy_cpu / 1e9:.2f} GB/s'} "
            f"| {ratio(copy)} / {ratio(copy_cpu)} "
            f"| {_s(r.get('snapshot_cpu_s'))} | {_s(r.get('persist_cpu_s'))} "
            f"| {_s(cpu)} | {extra} |")
    reasons = [f"- {name}: K_snapshot < N because {r['k_snapshot_reason']}"
               for name, r in s.items() if r.get("k_snapshot_reason")]
    return "\n".join(lines + (["", *reasons] if reasons else []))


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.4f} s"


def _mb(nbytes: float | None) -> float | None:
    return None if nbytes is None else nbytes / 1e6


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="moc bench overhead", description=__doc__)
    p.add_argument("--nproc", type=int, default=2,
                   help="ranks per node (default 2); the fault kills the job's last "
                        "rank, rank 0 itself on one process (--nproc 1)")
    p.add_argument("--device", choices=["cuda", "cpu"],
                   help="where the runs train (moc train --device); default cuda when "
                        "torch sees a GPU for every rank, else cpu")
    p.add_argument("--nodes", type=int, default=1,
                   help="simulated nodes (moc train --nodes); with more than one, the "
                        "moc-peers strategy (peer replicas) runs beside moc (none)")
    p.add_argument("--config", default="bench",
                   help="model preset (default bench; gpu-400m and gpu-800m for a GPU)")
    p.add_argument("--steps", type=int, default=40, help="steps per run (default 40)")
    p.add_argument("--interval", type=int, default=5, help="steps between checkpoints")
    p.add_argument("--quick", action="store_true", help="20 steps: under 5 minutes on 2 cores")
    p.add_argument("--strategies", nargs="+", choices=list(STRATEGIES),
                   help="default: every strategy (with --nodes > 1: none, moc, moc-peers)")
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds over all strategies, interleaved; figures are the median "
                        "over rounds (this machine is shared and noisy)")
    p.add_argument("--paired", type=int, default=0, metavar="B",
                   help="also measure each strategy against itself in one run: it "
                        "checkpoints only in every other block of B steps (moc train "
                        "--ckpt-blocks B), and the 'paired' column is its blocks without "
                        "checkpoints over its blocks with them, free of the drift between "
                        "runs; throughput and steady are then over the checkpointing "
                        "blocks' steps (default 0: off)")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--png", type=Path, help="bar chart of stall and throughput (matplotlib)")
    p.add_argument("--workdir", type=Path, help="checkpoint location (default: a temp dir)")
    p.add_argument("--keep-last", type=int, default=None,
                   help="each run keeps this many checkpoints (moc train --keep-last); "
                        "default: all. On a GPU preset every full checkpoint is GBs: "
                        "scripts/gpu_check.sh keeps 2")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (drawn only on a terminal, never under CI)")
    args = p.parse_args(argv)
    if args.nodes < 1:
        p.error(f"--nodes must be >= 1, got {args.nodes}")
    if args.nproc < 1:
        p.error(f"--nproc must be >= 1, got {args.nproc}")
    if args.paired < 0 or args.paired == 1:
        p.error(f"--paired must be 0 (off) or a block of >= 2 steps, got {args.paired}")
    if args.paired and args.interval >= args.paired:
        p.error(f"--paired {args.paired} needs --interval below it, got --interval "
                f"{args.interval}: each block's first step is left out, so a block must "
                "hold checkpoints after it (e.g. --interval 1 --paired 5)")
    if args.strategies is None:
        args.strategies = ([n for n in STRATEGIES if n not in PEERS] if args.nodes == 1
                           else ["none", "moc", *PEERS])
    if args.nodes == 1 and set(args.strategies) & set(PEERS):
        p.error("moc-peers needs more than one node: add --nodes 2")
    steps = 20 if args.quick else args.steps
    # moc train's own default, resolved here so that the result says where it trained.
    device = args.device or default_device(args.nodes * args.nproc)
    common = ["--nodes", str(args.nodes), "--nproc", str(args.nproc), "--config",
              args.config, "--steps", str(steps), "--ckpt-interval", str(args.interval),
              "--device", device]
    if args.keep_last is not None:
        if args.keep_last < 1:
            p.error(f"--keep-last must be >= 1, got {args.keep_last}")
        common += ["--keep-last", str(args.keep_last)]
    t0 = time.perf_counter()
    n_runs = args.repeat * len(args.strategies)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp, \
            progress(n_runs, "bench overhead", "run", disable=args.no_progress) as bar:
        # Best of three: a limit, and this shared disk's speed varies from one second
        # to the next.
        limits = {"disk_write_Bps": max(disk_write_bandwidth(Path(tmp)) for _ in range(3)),
                  "disk_read_Bps": max(disk_read_bandwidth(Path(tmp)) for _ in range(3)),
                  "memcpy_Bps": memcpy_bandwidth(),
                  "thread_memcpy_Bps": thread_memcpy_bandwidth()}
        rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in args.strategies}
        for i in range(args.repeat):
            for name in args.strategies:
                workdir = Path(tmp) / f"{name}-{i}"
                workdir.mkdir()
                bar.note(name if args.repeat == 1 else f"{name}, round {i + 1}")
                rounds[name].append(run_strategy(name, common, steps, args.interval, workdir,
                                                 args.nodes, args.paired, args.nproc))
                # Its figures are taken: a blocking run checkpointing every step leaves
                # 12 GB of steps behind, and the rounds would fill the disk.
                shutil.rmtree(workdir)
                bar.update()
        strategies = {name: _median_of(runs) for name, runs in rounds.items()}
    # After the runs, so that this process holds no CUDA context or pinned buffer while
    # they train.
    limits.update(gpu_limits())
    for r in strategies.values():
        r["persist_fraction_of_disk"] = (r["persist_Bps"] / limits["disk_write_Bps"]
                                         if r["persist_Bps"] else None)
    result = {"config": {"preset": args.config, "nodes": args.nodes, "nproc": args.nproc,
                         "device": device, "steps": steps,
                         "interval": args.interval, "repeat": args.repeat,
                         "paired": args.paired, "keep_last": args.keep_last,
                         "wall_s": time.perf_counter() - t0},
              "limits": limits, "strategies": strategies,
              # Each round's figures: on a shared machine the spread between rounds is
              # as telling as the median.
              "rounds": rounds}
    publish("moc bench overhead",
            [("config", f"{args.config}, {args.nodes} node(s) x {args.nproc} ranks, {steps} "
                        f"steps, a checkpoint every {args.interval}"
                        + (f", in every other block of {args.paired} steps" if args.paired
                           else "")),
             ("disk write (fsync)", f"{limits['disk_write_Bps'] / 1e6:.0f} MB/s"),
             ("disk read (uncached)", f"{limits['disk_read_Bps'] / 1e6:.0f} MB/s"),
             ("memcpy", f"{limits['thread_memcpy_Bps'] / 1e9:.1f} GB/s one thread, "
                        f"{limits['memcpy_Bps'] / 1e9:.1f} GB/s all"),
             *gpu_rows(limits, strategies, device),
             ("wall", f"{result['config']['wall_s']:.0f} s")],
            markdown(result), result, args.json, args.png, lambda path: plot(result, path))
    return 0


NO_GPU = "n/a (no GPU)"


def gpu_rows(limits: dict[str, Any], strategies: dict[str, dict[str, Any]], device: str
             ) -> list[tuple[str, str]]:
    """The limits' GPU lines: the device-to-host bandwidths, and each snapshotting
    strategy's copy (its checkpoint events' `copy_Bps`) as a share of the pinned one.
    "n/a (no GPU)" where torch saw no CUDA; no share where the runs trained on the CPU
    (their copy was host to host)."""
    pinned, pageable = limits.get("d2h_pinned_Bps"), limits.get("d2h_pageable_Bps")
    if not pinned:
        return [("D2H copy", NO_GPU), ("snapshot copy / pinned D2H", NO_GPU)]
    rows = [("D2H copy", f"{pinned / 1e9:.1f} GB/s pinned, "
                         f"{pageable / 1e9:.1f} GB/s pageable" if pageable else
             f"{pinned / 1e9:.1f} GB/s pinned")]
    if device != "cuda":
        return [*rows, ("snapshot copy / pinned D2H", "n/a (the runs trained on the CPU)")]
    shares = [f"{name} {r['copy_Bps'] / pinned:.2f} ({r['copy_Bps'] / 1e9:.1f} GB/s)"
              for name, r in strategies.items() if r.get("copy_Bps")]
    return [*rows, ("snapshot copy / pinned D2H",
                    ", ".join(shares) or "- (no strategy reported a snapshot copy)")]


def plot(result: dict[str, Any], path: Path) -> None:
    """Two panels, one bar per strategy: median stall per checkpoint (log scale) and
    steady-state throughput against the run without checkpoints."""
    from moc.bench.plots import pyplot

    plt = pyplot()
    s = result["strategies"]
    ref = (s.get("none") or {}).get("mean_step_time_steady_s")
    names = [n for n in s if n != "none"]
    stalls = [s[n]["stall_median_s"] or 0.0 for n in names]
    thr = [ref / s[n]["mean_step_time_steady_s"]
           if ref and s[n].get("mean_step_time_steady_s")
           and same_checkpoints(s[n], s.get("none")) else 0.0 for n in names]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.bar(names, stalls, color="tab:red")
    a.set_yscale("log")
    a.set_ylabel("median stall per checkpoint (s, log)")
    for i, v in enumerate(stalls):
        a.annotate(_duration(v), (i, v), ha="center", va="bottom", fontsize=8)
    b.bar(names, thr, color="tab:blue")
    b.axhline(1.0, color="gray", linewidth=0.8)
    b.axhline(0.9, color="gray", linestyle="--", linewidth=0.8)
    b.set_ylim(0, max(1.1, *thr) + 0.05)  # noise can put a strategy above 1
    b.set_ylabel("throughput vs no checkpoints (steady state)")
    for i, v in enumerate(thr):
        b.annotate(f"{v:.2f}" if v else "no ratio", (i, v), ha="center", va="bottom",
                   fontsize=8)
    cfg = result["config"]
    fig.suptitle(f"moc bench overhead: {cfg['preset']}, {cfg['nproc']} ranks, a checkpoint "
                 f"every {cfg['interval']} steps")
    for ax in (a, b):
        ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _duration(seconds: float) -> str:
    """Milliseconds below 0.1 s (a sub-millisecond stall printed as "0.000s" says
    nothing), seconds above."""
    return f"{seconds * 1e3:.2f} ms" if seconds < 0.1 else f"{seconds:.3f} s"
