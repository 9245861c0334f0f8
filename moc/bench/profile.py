"""`moc bench profile`: where the time of one two-level checkpoint goes, phase by phase,
wall and CPU, and what each way of doing the work costs, side by side in one run.

One process, no training beside it (the intrinsic cost, not the contention): the preset's
model with Adam's state after one step, all its experts on this one rank (EP 1), and a
real `TwoLevelCheckpointer` (its snapshot thread and its persist process) taking
`--checkpoints` complete checkpoints (K_snapshot = N, K_persist = 1, persist policy
"wait"). From each checkpoint's own accounting (`CheckpointResult.phases`):

    snapshot thread   plan, reserve (the slots' memory: the first checkpoint only),
                      copy (with its XXH3 digest, fused), header
    persist process   read (the snapshot's header and mapping), write (writev straight
                      from the slot), fsync, commit (the manifest)

Then a restore from memory and one from storage (with the files' pages dropped from the
page cache first, where the kernel lets us: posix_fadvise DONTNEED after an fsync), and
the references the numbers should be read against, on the same bytes: memcpy, the
checksum alone (XXH3; CRC32C, format version 3's; zlib's CRC32, version 2's), the
fused copy with each (numpy's copy, then the digest of the copy from cache), the streamed
copy (the digest of the source, then streaming stores: moc's where it is built),
copying then checksumming in two passes against the fused copy, and the disk's fsynced
write bandwidth.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
import zlib
from pathlib import Path
from typing import Any

import torch

from moc.bench.overhead import disk_write_bandwidth, drop_page_cache, memcpy_bandwidth
from moc.bench.plots import publish
from moc.checkpoint.api import CheckpointResult
from moc.checkpoint.phases import Phases
from moc.checkpoint.policy.selection import PECPolicy
from moc.checkpoint.policy.tokens import RoutingNotRecordedWarning
from moc.checkpoint.store.format import CRC32C, digest
from moc.checkpoint.twolevel.checkpointer import TwoLevelCheckpointer
from moc.checkpoint.twolevel.memory import native
from moc.checkpoint.twolevel.memory.places import slot_layout
from moc.cliparse import OneLineParser
from moc.model import Transformer
from moc.parallel import ParallelGroups, ShardedAdamW
from moc.train.config import PRESETS

SNAPSHOT_PHASES = ("plan", "reserve", "copy", "checksum", "header")
PERSIST_PHASES = ("read", "write", "fsync", "commit")


def build(preset: str) -> tuple[torch.nn.Module, ShardedAdamW]:
    """The preset's model and optimizer after one step on random tokens (so Adam's
    moments exist: most of a checkpoint's bytes)."""
    cfg = PRESETS[preset]["model"]
    torch.manual_seed(0)
    model = Transformer(cfg)
    opt = ShardedAdamW(model, ParallelGroups.single(cfg.n_experts), lr=1e-3)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    model(x, x).loss.backward()
    opt.step()
    model.zero_grad(set_to_none=True)
    return model, opt


def checkpoints(model: torch.nn.Module, opt: ShardedAdamW, root: Path, n: int
                ) -> tuple[list[CheckpointResult], dict[str, torch.Tensor], dict[str, Any]]:
    """`n` checkpoints, each waited for; their results, the state a snapshot copies, and
    the restore times from memory and from storage (cold page cache)."""
    n_experts = model.cfg.n_experts
    ckpt = TwoLevelCheckpointer(model, opt, root, policy=PECPolicy(k=1), interval=1,
                                persist_policy="wait", k_snapshot="all",
                                groups=ParallelGroups.single(n_experts))
    results: list[CheckpointResult] = []
    state = ckpt.parts.state.flatten()
    try:
        with warnings.catch_warnings():
            # No training loop, so no routing: the token ledger has nothing to count.
            warnings.simplefilter("ignore", RoutingNotRecordedWarning)
            for step in range(1, n + 1):
                ckpt.save(step, {"step": step})
                ckpt.wait_for_snapshot()
                ckpt.flush()
                results += ckpt.drain_completed()
        t0 = time.perf_counter()
        report = ckpt.restore()
        memory_s = time.perf_counter() - t0 if report is not None else None
        memory_source = report.source if report is not None else None
    finally:
        ckpt.close()  # the snapshots go with the job: the next restore reads storage
    drop_page_cache(root)
    ckpt = TwoLevelCheckpointer(model, opt, root, policy=PECPolicy(k=1), interval=1,
                                groups=ParallelGroups.single(n_experts))
    try:
        t0 = time.perf_counter()
        report = ckpt.restore()
        storage_s = time.perf_counter() - t0 if report is not None else None
    finally:
        ckpt.close()
    return results, state, {"restore_memory_s": memory_s,
                            "restore_memory_source": memory_source,
                            "restore_storage_s": storage_s}


