"""`moc bench loop`: a checkpoint every step, as the training thread sees it, in one process.

    moc bench loop --config gpu-400m --device cuda       # every step, K_snapshot = N
    moc bench loop --config bench --steps 40 --block 5   # the CPU, a small model

One process trains a preset's model (moc's Transformer, AdamW, routing watched) with the
two-level engine, in blocks of B steps alternately without and with a checkpoint every
step, and times each step on the training thread by phase:

    fwd_bwd      forward and backward: on a GPU, the time to launch them (on a CPU,
                 the compute itself); with a snapshot in flight behind it in the blocks
                 with checkpoints, its plan and capture competing for the GIL
    wait         wait_for_snapshot(): the capture of the previous checkpoint
    optimizer    optimizer.step() and zero_grad()
    save         maybe_save() and, when due, drain_completed()
    sync         loss.item(): where the training thread meets the device

Paired throughput is the mean step of the blocks without checkpoints over that of the
blocks with them (each block's first step left out), measured side by side in one run.
So is the training thread's forward and backward, with a snapshot in flight (the blocks
with checkpoints: each step's snapshot is planned and captured behind the next step's
forward and backward) and without (`fwd_bwd_on_s`, `fwd_bwd_off_s`, their ratio
`fwd_bwd_ratio`; `fwd_bwd_in_flight_share`: the share of the former steps whose forward
started with a capture still in flight).
Also: each checkpoint's capture bandwidth (its copies) against the pinned
device-to-host bandwidth measured in the same run (a GPU), its seal, how long it queued
behind the seal before it (a seal that does not keep up delays the next snapshot), and
how the first checkpointed steps compare with a plain step (the slots are prepared
ahead of them). Without torchrun or other ranks, this isolates the engine's cost on the
training thread, where `moc bench overhead` measures whole runs of `moc train`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from moc.bench.overhead import d2h_bandwidth, paired_steps
from moc.bench.plots import publish
from moc.checkpoint.api import CheckpointResult
from moc.checkpoint.policy.selection import PECPolicy
from moc.checkpoint.policy.tokens import RoutingNotRecordedWarning
from moc.checkpoint.twolevel.checkpointer import TwoLevelCheckpointer
from moc.cliparse import OneLineParser
from moc.model import Transformer
from moc.train.config import PRESETS, in_checkpoint_block

KEEP_LAST = 2
"""Checkpoints a run keeps on storage: the benchmark reads none back."""
PHASES = ("fwd_bwd", "wait", "optimizer", "save", "sync")


def train(cfg_name: str, device: torch.device, steps: int, block: int, k_snapshot: Any,
          root: Path) -> tuple[dict[int, dict[str, float]], list[CheckpointResult],
                               dict[str, Any]]:
    """The run: per step the training thread's seconds by phase (and "step", the whole
    step), the checkpoints' results, and what the engine's slots were."""
    preset = PRESETS[cfg_name]
    cfg, batch = preset["model"], preset["batch_size"]
    torch.manual_seed(0)
    model = Transformer(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=preset["lr"])
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, cfg.vocab_size, (4, batch, cfg.seq_len + 1), generator=g).to(device)
    # Two checkpoints kept (and what their chain reads): a checkpoint every step kept
    # whole filled the 64 GB disk of a GPU machine at gpu-800m (9.3 GB a full one).
    ckpt = TwoLevelCheckpointer(model, opt, root, policy=PECPolicy(k=1), interval=1,
                                k_snapshot=k_snapshot, keep_last=KEEP_LAST)
    ckpt.watch_routing(model)
    times: dict[int, dict[str, float]] = {}
    results: list[CheckpointResult] = []
    try:
        for step in range(1, steps + 1):
            x = data[step % len(data)]
            in_flight = ckpt.capturing  # a snapshot's plan or capture behind this forward
            t = [time.perf_counter()]
            loss = model(x[:, :-1], x[:, 1:]).loss
            loss.backward()
            t.append(time.perf_counter())
            ckpt.wait_for_snapshot()
            t.append(time.perf_counter())
            opt.step()
            opt.zero_grad(set_to_none=True)
            t.append(time.perf_counter())
            if in_checkpoint_block(step, block):
                ckpt.save(step)
            if ckpt.pending:
                results += ckpt.drain_completed()
            t.append(time.perf_counter())
            loss.item()  # the loop's own sync, as a loop that logs its loss has
            t.append(time.perf_counter())
            times[step] = {name: b - a for name, a, b in zip(PHASES, t, t[1:], strict=False)}
            times[step]["step"] = t[-1] - t[0]
            times[step]["in_flight"] = float(in_flight)
        ckpt.flush()
        results += ckpt.drain_completed()
        slots = {"pinned": ckpt.snapshots.store.pinned, **ckpt.host_memory()}
    finally:
        ckpt.close()
    return times, results, slots


def figures(times: dict[int, dict[str, float]], results: list[CheckpointResult],
            block: int, warmup: int) -> dict[str, Any]:
    """The paired throughput, the phases with and without checkpoints, the checkpoints'
    capture and seal, and the first checkpointed steps against a plain one."""
    step_s = {s: t["step"] for s, t in times.items()}
    on, off = paired_steps(step_s, block, warmup)
    out: dict[str, Any] = {
        "paired_throughput": statistics.mean(off) / statistics.mean(on) if on and off else None,
        "step_on_s": statistics.mean(on) if on else None,
        "step_off_s": statistics.mean(off) if off else None,
        "paired_steps": min(len(on), len(off))}
    steady = [s for s in times if s > warmup and s % block]
    for name in PHASES:
        for regime, want in (("on", True), ("off", False)):
            vals = [times[s][name] for s in steady if in_checkpoint_block(s, block) == want]
            out[f"{name}_{regime}_s"] = statistics.mean(vals) if vals else None
    out.update(launch_figures(times, steady, block))
    plain = statistics.median(t["step"] for s, t in times.items()
                              if not in_checkpoint_block(s, block) and s > 1)
    checkpointed = sorted(s for s in times if in_checkpoint_block(s, block))
    # A step pays for the checkpoint it saves and for the capture of the one before.
    out["first_checkpointed_s"] = [times[s]["step"] for s in checkpointed[:4]]
    out["plain_step_s"] = plain
    later = [times[s]["step"] for s in checkpointed[1:]]
    out["worst_after_first_vs_plain"] = max(later) / plain if later else None
    ok = [r for r in results if r.error is None]
    out["checkpoints"], out["failed"] = len(ok), len(results) - len(ok)
    steady_r = ok[1:] or ok

    def phase(r: CheckpointResult, name: str, cpu: bool = False) -> float:
        """A snapshot phase's wall seconds (its CPU seconds: `cpu`)."""
        return r.phases.get("snapshot", {}).get(name, [0.0, 0.0])[int(cpu)]

    if steady_r:
        out["capture_Bps"] = statistics.median(r.copy_Bps for r in steady_r if r.copy_Bps)
        out["snapshot_bytes"] = statistics.median(
            r.copy_Bps * phase(r, "copy") for r in steady_r if r.copy_Bps)
        out["seal_s"] = statistics.median(phase(r, "checksum") + phase(r, "header")
                                          for r in steady_r)
        out["queued_max_s"] = max(phase(r, "queued") for r in steady_r)
        # CPU time: the snapshot thread runs in SCHED_IDLE, and on cores that training
        # keeps busy a phase's wall time is mostly waiting for one.
        out["reserve_max_cpu_s"] = max(phase(r, "reserve", cpu=True) for r in steady_r)
        out["stall_median_s"] = statistics.median(r.wait_s for r in steady_r)
        out["k_snapshot"] = steady_r[-1].k_snapshot
    return out


