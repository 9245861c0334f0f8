"""The GPU check (issues 39 and 45): every criterion measured within a budget, one verdict.

    python scripts/gpu_check.py --device cuda --out DIR --budget 540   (scripts/gpu_check.sh)
    python scripts/gpu_check.py --device cpu --out DIR --quick          (its logic, on a CPU)

Sections, in the order of what they show (correctness before speed). Each runs in a
session of its own, killed whole (every process it started, torchrun's workers and
persist processes included) when it outlasts its time, with a temporary directory and a
shared-memory root of its own that are removed after it. A section is skipped, and said
so, when the budget left is below its estimate; the JSON is written after each.

    info           the machine, torch, which optional packages are there, moc's native code
    tests          the CUDA tests (tests/gpu: no device wait on the training thread, slots
                   pinned before the first checkpoint and again after a memory restore,
                   fused and capturable AdamW and dropout resumed bitwise) and a SIGKILL
                   between capture and seal, each test's outcome from pytest's JUnit XML
    resume         a run SIGKILLed after step KILL_AT resumes from memory; every loss after
                   it bitwise equal to an uninterrupted run's
    restore_pinned gpu-400m checkpointed, its memory restored in a new engine, then
                   checkpointed again: the slots pinned, and the capture against the pinned
                   device-to-host bandwidth
    two_ranks      `moc train --nproc 2`, a rank SIGKILLed: restarted by torchrun, and in-job
                   (the survivor keeps its process); every loss bitwise. Only where every
                   rank has a GPU of its own (on the CPU: gloo)
    loop_400m      `moc bench loop`: a checkpoint every step (K_snapshot 16 of 16) paired
    loop_800m      against none in one run; the capture against pinned device-to-host; the
                   seal; the training thread's launch time with a snapshot in flight
    overhead_400m  `moc bench overhead --nproc 1` at a checkpoint every 5 steps: none,
    overhead_bench dcp-async and moc side by side, their checkpoint counts

`criteria` sets every figure of issues 39 and 45 against its target, and `verdict`
reads them all: PASS only when every criterion that applies here is measured and met;
FAIL names each one not met; NOT MEASURED names each one missing (a section skipped,
failed to run, or a figure this device cannot give). Exit status 0, 1 and 2. Criteria
that need hardware this machine does not have (two_ranks on one GPU) do not apply.

The estimates are each section's seconds on one H200, from the steps measured there on
2026-12-04 (gpu-400m: 195 ms a step, gpu-800m: 390 ms; a process's start with CUDA:
about 10 s) and this script's sections timed on the CPU; each run records every
section's seconds in the JSON, to set them from.
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
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STEPS, INTERVAL, KILL_AT = 30, 5, 22
RANKS, RANKS_STEPS, RANKS_INTERVAL, RANKS_FAULT_AT = 2, 20, 5, 13
STRATEGIES = ["none", "dcp-async", "moc"]
"""What the overhead criteria compare (blocking has none: it is not run, to fit the
budget)."""
KEEP_LAST = 2
"""Checkpoints each training run keeps: a full gpu-400m checkpoint is 4.6 GB, and a run
that kept all of them filled the H200's disk (2026-12-04)."""
DISK_LIMIT_BYTES = 10e9
"""What a section may hold on disk at its peak."""
INJOB_DOWNTIME_S = 60.0
"""An in-job recovery's bound: under NCCL's collective timeout floor, so a recovery that
waited one out (not freed by the heartbeat's abort) fails it."""
OPTIONAL = ("crc32c", "safetensors", "tqdm", "xxhash", "numpy")
ROOT = Path(__file__).resolve().parents[1]


# -- the roles: processes the sections start ----------------------------------------------

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
                                    interval=INTERVAL, persist_policy="wait",
                                    keep_last=KEEP_LAST)
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


