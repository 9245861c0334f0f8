"""The GPU check of issue 39, section by section within a time budget, its figures as JSON.

    python scripts/gpu_check.py --device cuda --out DIR --budget 540   (scripts/gpu_check.sh)
    python scripts/gpu_check.py --device cpu --out DIR --quick          (its logic, on a CPU)

Sections, in order of what they show (each is skipped, and said so, when the budget
left is below its estimate; the JSON is written after each):

    tests          the CUDA tests (tests/gpu: no device sync on the training thread under
                   set_sync_debug_mode("error"), slots pinned before the first
                   checkpoint) and a SIGKILL between capture and seal, on the device
    resume         a run SIGKILLed after step KILL_AT resumes from memory; every loss
                   after it bitwise equal to an uninterrupted run's
    loop_400m      `moc bench loop --config gpu-400m`: a checkpoint every step (K_snapshot
    loop_800m      16 of 16) paired against none in one run, the training thread's phases,
                   the capture against the pinned device-to-host bandwidth, the seal
    overhead_bench `moc bench overhead --nproc 1` at a checkpoint every 5 steps: none,
    overhead_400m  blocking, dcp-async and moc side by side, their checkpoint counts
    two_ranks      `moc train --nproc 2` (NCCL), a rank SIGKILLed and restarted: only
                   with 2 GPUs

`criteria` then sets each figure of the issue's "Must show" against its target.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

STEPS, INTERVAL, KILL_AT = 30, 5, 22
RANKS, RANKS_STEPS, RANKS_INTERVAL, RANKS_FAULT_AT = 2, 20, 5, 13
STRATEGIES = ["none", "blocking", "dcp-async", "moc"]


def train(device: str, root: str | None, start_fresh: bool, out: str, kill_at: int | None
          ) -> None:
    """One process of the resume check: the reference (no root), or a run with
    two-level checkpoints that SIGKILLs itself after `kill_at`, or its restart."""
    import torch

    from moc import PECPolicy, TwoLevelCheckpointer
    from moc.model import ModelConfig, Transformer

    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    cfg = ModelConfig(seq_len=64, d_model=128, n_layers=4, n_heads=4, d_ffn=512, n_experts=8)
    model = Transformer(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ckpt = None
    start, source = 1, None
    if root is not None:
        ckpt = TwoLevelCheckpointer(model, opt, root, policy=PECPolicy(k=1),
                                    interval=INTERVAL, persist_policy="wait")
        ckpt.watch_routing(model)
        report = None if start_fresh else ckpt.restore()
        if report is not None:
            start, source = report.step + 1, report.source
    losses, records = {}, []
    for step in range(start, STEPS + 1):
        g = torch.Generator().manual_seed(step)
        idx = torch.randint(0, 256, (8, cfg.seq_len + 1), generator=g).to(device)
        loss = model(idx[:, :-1], idx[:, 1:]).loss
        loss.backward()
        if ckpt is not None:
            ckpt.wait_for_snapshot()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses[step] = loss.item()
        if ckpt is not None:
            ckpt.maybe_save(step, {"step": step})
            if ckpt.pending:
                records += [{"step": r.step, "snapshot_s": r.snapshot_s, "stall_s": r.stall_s,
                             "error": r.error} for r in ckpt.drain_completed()]
        Path(out).write_text(json.dumps({"losses": losses, "records": records,
                                         "source": source}))
        if kill_at == step:
            if ckpt is not None:
                ckpt.flush()  # the checkpoint of this step is in memory and on disk
            os.kill(os.getpid(), signal.SIGKILL)
    if ckpt is not None:
        ckpt.close()
    Path(out).write_text(json.dumps({"losses": losses, "records": records, "source": source}))


ROOT = Path(__file__).resolve().parents[1]


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """`cmd` in the checkout's root (moc on its path), its output captured."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=env)


def _tail(text: str, n: int = 3000) -> str:
    return text[-n:]


def section_info(device: str, tmp: str, timeout: float, quick: bool) -> dict[str, Any]:
    import torch

    from moc.checkpoint.twolevel import native

    info: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__,
        "native_batched": native.BATCHED, "native_streaming": native.STREAMING,
        "hash_threads": native.default_threads(), "cpus": os.cpu_count(),
        "xxh3_kernel": getattr(native.streamcopy, "XXH3_KERNEL", None),
        "shm_root": os.environ.get("MOC_SHM_ROOT", "/dev/shm"),
        "shm_free_bytes": shutil.disk_usage(os.environ.get("MOC_SHM_ROOT", "/dev/shm")).free}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpus"] = torch.cuda.device_count()
    return info


def section_tests(device: str, tmp: str, timeout: float, quick: bool) -> dict[str, Any]:
    paths = ["tests/gpu", "tests/checkpoint/twolevel/test_capture_seal.py"]
    r = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *paths],
             timeout)
    last = (r.stdout.strip().splitlines() or [""])[-1]
    return {"ok": r.returncode == 0, "summary": last,
            "output": _tail(r.stdout + r.stderr, 6000) if r.returncode else None}