def launch_figures(times: dict[int, dict[str, float]], steady: list[int], block: int
                   ) -> dict[str, float | None]:
    """The training thread's forward and backward with a snapshot in flight against
    without: the ratio of the two means (`fwd_bwd_on_s` over `fwd_bwd_off_s`), and the
    share of the checkpointing blocks' steps whose forward started with a capture in
    flight (a snapshot that was over before would measure nothing)."""
    on = [s for s in steady if in_checkpoint_block(s, block)]
    off = [s for s in steady if not in_checkpoint_block(s, block)]
    if not on or not off:
        return {"fwd_bwd_ratio": None, "fwd_bwd_in_flight_share": None}
    on_s = statistics.mean(times[s]["fwd_bwd"] for s in on)
    off_s = statistics.mean(times[s]["fwd_bwd"] for s in off)
    share = statistics.mean(times[s].get("in_flight", 0.0) for s in on)
    return {"fwd_bwd_ratio": on_s / off_s if off_s else None, "fwd_bwd_in_flight_share": share}


def markdown(r: dict[str, Any]) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.1f}"

    lines = ["| training thread, per step (ms) | without checkpoints | with one every step |",
             "| --- | ---: | ---: |"]
    for name in (*PHASES, "step"):
        key = name if name != "step" else "step"
        off = r.get(f"{key}_off_s") if name != "step" else r.get("step_off_s")
        on = r.get(f"{key}_on_s") if name != "step" else r.get("step_on_s")
        lines.append(f"| {name} | {ms(off)} | {ms(on)} |")
    return "\n".join(lines)