def pinned_after_restore(device: str, config: str, root: str, out: str) -> None:
    """Checkpoint a preset's model every step, keep its memory as a crash would, restore
    it into a new model and engine (from memory), checkpoint again: whether the slots the
    restore read are pinned for the copies that follow, and those copies' bandwidth
    against the pinned device-to-host bandwidth of this device, in the same process."""
    import statistics

    import torch

    from moc import PECPolicy, TwoLevelCheckpointer
    from moc.bench.overhead import d2h_bandwidth
    from moc.model import Transformer
    from moc.train.config import PRESETS

    preset = PRESETS[config]
    cfg, batch = preset["model"], preset["batch_size"]

    def engine(seed: int) -> tuple[Any, Any, Any]:
        torch.manual_seed(seed)
        model = Transformer(cfg).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=preset["lr"])
        return model, opt, TwoLevelCheckpointer(model, opt, root, policy=PECPolicy(k=1),
                                                interval=1, k_snapshot="all",
                                                keep_last=KEEP_LAST)

    def steps(model: Any, opt: Any, ckpt: Any, first: int, n: int) -> list[Any]:
        results = []
        g = torch.Generator().manual_seed(0)
        for step in range(first, first + n):
            x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=g)
            x = x.to(device)
            model(x[:, :-1], x[:, 1:]).loss.backward()
            ckpt.wait_for_snapshot()
            opt.step()
            opt.zero_grad(set_to_none=True)
            ckpt.save(step)
            results += ckpt.drain_completed() if ckpt.pending else []
        ckpt.flush()
        return results + ckpt.drain_completed()

    model, opt, ckpt = engine(0)
    steps(model, opt, ckpt, 1, 3)
    ckpt.close(keep_snapshots=True)  # as after a crash: the memory survives
    del model, opt, ckpt
    if device == "cuda":
        torch.cuda.empty_cache()
    model, opt, ckpt = engine(1)
    report = ckpt.restore()
    after = steps(model, opt, ckpt, report.step + 1, 5)
    pinned = ckpt.snapshots.store.pinned
    ckpt.close()
    ok = [r for r in after if r.error is None]
    capture = statistics.median(r.copy_Bps for r in ok[1:] if r.copy_Bps) if ok[1:] else None
    d2h = d2h_bandwidth(pinned=True) if device == "cuda" else None
    Path(out).write_text(json.dumps({
        "restored": report.step, "source": report.source, "pinned": pinned,
        "checkpoints": len(ok), "failed": len(after) - len(ok), "capture_Bps": capture,
        "d2h_pinned_Bps": d2h,
        "capture_vs_pinned": capture / d2h if capture and d2h else None}))


# -- running processes: each section's in a session of its own ------------------------------

@dataclass(frozen=True)
class Ran:
    rc: int | None
    """None: killed at its time limit."""
    stdout: str
    stderr: str


def _proc_stat(pid: int) -> tuple[int, int] | None:
    """(parent, session) of a live process, from /proc; None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[1]), int(fields[3])


def _tree(root: int, alive: bool) -> set[int]:
    """Every live process of the session `root` leads (`root` made it), whatever its
    parent now (an orphaned persist process), and, while `root` itself is `alive` (not
    reaped: its pid cannot have been reused), `root` and its descendants (a torchrun
    agent in a session of its own among them)."""
    stats = {int(p): s for p in os.listdir("/proc") if p.isdigit()
             if (s := _proc_stat(int(p))) is not None}
    found = {pid for pid, (_, session) in stats.items() if session == root}
    if alive:
        children: dict[int, list[int]] = {}
        for pid, (parent, _) in stats.items():
            children.setdefault(parent, []).append(pid)
        seen, todo = set(), [root]
        while todo:
            pid = todo.pop()
            if pid not in seen:
                seen.add(pid)
                todo += children.get(pid, [])
        found |= seen
    return found - {os.getpid()}


def _kill_tree(root: int, alive: bool) -> int:
    """SIGKILL everything `_tree` finds (twice, for what started meanwhile); how many."""
    killed: set[int] = set()
    for _ in range(2):
        for pid in _tree(root, alive) - killed:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except OSError:
                pass
        time.sleep(0.2)
    return len(killed)


def run(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> Ran:
    """`cmd` in the checkout's root (moc on its path), in a session of its own, its
    output captured in files (a pipe fills up and stalls a chatty child). At `timeout`,
    and after it exits, every process it left is killed: a section never leaves a
    process holding the GPU or shared memory."""
    full = {**os.environ, **(env or {}),
            "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(cmd, cwd=ROOT, env=full, stdout=out, stderr=err, text=True,
                                 start_new_session=True)
        try:
            rc: int | None = child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        left = _kill_tree(child.pid, alive=rc is None)
        child.wait()
        out.seek(0)
        err.seek(0)
        stderr = err.read()
        if rc is None:
            stderr += f"\ngpu_check: killed at its limit of {timeout:.0f} s ({left} processes)"
        return Ran(rc, out.read(), stderr)


def _tail(text: str, n: int = 3000) -> str:
    return text[-n:]


# -- the sections -------------------------------------------------------------------------

@dataclass(frozen=True)
class Ctx:
    """What a section runs with."""

    device: str
    tmp: str
    """Its own temporary directory, removed after it."""
    env: dict[str, str]
    """Its environment: its own shared-memory root (MOC_SHM_ROOT, and MOC_TEST_SHM_BASE
    for the tests' slots)."""
    timeout: float
    quick: bool


def section_info(c: Ctx) -> dict[str, Any]:
    import importlib.util

    import torch

    from moc.checkpoint.twolevel.memory import native
    info: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__,
        "packages": {n: importlib.util.find_spec(n) is not None for n in OPTIONAL},
        "native_batched": native.BATCHED, "native_streaming": native.STREAMING,
        "hash_threads": native.default_threads(), "cpus": os.cpu_count(),
        "xxh3_kernel": getattr(native.streamcopy, "XXH3_KERNEL", None),
        "shm_root": c.env["MOC_SHM_ROOT"],
        "shm_free_bytes": shutil.disk_usage(c.env["MOC_SHM_ROOT"]).free,
        "disk_free_bytes": shutil.disk_usage(c.tmp).free, "gpus": 0}
    if c.device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpus"] = torch.cuda.device_count()
    return info


