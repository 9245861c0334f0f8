"""`moc bench persist`: how long the persist process takes to put a checkpoint in an S3
server, against local disk, for PEC K = 1 and K = N, side by side in one run.

Each of the four runs is a real `moc train` (torchrun, two-level checkpoints,
`--persist-policy wait` so that no persist is skipped) of the same model and data; the
figure is the persist process's own time per checkpoint (`persist_s`: read the snapshot
from shared memory, write every file, confirm, commit the manifest), the median over the
checkpoints between the first (a PEC chain's first checkpoint saves every expert) and
the last (the run's final checkpoint is complete). The S3 server is the one at
`--s3-endpoint` (credentials from the environment), or else a moto server this program
starts on 127.0.0.1 (in-memory, so it measures the protocol and the client, not a
network or a disk behind it).
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from moc.bench.plots import publish
from moc.cliparse import OneLineParser
from moc.train.config import PRESETS
from moc.train.metrics import read_events

MOTO_START_S = 60.0
"""How long to wait for the moto server this benchmark starts to answer."""


def start_moto() -> tuple[subprocess.Popen, str]:
    """A moto S3 server on a free port of 127.0.0.1: (process, endpoint)."""
    import socket
    import time
    import urllib.request

    try:
        import moto.server  # noqa: F401
    except ImportError:
        raise ValueError("without --s3-endpoint this benchmark starts a moto S3 server: "
                         "pip install 'moto[server]' (or pass --s3-endpoint URL)") from None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + MOTO_START_S
    while True:
        try:
            urllib.request.urlopen(endpoint + "/moto-api/", timeout=1).close()
            return proc, endpoint
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"the moto server did not start on {endpoint}") from None
            time.sleep(0.2)


def _train(ckpt_dir: str, metrics: Path, k: str, args: argparse.Namespace,
           env: dict[str, str]) -> list[dict[str, Any]]:
    cmd = [sys.executable, "-m", "moc", "train", "--nproc", str(args.nproc), "--config",
           args.config, "--steps", str(args.steps), "--ckpt-interval", str(args.interval),
           "--ckpt-mode", "moc", "--k-persist", k, "--persist-policy", "wait",
           "--keep-last", "2", "--ckpt-dir", ckpt_dir, "--metrics", str(metrics)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    return [e for e in read_events(metrics) if e["event"] == "checkpoint"]


def _middle(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The checkpoints between the chain's first and the run's final one, persisted."""
    done = [e for e in events if e.get("persist_s") is not None and not e.get("error")]
    return done[1:-1] if len(done) > 2 else done


def run(args: argparse.Namespace, workdir: Path, endpoint: str, bucket: str) -> dict[str, Any]:
    env = {**os.environ, "AWS_ENDPOINT_URL": endpoint}
    env.setdefault("AWS_ACCESS_KEY_ID", "testing")
    env.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    env.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    n = PRESETS[args.config]["model"].n_experts
    rows: dict[str, Any] = {}
    for k in ("1", "all"):
        row: dict[str, Any] = {"k": 1 if k == "1" else n}
        for store in ("local", "s3"):
            where = (str(workdir / f"ckpt-k{k}") if store == "local"
                     else f"s3://{bucket}/bench-{secrets.token_hex(4)}-k{k}")
            events = _middle(_train(where, workdir / f"{store}-k{k}.jsonl", k, args, env))
            row[store] = {"dir": where, "checkpoints": len(events),
                          "persist_median_s": statistics.median(e["persist_s"] for e in events),
                          "persist_s": [e["persist_s"] for e in events],
                          "bytes": int(statistics.median(e["bytes"] for e in events))}
        row["ratio_s3_vs_local"] = (row["s3"]["persist_median_s"]
                                    / row["local"]["persist_median_s"])
        rows[f"K={row['k']}"] = row
    return {"config": {"preset": args.config, "nproc": args.nproc, "steps": args.steps,
                       "interval": args.interval, "n_experts": n, "s3_endpoint": endpoint},
            "results": rows}


def markdown(result: dict[str, Any]) -> str:
    lines = ["| K | bytes/ckpt | local disk persist | S3 persist | S3 / local |",
             "| ---: | ---: | ---: | ---: | ---: |"]
    for r in result["results"].values():
        lines.append(f"| {r['k']} | {r['local']['bytes'] / 1e6:.1f} MB "
                     f"| {r['local']['persist_median_s']:.2f} s "
                     f"| {r['s3']['persist_median_s']:.2f} s "
                     f"| {r['ratio_s3_vs_local']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="moc bench persist", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="bench", choices=sorted(PRESETS),
                   help="model preset (default bench)")
    p.add_argument("--nproc", type=int, default=2,
                   help="ranks of each moc train run (default 2)")
    p.add_argument("--steps", type=int, default=8, help="steps per run (default 8)")
    p.add_argument("--interval", type=int, default=2,
                   help="steps between checkpoints (default 2)")
    p.add_argument("--s3-endpoint", help="an S3 server to measure (credentials from the "
                                         "environment); default: start a local moto server")
    p.add_argument("--bucket", help="bucket to write in (default: a new one)")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--workdir", type=Path, help="where local checkpoints are written "
                                                "(default: a temporary directory)")
    args = p.parse_args(argv)
    if args.steps < 3 * args.interval:
        raise ValueError("--steps must allow at least 3 checkpoints (--steps >= 3 x "
                         "--interval): the first and the final one are not measured")
    proc, endpoint = (None, args.s3_endpoint) if args.s3_endpoint else start_moto()
    try:
        bucket = args.bucket or f"moc-bench-{secrets.token_hex(4)}"
        if not args.bucket:
            os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
            os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
            import s3fs

            s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True).mkdir(bucket)
        with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
            result = run(args, Path(tmp), endpoint, bucket)
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
    cfg = result["config"]
    publish("moc bench persist",
            [("model", f"{cfg['preset']}, N = {cfg['n_experts']} experts per layer"),
             ("ranks", str(cfg["nproc"])),
             ("runs", f"{cfg['steps']} steps, a checkpoint every {cfg['interval']}, "
                      "--persist-policy wait"),
             ("S3 server", cfg["s3_endpoint"] + ("" if args.s3_endpoint else " (moto)"))],
            markdown(result), result, args.json, None, lambda path: None)
    return 0