def section_resume(device: str, tmp: str, timeout: float, quick: bool) -> dict[str, Any]:
    ref, crashed, resumed = (f"{tmp}/{n}.json" for n in ("ref", "crashed", "resumed"))
    me = [sys.executable, __file__, "--device", device]
    r = _run([*me, "--role", "reference", "--out", ref], timeout / 3)
    if r.returncode:
        return {"ok": False, "error": _tail(r.stderr)}
    r = _run([*me, "--role", "crashed", "--root", f"{tmp}/ckpt", "--out", crashed], timeout / 3)
    if r.returncode != -signal.SIGKILL:
        return {"ok": False, "error": f"rc {r.returncode}: {_tail(r.stderr)}"}
    r = _run([*me, "--role", "resumed", "--root", f"{tmp}/ckpt", "--out", resumed], timeout / 3)
    if r.returncode:
        return {"ok": False, "error": _tail(r.stderr)}
    want = json.loads(Path(ref).read_text())["losses"]
    got = json.loads(Path(resumed).read_text())
    records = json.loads(Path(crashed).read_text())["records"]
    same = bool(got["losses"]) and all(got["losses"][s] == want[s] for s in got["losses"])
    return {"ok": same and got["source"] == "memory", "bitwise": same,
            "source": got["source"], "resumed_from": min(map(int, got["losses"])) - 1,
            "checkpoints": records}


def _bench(args: list[str], tmp: str, name: str, timeout: float) -> dict[str, Any]:
    out = f"{tmp}/{name}.json"
    r = _run([sys.executable, "-m", "moc", "bench", *args, "--json", out], timeout)
    if r.returncode or not Path(out).exists():
        return {"ok": False, "error": f"rc {r.returncode}: {_tail(r.stdout + r.stderr)}"}
    return {"ok": True, "printed": _tail(r.stdout, 4000), **json.loads(Path(out).read_text())}


def section_loop(config: str) -> Callable[[str, str, float, bool], dict[str, Any]]:
    def run(device: str, tmp: str, timeout: float, quick: bool) -> dict[str, Any]:
        steps = ["--steps", "24", "--block", "3"] if quick else ["--steps", "50", "--block", "5"]
        got = _bench(["loop", "--config", config, "--device", device, *steps,
                      "--workdir", tmp], tmp, f"loop-{config}", timeout)
        got.pop("times", None)  # per step: in the printed table's means
        return got
    return run


def section_overhead(config: str, steps: int) -> Callable[[str, str, float, bool],
                                                          dict[str, Any]]:
    def run(device: str, tmp: str, timeout: float, quick: bool) -> dict[str, Any]:
        n = 10 if quick else steps
        return _bench(["overhead", "--nproc", "1", "--device", device, "--config", config,
                       "--steps", str(n), "--interval", "5", "--strategies", *STRATEGIES,
                       "--workdir", tmp, "--no-progress"], tmp, f"overhead-{config}", timeout)
    return run


def section_two_ranks(device: str, tmp: str, timeout: float, quick: bool) -> dict[str, Any]:
    import torch

    from moc.train.metrics import read_events

    if device == "cuda" and torch.cuda.device_count() < RANKS:
        return {"skipped": f"{torch.cuda.device_count()} GPU(s) here; each of the "
                           f"{RANKS} ranks needs its own"}

    def train_ranks(name: str, *extra: str) -> list[dict]:
        metrics = f"{tmp}/{name}.jsonl"
        r = _run([sys.executable, "-m", "moc", "train", "--nproc", str(RANKS), "--device",
                  device, "--config", "tiny", "--steps", str(RANKS_STEPS), "--ckpt-mode", "moc",
                  "--ckpt-interval", str(RANKS_INTERVAL), "--ckpt-dir", f"{tmp}/{name}-ckpt",
                  "--metrics", metrics, "--no-progress", *extra], timeout / 2)
        if r.returncode:
            raise RuntimeError(_tail(r.stderr))
        return read_events(metrics)

    def losses(events: list[dict]) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for e in events:
            if e["event"] == "step":
                out.setdefault(e["step"], []).append(float(e["loss"]).hex())
        return out

    straight = losses(train_ranks("straight"))
    events = train_ranks("faulted", "--fault-at", str(RANKS_FAULT_AT), "--fault-rank", "1",
                         "--max-restarts", "1")
    recoveries = [e for e in events if e["event"] == "recovery"]
    faulted = losses(events)
    same = (len(recoveries) == 1 and recoveries[0]["source"] == "memory"
            and sorted(faulted) == sorted(straight)
            and all(v == straight[s][0] for s, vs in faulted.items() for v in vs))
    return {"ok": same, "recoveries": recoveries}