TESTS = ["tests/gpu", "tests/checkpoint/twolevel/test_capture_seal.py"]


def section_tests(c: Ctx) -> dict[str, Any]:
    """pytest over TESTS; every test's outcome, read from its JUnit XML."""
    xml = Path(c.tmp) / "junit.xml"
    r = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o",
             "addopts=", f"--junitxml={xml}", *TESTS], c.timeout, c.env)
    outcomes: dict[str, str] = {}
    if xml.exists():
        for case in ET.parse(xml).getroot().iter("testcase"):
            kinds = {child.tag for child in case}
            outcome = ("failed" if kinds & {"failure", "error"} else
                       "skipped" if "skipped" in kinds else "passed")
            outcomes[f"{case.get('classname')}::{case.get('name')}"] = outcome
    last = (r.stdout.strip().splitlines() or [""])[-1]
    return {"ok": r.rc == 0 and bool(outcomes), "summary": last, "tests": outcomes,
            "output": _tail(r.stdout + r.stderr, 6000) if r.rc else None}


def section_resume(c: Ctx) -> dict[str, Any]:
    ref, crashed, resumed = (f"{c.tmp}/{n}.json" for n in ("ref", "crashed", "resumed"))
    me = [sys.executable, __file__, "--device", c.device]
    r = run([*me, "--role", "reference", "--out", ref], c.timeout / 3, c.env)
    if r.rc:
        return {"ok": False, "error": _tail(r.stderr)}
    r = run([*me, "--role", "crashed", "--root", f"{c.tmp}/ckpt", "--out", crashed],
            c.timeout / 3, c.env)
    if r.rc != -signal.SIGKILL:
        return {"ok": False, "error": f"rc {r.rc}: {_tail(r.stderr)}"}
    r = run([*me, "--role", "resumed", "--root", f"{c.tmp}/ckpt", "--out", resumed],
            c.timeout / 3, c.env)
    if r.rc:
        return {"ok": False, "error": _tail(r.stderr)}
    want = json.loads(Path(ref).read_text())["losses"]
    got = json.loads(Path(resumed).read_text())
    records = json.loads(Path(crashed).read_text())["records"]
    same = bool(got["losses"]) and all(got["losses"][s] == want[s] for s in got["losses"])
    return {"ok": same and got["source"] == "memory", "bitwise": same,
            "source": got["source"], "resumed_from": min(map(int, got["losses"])) - 1,
            "checkpoints": records}