def references(state: dict[str, torch.Tensor], workdir: Path) -> dict[str, float]:
    """Seconds (wall, this thread alone) of each way of doing the snapshot's work on
    the same bytes, and the limits."""
    offsets, size = slot_layout(state)
    slot = torch.empty(size, dtype=torch.uint8)
    dsts, srcs = [], []
    for key, t in state.items():
        n = t.numel() * t.element_size()
        if n:
            dsts.append(slot[offsets[key]:offsets[key] + n].numpy())
            srcs.append(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
    native.copy_and_digest(dsts, srcs)  # warm: every page touched once
    out: dict[str, float] = {"snapshot_bytes": float(size)}
    threads = native.default_threads()
    phases = Phases()
    with phases("fused copy + XXH3"):  # the CPU capture: one pass, one native call
        native.copy_and_digest(dsts, srcs)
    with phases("copy"):  # the capture of the unfused CPU path
        native.copy_all(dsts, srcs)
    with phases("copy (torch)"):
        for key, t in state.items():
            n = t.numel() * t.element_size()
            if n:
                slot[offsets[key]:offsets[key] + n].view(t.dtype).view(t.shape).copy_(t)
    with phases("XXH3 alone"):  # a seal's checksums, on one native thread
        native.digests(dsts)
    with phases(f"XXH3 on {threads} thread" + "s" * (threads > 1)):  # wall; CPU: this thread
        native.digests(dsts, threads)
    with phases("XXH3, a call per tensor"):  # how seals hashed before one native call
        for d in dsts:
            digest(d)
    with phases("fused copy + CRC32C"):  # format 3's checksum, for comparison
        for d, src in zip(dsts, srcs, strict=True):
            d[:] = src
            digest(d, CRC32C)
    with phases("CRC32C alone"):
        for d in dsts:
            digest(d, CRC32C)
    with phases("zlib CRC32 alone"):
        for d in dsts:
            zlib.crc32(d)
    for name in phases.wall:
        out[f"{name} s"] = phases.wall[name]
        out[f"{name} cpu s"] = phases.cpu[name]
    out["copy then zlib CRC32 s"] = out["copy s"] + out["zlib CRC32 alone s"]
    out["memcpy_Bps"] = memcpy_bandwidth(min(size, 256 << 20))
    out["disk_write_Bps"] = max(disk_write_bandwidth(workdir) for _ in range(3))
    return out


def summarize(results: list[CheckpointResult]) -> dict[str, Any]:
    """Median wall and CPU seconds per phase over the checkpoints after the first (which
    alone reserves the slots' memory and persists every expert), and the first's."""
    def phase_table(rs: list[CheckpointResult], where: str, names: tuple[str, ...]
                    ) -> dict[str, list[float]]:
        out = {}
        for name in names:
            rows = [r.phases.get(where, {}).get(name, [0.0, 0.0, 0]) for r in rs]
            if any(row[0] for row in rows):
                out[name] = [statistics.median(row[i] for row in rows) for i in range(3)]
        return out

    steady = results[1:] or results
    return {
        "first": {"snapshot": phase_table(results[:1], "snapshot", SNAPSHOT_PHASES),
                  "persist": phase_table(results[:1], "persist", PERSIST_PHASES)},
        "steady": {"snapshot": phase_table(steady, "snapshot", SNAPSHOT_PHASES),
                   "persist": phase_table(steady, "persist", PERSIST_PHASES)},
        "copy_Bps": statistics.median(r.copy_Bps for r in steady if r.copy_Bps),
        "persist_bytes": statistics.median(r.bytes for r in steady),
        "snapshot_cpu_s": statistics.median(r.cpu_s.get("snapshot", 0.0) for r in steady),
        "persist_cpu_s": statistics.median(r.cpu_s.get("persist", 0.0) for r in steady),
    }


def markdown(result: dict[str, Any]) -> str:
    s, ref = result["phases"], result["references"]
    size = ref["snapshot_bytes"]
    lines = ["| where | phase | wall (first) | wall | CPU | page faults | bytes "
             "| GB/s (write: with its fsync) |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for where in ("snapshot", "persist"):
        for name, (wall, cpu, faults) in s["steady"][where].items():
            first = s["first"][where].get(name, [None])[0]
            # The disk's rate is the write and its fsync together (with O_DIRECT the
            # bytes reach the device during the write, so the fsync is short).
            spent = wall + s["steady"][where].get("fsync", [0.0])[0] if name == "write" else wall
            nbytes = size if name == "copy" else (
                s["persist_bytes"] if name == "write" else None)
            rate = f"{nbytes / spent / 1e9:.2f}" if nbytes and spent else "-"
            lines.append(f"| {where} | {name} | {'-' if first is None else f'{first:.4f}'} "
                         f"| {wall:.4f} | {cpu:.4f} | {faults:.0f} | "
                         f"{'-' if nbytes is None else f'{nbytes / 1e6:.0f} MB'} | {rate} |")
    lines += ["", "| the snapshot's work, one way or another (same bytes) | wall | CPU "
                  "| GB/s | vs memcpy |", "| --- | ---: | ---: | ---: | ---: |"]
    memcpy = ref["memcpy_Bps"]
    names = [n.removesuffix(" cpu s") for n in ref if n.endswith(" cpu s")]
    for name in names:
        wall, cpu = ref[f"{name} s"], ref[f"{name} cpu s"]
        lines.append(f"| {name} | {wall:.4f} | {cpu:.4f} | {size / wall / 1e9:.2f} "
                     f"| {size / wall / memcpy:.2f} |")
    both = ref["copy then zlib CRC32 s"]
    lines.append(f"| copy, then zlib CRC32 (before: two passes) | {both:.4f} | - "
                 f"| {size / both / 1e9:.2f} | {size / both / memcpy:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="moc bench profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="bench", choices=list(PRESETS),
                   help="model preset (default bench)")
    p.add_argument("--checkpoints", type=int, default=6,
                   help="checkpoints taken (the first reserves memory; default 6)")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--workdir", type=Path, help="checkpoint location (default: a temp dir)")
    args = p.parse_args(argv)
    if args.checkpoints < 2:
        p.error(f"--checkpoints must be >= 2 (the first is not the steady state), got "
                f"{args.checkpoints}")
    t0 = time.perf_counter()
    torch.set_num_threads(1)  # as under torchrun: one thread per rank, OMP_NUM_THREADS=1
    model, opt = build(args.config)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        results, state, restore = checkpoints(model, opt, Path(tmp) / "ckpt",
                                              args.checkpoints)
        failed = [r.error for r in results if r.error]
        if failed:
            raise RuntimeError(f"a checkpoint failed: {failed[0]}")
        refs = references(state, Path(tmp))
    result = {"config": {"preset": args.config, "checkpoints": args.checkpoints,
                         "wall_s": time.perf_counter() - t0},
              "phases": summarize(results), "restore": restore, "references": refs}
    ph = result["phases"]
    publish("moc bench profile",
            [("config", f"{args.config}, one rank holding every expert, "
                        f"{args.checkpoints} checkpoints (K_snapshot = N, K_persist = 1)"),
             ("snapshot", f"{refs['snapshot_bytes'] / 1e6:.0f} MB; copy "
                          f"{ph['copy_Bps'] / 1e9:.2f} GB/s = "
                          f"{ph['copy_Bps'] / refs['memcpy_Bps']:.2f} of memcpy "
                          f"({refs['memcpy_Bps'] / 1e9:.1f} GB/s)"),
             ("CPU per checkpoint", f"snapshot thread {ph['snapshot_cpu_s']:.4f} s, persist "
                                    f"process {ph['persist_cpu_s']:.4f} s"),
             ("persist", f"{ph['persist_bytes'] / 1e6:.0f} MB per checkpoint; disk "
                         f"(fsync) {refs['disk_write_Bps'] / 1e6:.0f} MB/s"),
             ("restore", f"memory {_s(restore['restore_memory_s'])}, storage (page cache "
                         f"dropped) {_s(restore['restore_storage_s'])}"),
             ("wall", f"{result['config']['wall_s']:.0f} s")],
            markdown(result), result, args.json, None, lambda path: None)
    return 0


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.3f} s"