SECTIONS: list[tuple[str, float, Callable[[str, str, float, bool], dict[str, Any]]]] = [
    ("info", 5, section_info),
    ("tests", 120, section_tests),
    ("resume", 70, section_resume),
    ("loop_400m", 75, section_loop("gpu-400m")),
    ("loop_800m", 110, section_loop("gpu-800m")),
    ("overhead_bench", 150, section_overhead("bench", 40)),
    ("overhead_400m", 200, section_overhead("gpu-400m", 30)),
    ("two_ranks", 90, section_two_ranks),
]
"""(name, estimated seconds on one H200, run(device, tmp, timeout, quick))."""
QUICK = {"loop_400m": "tiny", "loop_800m": "small", "overhead_bench": "tiny",
         "overhead_400m": "small"}
"""With --quick (the CPU, in tests), the presets the sections run instead."""


def criteria(r: dict[str, Any]) -> dict[str, Any]:
    """Each "Must show" figure of issue 39 against its target (None: not measured)."""
    out: dict[str, Any] = {}

    def get(section: str, key: str) -> Any:
        value = r.get(section, {})
        return value.get(key) if isinstance(value, dict) else None

    out["tests_pass"] = get("tests", "ok")
    out["resume_bitwise"] = get("resume", "bitwise")
    for name in ("loop_400m", "loop_800m"):
        paired, k = get(name, "paired_throughput"), get(name, "k_snapshot")
        out[f"{name}_paired>=0.95"] = None if paired is None else (paired >= 0.95, paired, k)
        share = get(name, "capture_vs_pinned")
        out[f"{name}_capture>=0.8_of_pinned"] = None if share is None else (share >= 0.8, share)
        worst = get(name, "worst_after_first_vs_plain")
        out[f"{name}_no_step_after_first>2x"] = None if worst is None else (worst <= 2, worst)
        failed, queued = get(name, "failed"), get(name, "queued_max_s")
        step = get(name, "step_off_s")
        out[f"{name}_seal_keeps_up"] = None if queued is None or not step else (
            failed == 0 and queued < 0.5 * step, queued)
    for name in ("overhead_bench", "overhead_400m"):
        s = get(name, "strategies") or {}
        none, dcp, moc = (s.get(k) or {} for k in ("none", "dcp-async", "moc"))
        if not (none.get("mean_step_time_s") and dcp.get("mean_step_time_s")
                and moc.get("mean_step_time_s")):
            out[f"{name}_moc_vs_dcp"] = None
            continue
        counts = (moc.get("checkpoints"), dcp.get("checkpoints"))
        tp_moc = none["mean_step_time_s"] / moc["mean_step_time_s"]
        tp_dcp = none["mean_step_time_s"] / dcp["mean_step_time_s"]
        stall = (moc.get("stall_median_s") or 0.0, dcp.get("stall_median_s") or 0.0)
        out[f"{name}_moc_vs_dcp"] = {
            "counts_equal": counts[0] == counts[1], "counts": counts,
            "throughput": (tp_moc >= tp_dcp, round(tp_moc, 4), round(tp_dcp, 4)),
            "stall": (stall[0] <= 0.1 * stall[1], stall[0], stall[1])}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default="gpu-check", help="folder for gpu-check.json")
    p.add_argument("--budget", type=float, default=540.0, help="seconds for all sections")
    p.add_argument("--quick", action="store_true",
                   help="small presets and few steps (the CPU, in the project's tests)")
    p.add_argument("--only", nargs="+", help="run these sections alone")
    p.add_argument("--role", choices=["reference", "crashed", "resumed"])
    p.add_argument("--root")
    args = p.parse_args()
    if args.role:
        train(args.device, args.root, args.role == "crashed", args.out,
              KILL_AT if args.role == "crashed" else None)
        return 0
    t0 = time.perf_counter()
    deadline = t0 + args.budget
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"device": args.device, "budget_s": args.budget,
                              "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    for name, estimate, run in SECTIONS:
        if args.only and name not in args.only:
            continue
        left = deadline - time.perf_counter()
        if args.quick and name in QUICK:
            run = (section_loop(QUICK[name]) if name.startswith("loop")
                   else section_overhead(QUICK[name], 10))
        if left < estimate and not args.quick:
            result[name] = {"skipped": f"needs about {estimate:.0f} s, {left:.0f} s left"}
            print(f"{name}: skipped ({result[name]['skipped']})", flush=True)
            continue
        s0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            try:
                result[name] = run(args.device, tmp, max(30.0, min(left, 3 * estimate)),
                                   args.quick)
            except Exception as e:  # the next sections still run
                result[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        result[name]["seconds"] = round(time.perf_counter() - s0, 1)
        ok = result[name].get("ok")
        print(f"{name}: {'-' if ok is None else ('ok' if ok else 'FAILED')} in "
              f"{result[name]['seconds']:.0f} s", flush=True)
        (out / "gpu-check.json").write_text(json.dumps(result, indent=1, default=str))
    result["criteria"] = criteria(result)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    (out / "gpu-check.json").write_text(json.dumps(result, indent=1, default=str))
    for key, value in result["criteria"].items():
        print(f"  {key}: {value}", flush=True)
    failed = [n for n, v in result.items() if isinstance(v, dict) and v.get("ok") is False]
    print(f"{'FAIL: ' + ', '.join(failed) if failed else 'PASS'} in {result['seconds']:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