def section_restore_pinned(config: str) -> Callable[[Ctx], dict[str, Any]]:
    def run_it(c: Ctx) -> dict[str, Any]:
        out = f"{c.tmp}/pinned.json"
        r = run([sys.executable, __file__, "--device", c.device, "--role", "pinned",
                 "--config", config, "--root", f"{c.tmp}/ckpt", "--out", out],
                c.timeout, c.env)
        if r.rc or not Path(out).exists():
            return {"ok": False, "error": f"rc {r.rc}: {_tail(r.stderr)}"}
        return {"ok": True, "config": config, **json.loads(Path(out).read_text())}
    return run_it


def _bench(c: Ctx, args: list[str], name: str) -> dict[str, Any]:
    out = f"{c.tmp}/{name}.json"
    r = run([sys.executable, "-m", "moc", "bench", *args, "--json", out], c.timeout, c.env)
    if r.rc or not Path(out).exists():
        return {"ok": False, "error": f"rc {r.rc}: {_tail(r.stdout + r.stderr)}"}
    return {"ok": True, "printed": _tail(r.stdout, 4000), **json.loads(Path(out).read_text())}


def section_loop(config: str) -> Callable[[Ctx], dict[str, Any]]:
    def run_it(c: Ctx) -> dict[str, Any]:
        steps = ["--steps", "24", "--block", "3"] if c.quick else ["--steps", "40",
                                                                   "--block", "5"]
        got = _bench(c, ["loop", "--config", config, "--device", c.device, *steps,
                         "--workdir", c.tmp], f"loop-{config}")
        got.pop("times", None)  # per step: in the printed table's means
        return got
    return run_it


def section_overhead(config: str, steps: int) -> Callable[[Ctx], dict[str, Any]]:
    def run_it(c: Ctx) -> dict[str, Any]:
        return _bench(c, ["overhead", "--nproc", "1", "--device", c.device, "--config",
                          config, "--steps", str(steps), "--interval", "5",
                          "--strategies", *STRATEGIES, "--keep-last", str(KEEP_LAST),
                          "--workdir", c.tmp, "--no-progress"], f"overhead-{config}")
    return run_it


NCCL_NOTE = "in-job recovery on NCCL"
"""The start of the one line `moc train` prints when in-job recovery runs on NCCL."""
FAULTS = {"restart": ["--recovery", "restart", "--max-restarts", "1"],
          "in-job": ["--recovery", "in-job"],
          "in-job-hang": ["--recovery", "in-job", "--fault-kind", "hang",
                          "--hang-timeout", "10"]}
"""two_ranks' faulted runs: rank 1 SIGKILLed at RANKS_FAULT_AT and torchrun restarting
the job; the same with its host replacing it in-job; rank 1 SIGSTOPped, found hung by
its host and replaced, the survivor freed from its wait (on NCCL: by the heartbeat's
abort of its communicators)."""


def section_two_ranks(c: Ctx) -> dict[str, Any]:
    """`moc train --nproc 2` straight, then rank 1 SIGKILLed or SIGSTOPped under each
    recovery (FAULTS). In-job: rank 0's process is kept, the one recovery comes from
    memory within a bound, and on NCCL the unverified line is said once."""
    from moc.train.metrics import read_events

    def train_ranks(name: str, *extra: str) -> tuple[list[dict], str]:
        metrics = f"{c.tmp}/{name}.jsonl"
        r = run([sys.executable, "-m", "moc", "train", "--nproc", str(RANKS), "--device",
                 c.device, "--config", "tiny", "--steps", str(RANKS_STEPS), "--ckpt-mode",
                 "moc", "--ckpt-interval", str(RANKS_INTERVAL), "--keep-last",
                 str(KEEP_LAST), "--ckpt-dir", f"{c.tmp}/{name}-ckpt", "--metrics", metrics,
                 "--no-progress", *extra], c.timeout / (len(FAULTS) + 1), c.env)
        if r.rc:
            raise RuntimeError(f"{name}: rc {r.rc}: {_tail(r.stderr)}")
        return read_events(metrics), r.stderr

    def losses(events: list[dict]) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for e in events:
            if e["event"] == "step":
                out.setdefault(e["step"], []).append(float(e["loss"]).hex())
        return out

    straight = losses(train_ranks("straight", "--recovery", "restart")[0])
    out: dict[str, Any] = {"ok": True}
    for name, extra in FAULTS.items():
        events, stderr = train_ranks(name, "--fault-at", str(RANKS_FAULT_AT),
                                     "--fault-rank", "1", *extra)
        recoveries = [e for e in events if e["event"] == "recovery"]
        pids = [e["pids"] for e in events if e["event"] == "placement"]
        got = losses(events)
        bitwise = (sorted(got) == sorted(straight)
                   and all(v == straight[s][0] for s, vs in got.items() for v in vs))
        one = recoveries[0] if len(recoveries) == 1 else {}
        out[name] = {
            "bitwise": bitwise, "recoveries": recoveries,
            "kind": one.get("kind"), "source": one.get("source"),
            "downtime_s": one.get("downtime_s"), "replaced": one.get("replaced"),
            "survivor_kept": len(pids) >= 2 and pids[0][0] == pids[-1][0]
            and pids[0][1] != pids[-1][1],
            "nccl_notes": stderr.count(NCCL_NOTE)}
        out["ok"] = out["ok"] and bitwise and len(recoveries) == 1
    return out