def launch_row(r: dict[str, Any]) -> str:
    """The training thread's forward and backward, without and with a snapshot in flight."""
    off, on, ratio = r.get("fwd_bwd_off_s"), r.get("fwd_bwd_on_s"), r.get("fwd_bwd_ratio")
    if off is None or on is None or ratio is None:
        return "-"
    return (f"{off * 1e3:.1f} ms without a snapshot in flight, {on * 1e3:.1f} ms with one: "
            f"{ratio:.3f}x ({r['fwd_bwd_in_flight_share']:.0%} of those steps started with "
            "a capture in flight)")


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="moc bench loop", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="bench", choices=list(PRESETS),
                   help="model preset (default bench; gpu-400m and gpu-800m on a GPU)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   choices=["cpu", "cuda"], help="default: cuda where there is one")
    p.add_argument("--steps", type=int, default=60, help="steps in all (default 60)")
    p.add_argument("--block", type=int, default=5,
                   help="steps per block, alternately without and with a checkpoint every "
                        "step (default 5)")
    p.add_argument("--warmup", type=int, default=None,
                   help="steps left out of the paired figures (default 2 blocks)")
    p.add_argument("--k-snapshot", default="all",
                   help="experts per layer a snapshot holds: all (default), auto or an int")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--workdir", type=Path, help="checkpoint location (default: a temp dir)")
    args = p.parse_args(argv)
    if args.block < 2:
        p.error(f"--block must be >= 2 (each block's first step is left out), got {args.block}")
    warmup = 2 * args.block if args.warmup is None else args.warmup
    if args.steps < warmup + 4 * args.block:
        p.error(f"--steps {args.steps} leaves fewer than 2 blocks of each kind after "
                f"{warmup} warm-up steps; give at least {warmup + 4 * args.block}")
    k = args.k_snapshot if args.k_snapshot in ("all", "auto") else int(args.k_snapshot)
    device = torch.device(args.device)
    limits = {"d2h_pinned_Bps": d2h_bandwidth(pinned=True) if device.type == "cuda" else None}
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore", RoutingNotRecordedWarning)
        times, results, slots = train(args.config, device, args.steps, args.block, k,
                                      Path(tmp) / "ckpt")
    result = {"config": args.config, "device": args.device, "steps": args.steps,
              "block": args.block, "warmup": warmup, **limits, "slots": slots,
              **figures(times, results, args.block, warmup),
              "times": {str(s): t for s, t in times.items()}}
    pinned = result["d2h_pinned_Bps"]
    if pinned and result.get("capture_Bps"):
        result["capture_vs_pinned"] = result["capture_Bps"] / pinned

    def rate(v: float | None) -> str:
        return "-" if not v else f"{v / 1e9:.1f} GB/s"

    rows = [("model", f"{args.config} on {args.device}, K_snapshot {result.get('k_snapshot')}"),
            ("paired throughput", f"{result['paired_throughput']:.3f} "
                                  f"({result['paired_steps']} steps each)"),
            ("checkpoints", f"{result['checkpoints']} ({result['failed']} failed), "
                            f"{result.get('snapshot_bytes', 0) / 1e9:.2f} GB each"),
            ("capture", f"{rate(result.get('capture_Bps'))}; pinned D2H {rate(pinned)}"
                        + (f" (share {result['capture_vs_pinned']:.2f})"
                           if "capture_vs_pinned" in result else "")),
            ("forward+backward", launch_row(result)),
            ("seal", f"{result.get('seal_s', 0) * 1e3:.1f} ms; queued at most "
                     f"{result.get('queued_max_s', 0) * 1e3:.1f} ms behind the one before"),
            ("slots", f"pinned: {slots['pinned']}; reserving at a checkpoint after the "
                      f"first: at most {result.get('reserve_max_cpu_s', 0) * 1e3:.1f} ms "
                      "of CPU"),
            ("first checkpointed steps", ", ".join(f"{t * 1e3:.0f}" for t in
                                                   result["first_checkpointed_s"])
             + f" ms, a plain one {result['plain_step_s'] * 1e3:.0f} ms; the worst after "
               f"the first {result['worst_after_first_vs_plain']:.2f}x")]
    publish("moc bench loop", rows, markdown(result), result, args.json, None, lambda _: None)
    return 0
