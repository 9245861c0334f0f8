"""End-to-end check of the two-level path on one device (CUDA, or the CPU).

    python scripts/gpu_check.py --device cuda     (scripts/gpu_check.sh)

Three processes train the same MoE model with the same batches:
  reference   STEPS steps straight;
  crashed     two-level checkpoints (complete snapshot in shared memory, K_persist = 1)
              every INTERVAL steps, SIGKILLs itself right after step KILL_AT;
  resumed     restores (from memory: the snapshot survived the process) and finishes.
The check passes when the resumed run's losses equal the reference's bit for bit. It
also prints the snapshot copy time and the stall per checkpoint, which on a GPU measure
the pinned side-stream copy.

Then two ranks (`moc train --nproc 2 --device DEVICE --ckpt-mode moc`, NCCL on CUDA):
a straight run, and one whose rank 1 is SIGKILLed at step RANKS_FAULT_AT and restarted
by torchrun; it passes when the restarted run recovers from memory and every loss it
logged equals the straight run's bit for bit. Each rank needs a GPU of its own: on a
machine with fewer GPUs than RANKS this part says so and is skipped (the one-process
check above still ran on the GPU), rather than run on the CPU, which would not check
the GPU path it is here for.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STEPS, INTERVAL, KILL_AT = 30, 5, 22
RANKS, RANKS_STEPS, RANKS_INTERVAL, RANKS_FAULT_AT = 2, 20, 5, 13


def train(device: str, root: str | None, start_fresh: bool, out: str, kill_at: int | None
          ) -> None:
    import torch

    from moc import PECPolicy, TwoLevelCheckpointer
    from moc.model import ModelConfig, Transformer

    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    cfg = ModelConfig(seq_len=64, d_model=128, n_layers=4, n_heads=4, d_ffn=512, n_experts=8)
    model = Transformer(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ckpt = None
    start = 1
    if root is not None:
        ckpt = TwoLevelCheckpointer(model, opt, root, policy=PECPolicy(k=1),
                                    interval=INTERVAL, persist_policy="wait")
        report = None if start_fresh else ckpt.restore()
        if report is not None:
            start = report.step + 1
            print(f"restored step {report.step} from {report.source} in "
                  f"{report.recovery_s:.3f}s, lost tokens {report.lost_tokens}", flush=True)
    losses, records = {}, []
    for step in range(start, STEPS + 1):
        g = torch.Generator().manual_seed(step)
        idx = torch.randint(0, 256, (8, cfg.seq_len + 1), generator=g).to(device)
        out_ = model(idx[:, :-1], idx[:, 1:])
        out_.loss.backward()
        if ckpt is not None:
            ckpt.wait_for_snapshot()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses[step] = out_.loss.item()
        if ckpt is not None:
            ckpt.record_routing(out_.tokens_per_expert)
            ckpt.maybe_save(step, {"step": step})
            records += [{"step": r.step, "snapshot_s": r.snapshot_s, "stall_s": r.stall_s}
                        for r in ckpt.drain_completed()]
        Path(out).write_text(json.dumps({"losses": losses, "records": records}))
        if kill_at == step:
            if ckpt is not None:
                ckpt.flush()  # the checkpoint of this step is in memory and on disk
            os.kill(os.getpid(), signal.SIGKILL)
    if ckpt is not None:
        ckpt.close()
    Path(out).write_text(json.dumps({"losses": losses, "records": records}))


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True)


def two_ranks(device: str, tmp: str) -> bool | None:
    """The 2-rank check (module docstring); None when it cannot run here."""
    import torch

    from moc.train.metrics import read_events

    if device == "cuda" and torch.cuda.device_count() < RANKS:
        print(f"SKIP {RANKS} ranks: {torch.cuda.device_count()} GPU(s) here, each rank "
              f"needs its own; run on a machine with {RANKS} or more", flush=True)
        return None

    def train_ranks(name: str, *extra: str) -> list[dict]:
        metrics = f"{tmp}/{name}.jsonl"
        r = subprocess.run(
            [sys.executable, "-m", "moc", "train", "--nproc", str(RANKS), "--device", device,
             "--config", "tiny", "--steps", str(RANKS_STEPS), "--ckpt-mode", "moc",
             "--ckpt-interval", str(RANKS_INTERVAL), "--ckpt-dir", f"{tmp}/{name}-ckpt",
             "--metrics", metrics, "--no-progress", *extra],
            capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-3000:]
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
    for r in recoveries:
        print(f"{RANKS} ranks: rank 1 killed at step {RANKS_FAULT_AT}, resumed from step "
              f"{r['resumed_from']} ({r['source']}) in {r['recovery_s']:.3f}s", flush=True)
    print(f"device {device}, {RANKS} ranks: losses after the restart bitwise equal to the "
          f"straight run: {same}", flush=True)
    return same


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cuda")
    p.add_argument("--role", choices=["reference", "crashed", "resumed"])
    p.add_argument("--root")
    p.add_argument("--out")
    args = p.parse_args()
    if args.role:
        train(args.device, args.root, args.role == "crashed", args.out,
              KILL_AT if args.role == "crashed" else None)
        return 0
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        ref, crashed, resumed = (f"{tmp}/{n}.json" for n in ("ref", "crashed", "resumed"))
        r = run("--device", args.device, "--role", "reference", "--out", ref)
        assert r.returncode == 0, r.stderr
        r = run("--device", args.device, "--role", "crashed", "--root", f"{tmp}/ckpt",
                "--out", crashed)
        assert r.returncode == -signal.SIGKILL, (r.returncode, r.stderr)
        r = run("--device", args.device, "--role", "resumed", "--root", f"{tmp}/ckpt",
                "--out", resumed)
        assert r.returncode == 0, r.stderr
        print(r.stdout.strip())
        want = json.loads(Path(ref).read_text())["losses"]
        got = json.loads(Path(resumed).read_text())
        records = json.loads(Path(crashed).read_text())["records"]
        same = all(got["losses"][s] == want[s] for s in got["losses"])
        print(f"device {args.device}: resumed steps {min(map(int, got['losses']))}-{STEPS}, "
              f"losses bitwise equal to the uninterrupted run: {same}")
        for rec in records:
            print(f"  checkpoint {rec['step']}: snapshot {rec['snapshot_s']:.4f}s, "
                  f"stall {rec['stall_s']:.4f}s")
        ranks = two_ranks(args.device, tmp)
        same = same and ranks is not False
    print(f"{'PASS' if same else 'FAIL'} in {time.perf_counter() - t0:.0f}s")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