@dataclass(frozen=True)
class Section:
    name: str
    estimate_s: float
    """Seconds on one H200 (see the module's docstring)."""
    run: Callable[[Ctx], dict[str, Any]]
    quick: Callable[[Ctx], dict[str, Any]] | None = None
    """What runs instead with --quick (small presets, on the CPU)."""


SECTIONS = [
    Section("info", 5, section_info),
    Section("tests", 75, section_tests),
    Section("resume", 40, section_resume),
    Section("restore_pinned", 45, section_restore_pinned("gpu-400m"),
            section_restore_pinned("tiny")),
    Section("two_ranks", 150, section_two_ranks),
    Section("loop_400m", 60, section_loop("gpu-400m"), section_loop("tiny")),
    Section("loop_800m", 80, section_loop("gpu-800m"), section_loop("small")),
    Section("overhead_400m", 150, section_overhead("gpu-400m", 20),
            section_overhead("small", 10)),
    Section("overhead_bench", 80, section_overhead("bench", 20), section_overhead("tiny", 10)),
]


def applies(name: str, device: str, gpus: int) -> bool:
    """Whether a section can run on this machine: two_ranks needs a GPU per rank."""
    return not (name == "two_ranks" and device == "cuda" and gpus < RANKS)


# -- criteria and the verdict -------------------------------------------------------------

MET, NOT_MET, MISSING, NOT_APPLICABLE = "met", "not met", "not measured", "not applicable"


def _judge(value: Any, ok: Callable[[Any], bool], target: str, why: str = "") -> dict[str, Any]:
    """One criterion: `value` measured (None: not) against `ok`."""
    if value is None:
        return {"status": MISSING, "target": target, "why": why or "no figure"}
    return {"status": MET if ok(value) else NOT_MET, "value": value, "target": target}


def _get(r: dict[str, Any], section: str, *path: str) -> Any:
    value: Any = r.get(section)
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _why(r: dict[str, Any], section: str) -> str:
    """Why a section gave no figure: skipped, failed, or not run."""
    s = r.get(section)
    if not isinstance(s, dict):
        return f"{section} did not run"
    if "skipped" in s:
        return f"{section} skipped: {s['skipped']}"
    if s.get("ok") is False:
        return f"{section} failed: {str(s.get('error', ''))[-300:]}"
    return ""


GPU_TESTS = {
    "tests.sync_free_checkpointed_steps": "test_a_checkpointed_step_never_waits_for_the_device",
    "tests.slots_pinned_before_first_checkpoint": "pinned_and_ready_before_the_first",
    "tests.slots_pinned_after_memory_restore": "pinned_again_after_a_restore_from_memory",
    "tests.sigkill_between_capture_and_seal": "killed_between_capture_and_seal",
    "tests.fused_adamw_resumes_bitwise": "restored_from_memory_steps_on_bitwise[fused",
    "tests.capturable_adamw_resumes_bitwise": "restored_from_memory_steps_on_bitwise[capt",
    "tests.dropout_resumes_bitwise": "restored_from_memory_steps_on_bitwise[dropout",
}
"""Criteria read from single tests: the test ids (a substring) each stands for. A test
that was skipped, or is not there, measures nothing."""


