"""`moc bench outage`: an object store that stops answering, in the middle of a two-level
run, slows the persist down and never a training step.

One real `moc train` (torchrun, two-level checkpoints to an S3 server) runs while this
program SIGSTOPs the server for `--outage-s` seconds, then SIGCONTs it. The outage starts
at the worst moment: once rank 0 has logged step `--outage-at`, right after it logs the
next checkpoint that reached the store, so that the plan of the checkpoint after it is
the first to continue the chain from that commit, during the outage (before issue 29
each rank read the new manifest back from the store there, and training waited). The S3
server is a moto server this program starts on 127.0.0.1 (a process of its own, so
stopping it is stopping the store: every request waits, as an NFS server that went away
or a hung object store makes it wait).

It prints, side by side from the one run: the median step time before the outage, the
slowest step that overlapped the outage and its ratio to that median (issue 29: within
2x; before the fix one step took the whole outage), the checkpoints taken during the
outage (their persists skipped, their snapshots in memory), and whether the run's final
checkpoint reached the store once it answered again.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from moc.bench.persist import start_moto
from moc.bench.plots import publish
from moc.cliparse import OneLineParser
from moc.train.config import PRESETS
from moc.train.metrics import read_events

POLL_S = 0.05
"""How often the metrics file is read to find the step the outage starts at."""


def _just_committed(events: list[dict[str, Any]], after: int) -> bool:
    """Whether rank 0 has logged step `after` and, since, a checkpoint that reached the
    store (its event comes once its persist has finished)."""
    seen = [i for i, e in enumerate(events) if e["event"] == "step" and e["step"] >= after]
    return bool(seen) and any(e["event"] == "checkpoint" and e.get("persist_s") is not None
                              for e in events[seen[0]:])


def _overlaps(event: dict[str, Any], start: float, end: float) -> bool:
    """Whether a step event's step ran (in part) while the store was stopped."""
    return event["time"] > start and event["time"] - event["step_time_s"] < end


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    proc, endpoint = start_moto()
    try:
        env = {**os.environ, "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
               "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
        bucket = f"moc-bench-{secrets.token_hex(4)}"
        import s3fs

        s3fs.S3FileSystem(endpoint_url=endpoint, key="testing", secret="testing",
                          skip_instance_cache=True).mkdir(bucket)
        url = f"s3://{bucket}/run"
        metrics = workdir / "metrics.jsonl"
        cmd = [sys.executable, "-m", "moc", "train", "--nproc", str(args.nproc), "--config",
               args.config, "--steps", str(args.steps), "--ckpt-interval",
               str(args.interval), "--ckpt-mode", "moc", "--k-persist", "1", "--ckpt-dir",
               url, "--metrics", str(metrics), "--no-progress"]
        train = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True)
        stopped = resumed = None
        while train.poll() is None:
            now = time.time()
            if stopped is None and _just_committed(read_events(metrics), args.outage_at):
                os.kill(proc.pid, signal.SIGSTOP)
                stopped = time.time()
            elif stopped is not None and resumed is None and now - stopped >= args.outage_s:
                os.kill(proc.pid, signal.SIGCONT)
                resumed = time.time()
            time.sleep(POLL_S)
        if stopped is not None and resumed is None:
            os.kill(proc.pid, signal.SIGCONT)
            resumed = time.time()
        _, stderr = train.communicate()
        if train.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{stderr[-3000:]}")
        if stopped is None or resumed is None:
            raise RuntimeError(f"the run ended before step {args.outage_at}: nothing measured")
        from moc.checkpoint.store.steps import complete_steps

        os.environ.update({k: env[k] for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID",
                                                "AWS_SECRET_ACCESS_KEY")})
        durable = complete_steps(url)
    finally:
        proc.kill()
        proc.wait()
    events = read_events(metrics)
    steps = [e for e in events if e["event"] == "step"]
    before = [e["step_time_s"] for e in steps if e["time"] <= stopped]
    during = [e for e in steps if _overlaps(e, stopped, resumed)]
    trained = {e["step"] for e in during}
    in_outage = [e for e in events if e["event"] in ("checkpoint", "checkpoint_failed")
                 and e["step"] in trained]
    median = statistics.median(before)
    worst = max((e["step_time_s"] for e in during), default=0.0)
    return {"config": {"preset": args.config, "nproc": args.nproc, "steps": args.steps,
                       "interval": args.interval, "outage_at": args.outage_at,
                       "outage_s": round(resumed - stopped, 3)},
            "median_step_s": median, "max_step_before_s": max(before),
            "steps_during_outage": len(during),
            "max_step_during_outage_s": worst, "ratio": worst / median,
            "checkpoints_during_outage": len(in_outage),
            "persists_skipped_during_outage": sum(bool(e.get("persist_skipped"))
                                                  for e in in_outage),
            "final_step": steps[-1]["step"] if steps else None,
            "newest_durable_step": durable[-1] if durable else None}


def markdown(r: dict[str, Any]) -> str:
    return "\n".join([
        "| median step before | slowest before | steps during the outage | slowest of "
        "them | slowest / median | final step durable |",
        "| ---: | ---: | ---: | ---: | ---: | :---: |",
        f"| {r['median_step_s']:.3f} s | {r['max_step_before_s']:.3f} s "
        f"| {r['steps_during_outage']} "
        f"| {r['max_step_during_outage_s']:.3f} s | {r['ratio']:.2f}x "
        f"| {'yes' if r['newest_durable_step'] == r['final_step'] else 'NO'} |"])


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="moc bench outage", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tiny", choices=sorted(PRESETS),
                   help="model preset (default tiny)")
    p.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--steps", type=int, default=2000,
                   help="steps of the run: it must outlast the outage (default 2000)")
    p.add_argument("--interval", type=int, default=10,
                   help="steps between checkpoints (default 10)")
    p.add_argument("--outage-at", type=int, default=100,
                   help="stop the store at the first commit rank 0 logs after this step "
                        "(default 100)")
    p.add_argument("--outage-s", type=float, default=60.0,
                   help="how long the store stays stopped, in seconds (default 60)")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    if args.outage_at >= args.steps:
        raise ValueError("--outage-at must be below --steps")
    with tempfile.TemporaryDirectory() as tmp:
        result = run(args, Path(tmp))
    cfg = result["config"]
    publish("moc bench outage",
            [("model", f"{cfg['preset']}, {cfg['nproc']} ranks, a checkpoint every "
                       f"{cfg['interval']} steps to S3 (moto), K_persist 1"),
             ("outage", f"S3 server SIGSTOPped for {cfg['outage_s']} s, right after "
                        f"the first commit past step {cfg['outage_at']}"),
             ("checkpoints during it", f"{result['checkpoints_during_outage']} "
                                       f"({result['persists_skipped_during_outage']} "
                                       "persists skipped)")],
            markdown(result), result, args.json, None, lambda path: None)
    return 0