def _tests_criterion(r: dict[str, Any], device: str, needle: str) -> dict[str, Any]:
    tests = _get(r, "tests", "tests") or {}
    mine = {k: v for k, v in tests.items() if needle in k
            and not (device == "cuda" and k.endswith("[cpu]"))}
    ran = {k: v for k, v in mine.items() if v != "skipped"}
    why = _why(r, "tests") or (f"{len(mine)} test(s) matching {needle!r}, all skipped"
                               if mine else f"no test matching {needle!r}")
    value = (all(v == "passed" for v in ran.values())
             if ran and len(ran) == len(mine) else None)
    return _judge(value, bool, "passed, none skipped", why)


def criteria(r: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every figure of issues 39 and 45 against its target (see `_judge`)."""
    device = r.get("device", "cuda")
    gpus = _get(r, "info", "gpus") or 0
    out: dict[str, dict[str, Any]] = {}
    outcomes = list((_get(r, "tests", "tests") or {}).values())
    # A test that failed fails this; one skipped (or none found) measures nothing.
    all_ran = (False if "failed" in outcomes else
               None if "skipped" in outcomes or "passed" not in outcomes else True)
    out["tests.all_pass_none_skipped"] = _judge(
        all_ran if device == "cuda" else None, bool, "every test passed, none skipped",
        _why(r, "tests") or ("on a GPU only" if device != "cuda" else
                             f"{outcomes.count('skipped')} skipped of {len(outcomes)}"))
    for name, needle in GPU_TESTS.items():
        out[name] = _tests_criterion(r, device, needle)
    out["resume.bitwise_from_memory"] = _judge(
        None if _get(r, "resume", "bitwise") is None
        else (_get(r, "resume", "bitwise"), _get(r, "resume", "source")),
        lambda v: v[0] is True and v[1] == "memory", "bitwise, from memory",
        _why(r, "resume"))
    why = _why(r, "restore_pinned")
    out["restore_pinned.from_memory"] = _judge(
        _get(r, "restore_pinned", "source"), lambda v: v == "memory", "memory", why)
    out["restore_pinned.slots_pinned"] = _judge(
        _get(r, "restore_pinned", "pinned"), lambda v: v is True, "every slot pinned",
        why or "no GPU to pin for")
    out["restore_pinned.capture>=0.8_of_pinned"] = _judge(
        _get(r, "restore_pinned", "capture_vs_pinned"), lambda v: v >= 0.8, ">= 0.8",
        why or "no pinned device-to-host figure (no GPU)")
    out.update(_two_ranks_criteria(r, device, gpus))
    for name in ("loop_400m", "loop_800m"):
        out.update(_loop_criteria(r, name))
    for name in ("overhead_400m", "overhead_bench"):
        out.update(_overhead_criteria(r, name))
    peaks = [s.get("disk_peak_bytes") for s in r.values()
             if isinstance(s, dict) and s.get("disk_peak_bytes") is not None]
    out["disk_peak<=10GB"] = _judge(max(peaks) if peaks else None,
                                    lambda v: v <= DISK_LIMIT_BYTES, "<= 10 GB")
    return out


def _two_ranks_criteria(r: dict[str, Any], device: str, gpus: int
                        ) -> dict[str, dict[str, Any]]:
    """Each faulted run of two_ranks: one recovery, every loss bitwise; in-job also the
    survivor's process kept, a recovery from memory within INJOB_DOWNTIME_S, and on
    NCCL the unverified line once."""
    out: dict[str, dict[str, Any]] = {}
    why = _why(r, "two_ranks")
    for name in FAULTS:
        key = f"two_ranks.{name}"
        if not applies("two_ranks", device, gpus):
            out[key] = {"status": NOT_APPLICABLE, "why": f"{gpus} GPU(s): needs {RANKS}"}
            continue
        got = _get(r, "two_ranks", name)
        if name == "restart":
            value = None if got is None else (got["bitwise"], len(got["recoveries"]))
            out[key] = _judge(value, lambda v: v[0] is True and v[1] == 1,
                              "one recovery, every loss bitwise", why)
            continue
        value = None if got is None else {
            k: got[k] for k in ("bitwise", "kind", "source", "replaced", "survivor_kept",
                                "downtime_s", "nccl_notes")}
        notes = 1 if device == "cuda" else 0
        out[key] = _judge(value, lambda v, n=notes: (
            v["bitwise"] is True and v["kind"] == "in-job" and v["source"] == "memory"
            and v["replaced"] == [1] and v["survivor_kept"] is True
            and v["downtime_s"] is not None and v["downtime_s"] < INJOB_DOWNTIME_S
            and v["nccl_notes"] == n),
            f"one in-job recovery from memory, rank 1 replaced, rank 0's process kept, "
            f"downtime < {INJOB_DOWNTIME_S:.0f} s, every loss bitwise", why)
    return out


def _loop_criteria(r: dict[str, Any], name: str) -> dict[str, dict[str, Any]]:
    why = _why(r, name)

    def get(key: str) -> Any:
        return _get(r, name, key)

    paired, k = get("paired_throughput"), get("k_snapshot")
    on, off = get("fwd_bwd_on_s"), get("fwd_bwd_off_s")
    queued, step, failed = get("queued_max_s"), get("step_off_s"), get("failed")
    return {
        f"{name}.paired>=0.95": _judge(None if paired is None else (paired, k),
                                       lambda v: v[0] >= 0.95, ">= 0.95 (paired, K)", why),
        f"{name}.capture>=0.8_of_pinned": _judge(
            get("capture_vs_pinned"), lambda v: v >= 0.8, ">= 0.8",
            why or "no pinned device-to-host figure (no GPU)"),
        f"{name}.no_step_after_first>2x": _judge(get("worst_after_first_vs_plain"),
                                                 lambda v: v <= 2, "<= 2x a plain step", why),
        f"{name}.seal_keeps_up": _judge(
            None if queued is None or not step or failed is None else (failed, queued, step),
            lambda v: v[0] == 0 and v[1] < 0.5 * v[2],
            "no failed checkpoint; queued < half a step", why),
        f"{name}.launch_with_snapshot<=1.10x": _judge(
            None if not on or not off else on / off, lambda v: v <= 1.10,
            "forward+backward on the training thread with a snapshot in flight <= 1.10x "
            "without", why)}


def _overhead_criteria(r: dict[str, Any], name: str) -> dict[str, dict[str, Any]]:
    why = _why(r, name)
    s = _get(r, name, "strategies") or {}
    none, dcp, moc = (s.get(k) or {} for k in ("none", "dcp-async", "moc"))
    counts = (moc.get("checkpoints"), dcp.get("checkpoints"))
    out = {f"{name}.counts_equal": _judge(
        None if None in counts or not any(counts) else counts,
        lambda v: v[0] == v[1], "moc's checkpoints == dcp-async's, > 0",
        why or ("neither checkpointed" if counts == (0, 0) else ""))}
    times = [x.get("mean_step_time_s") for x in (none, dcp, moc)]
    out[f"{name}.throughput_moc>=dcp"] = _judge(
        None if not all(times) or not any(counts) else
        (round(times[0] / times[2], 4), round(times[0] / times[1], 4)),
        lambda v: v[0] >= v[1], "moc's throughput >= dcp-async's", why)
    stalls = (moc.get("stall_median_s"), dcp.get("stall_median_s"))
    out[f"{name}.stall_moc<=0.1_dcp"] = _judge(
        None if None in stalls or not all(counts) else stalls,
        lambda v: v[0] <= 0.1 * v[1], "moc's median stall <= 0.1 of dcp-async's",
        why or "a strategy without checkpoints has no stall")
    return out


def verdict(crit: dict[str, dict[str, Any]]) -> tuple[str, list[str], list[str]]:
    """PASS when every criterion that applies is met; else FAIL (with the ones not met)
    or NOT MEASURED (with the ones missing): (verdict, not met, not measured)."""
    failed = [k for k, v in crit.items() if v["status"] == NOT_MET]
    missing = [k for k, v in crit.items() if v["status"] == MISSING]
    return ("FAIL" if failed else "NOT MEASURED" if missing else "PASS"), failed, missing


EXIT = {"PASS": 0, "FAIL": 1, "NOT MEASURED": 2}


def verdict_line(crit: dict[str, dict[str, Any]], seconds: float) -> str:
    word, failed, missing = verdict(crit)
    parts = [word]
    if failed:
        parts.append(f"not met: {', '.join(failed)}")
    if missing:
        parts.append(f"not measured: {', '.join(missing)}")
    return f"{'; '.join(parts)} (in {seconds:.0f} s)"


# -- the run ------------------------------------------------------------------------------

class DiskPeak:
    """The most the file system of `path` held above what it held at the start, sampled
    every second on a thread while a section runs."""

    def __init__(self, path: str) -> None:
        self.path, self.base, self.peak = path, shutil.disk_usage(path).used, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(1.0):
            self.peak = max(self.peak, shutil.disk_usage(self.path).used - self.base)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def run_section(s: Section, device: str, quick: bool, timeout: float, shm_base: Path
                ) -> dict[str, Any]:
    """One section in a temporary directory and a shared-memory root of its own, both
    removed after it, whatever happened."""
    tmp = tempfile.mkdtemp(prefix=f"gpu-check-{s.name}-")
    shm = shm_base / f"moc-gpu-check-{os.getpid()}-{s.name}"
    shm.mkdir(mode=0o700, parents=True)
    env = {"MOC_SHM_ROOT": str(shm), "MOC_TEST_SHM_BASE": str(shm)}
    disk = DiskPeak(tmp)
    try:
        body = s.quick if quick and s.quick is not None else s.run
        result = body(Ctx(device, tmp, env, timeout, quick))
    except Exception as e:  # the next sections still run
        result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    finally:
        result_disk = disk.stop()
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    result["disk_peak_bytes"] = result_disk
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default="gpu-check", help="folder for gpu-check.json")
    p.add_argument("--budget", type=float, default=540.0, help="seconds for all sections")
    p.add_argument("--quick", action="store_true",
                   help="small presets and few steps (the CPU, in the project's tests)")
    p.add_argument("--only", nargs="+", help="run these sections alone")
    p.add_argument("--role", choices=["reference", "crashed", "resumed", "pinned"])
    p.add_argument("--root")
    p.add_argument("--config", default="tiny")
    args = p.parse_args()
    if args.role == "pinned":
        pinned_after_restore(args.device, args.config, args.root, args.out)
        return 0
    if args.role:
        train(args.device, args.root, args.role == "crashed", args.out,
              KILL_AT if args.role == "crashed" else None)
        return 0
    t0 = time.perf_counter()
    deadline = t0 + args.budget
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shm_base = Path(os.environ.get("MOC_SHM_ROOT", "/dev/shm"))
    result: dict[str, Any] = {"device": args.device, "budget_s": args.budget,
                              "quick": args.quick, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    for s in SECTIONS:
        if args.only and s.name not in args.only:
            continue
        left = deadline - time.perf_counter()
        gpus = _get(result, "info", "gpus") or 0
        if not applies(s.name, args.device, gpus):
            result[s.name] = {"skipped": f"{gpus} GPU(s): it needs one per rank ({RANKS})"}
        elif left < s.estimate_s and not args.quick:
            result[s.name] = {"skipped": f"needs about {s.estimate_s:.0f} s, {left:.0f} s left"}
        if "skipped" in result.get(s.name, {}):
            print(f"{s.name}: skipped ({result[s.name]['skipped']})", flush=True)
            continue
        timeout = 900.0 if args.quick else min(left, 2 * s.estimate_s)
        s0 = time.perf_counter()
        result[s.name] = run_section(s, args.device, args.quick, timeout, shm_base)
        result[s.name]["seconds"] = round(time.perf_counter() - s0, 1)
        ok = result[s.name].get("ok")
        print(f"{s.name}: {'-' if ok is None else ('ok' if ok else 'FAILED')} in "
              f"{result[s.name]['seconds']:.0f} s", flush=True)
        (out / "gpu-check.json").write_text(json.dumps(result, indent=1, default=str))
    crit = criteria(result)
    result["criteria"] = crit
    result["seconds"] = round(time.perf_counter() - t0, 1)
    word, failed, missing = verdict(crit)
    result["verdict"] = {"verdict": word, "not_met": failed, "not_measured": missing}
    (out / "gpu-check.json").write_text(json.dumps(result, indent=1, default=str))
    for key, v in crit.items():
        shown = v.get("value", v.get("why", ""))
        print(f"  [{v['status']}] {key}: {shown} (target {v.get('target', '-')})", flush=True)
    print(verdict_line(crit, result["seconds"]), flush=True)
    return EXIT[word]


if __name__ == "__main__":
    sys.exit(main())
