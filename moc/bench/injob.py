"""`moc bench injob`: in-job recovery of a loop of one's own (`moc run`,
examples/own_loop.py) against `moc train`'s, the downtime of each fault side by side,
measured in one run of this program on the same machine (issue 49: within 1.5x).

Both jobs run on 2 simulated nodes (`--nodes 2`) of one rank each, each rank with a
spare process (`--spares 1`), a checkpoint every 5 steps, the same `--hang-timeout`:

- `moc train` (the tiny preset) with rank 1 SIGKILLed at steps F, 2F and 3F
  (`--fault-every F`), and a second `moc train` with rank 1 SIGSTOPped at step F;
- `moc run examples/own_loop.py` (its own MoE, DDP) with rank 1 SIGKILLed at F, 2F, 3F
  and then SIGSTOPped at 4F, one fault per generation (`--fault`).

A downtime is the time from the last step done before the fault to the first step done
after it, a step done again included: `moc train`'s recovery events (`downtime_s`), and
the timestamps of own_loop's losses.jsonl. `--repeat N` runs every job N times, in
turn, and takes the median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from moc.bench.plots import publish
from moc.cliparse import OneLineParser
from moc.train.metrics import read_events

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "own_loop.py"
NODES = ["--nodes", "2", "--nproc", "1", "--spares", "1"]
INTERVAL = 5


def _run(cmd: list[str], cwd: Path) -> None:
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=900)
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stderr[-3000:]}")


def train_downtimes(work: Path, every: int, hang_timeout: float, hang: bool) -> list[float]:
    """`moc train`'s downtimes: three kills of rank 1 at every `every` steps, or
    (`hang`) one SIGSTOP of it at step `every`."""
    metrics = work / "metrics.jsonl"
    faults = (["--fault-kind", "hang", "--fault-at", str(every), "--steps", str(every + 5)]
              if hang else ["--fault-every", str(every), "--steps", str(3 * every + 5)])
    _run([sys.executable, "-m", "moc", "train", *NODES, "--recovery", "in-job",
          "--config", "tiny", "--ckpt-mode", "moc", "--ckpt-interval", str(INTERVAL),
          "--ckpt-dir", str(work / "ckpt"), "--metrics", str(metrics), "--no-progress",
          "--hang-timeout", str(hang_timeout), "--fault-rank", "1", *faults], work)
    return [e["downtime_s"] for e in read_events(metrics)
            if e["event"] == "recovery" and e.get("downtime_s") is not None]


def run_downtimes(work: Path, every: int, hang_timeout: float) -> list[float]:
    """`moc run` of own_loop: rank 1 killed at `every`, 2x, 3x, then stopped at 4x;
    the four downtimes, in order."""
    out = work / "own"
    faults = [f"{kind}:1:{n * every}" for n, kind in
              ((1, "kill"), (2, "kill"), (3, "kill"), (4, "stop"))]
    _run([sys.executable, "-m", "moc", "run", *NODES, "--hang-timeout", str(hang_timeout),
          str(EXAMPLE), "--out", str(out), "--steps", str(4 * every + 5),
          *(a for f in faults for a in ("--fault", f))], work)
    logged = [json.loads(x) for x in (out / "losses.jsonl").read_text().splitlines()]
    return [min(e["t"] for e in logged if e["generation"] == g + 1)
            - max(e["t"] for e in logged if e["generation"] == g) for g in range(4)]


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    kills: dict[str, list[float]] = {"moc train": [], "moc run": []}
    stops: dict[str, list[float]] = {"moc train": [], "moc run": []}
    for i in range(args.repeat):
        for name in ("moc train", "moc run"):
            where = work / f"{i}-{name.split()[1]}"
            where.mkdir()
            if name == "moc train":
                kills[name] += train_downtimes(where, args.every, args.hang_timeout, False)
                (where / "hang").mkdir()
                stops[name] += train_downtimes(where / "hang", args.every,
                                               args.hang_timeout, True)
            else:
                *killed, stopped = run_downtimes(where, args.every, args.hang_timeout)
                kills[name] += killed
                stops[name].append(stopped)
    rows = {}
    for fault, times in (("SIGKILL", kills), ("SIGSTOP", stops)):
        train, own = (statistics.median(times[n]) for n in ("moc train", "moc run"))
        rows[fault] = {"moc_train_s": train, "moc_run_s": own, "ratio": own / train,
                       "moc_train_all_s": times["moc train"], "moc_run_all_s": times["moc run"]}
    return {"config": {"every": args.every, "repeat": args.repeat,
                       "hang_timeout_s": args.hang_timeout}, "faults": rows}


def markdown(r: dict[str, Any]) -> str:
    lines = ["| fault | faults each | moc train (median) | moc run, own loop (median) | "
             "moc run / moc train |", "| --- | ---: | ---: | ---: | ---: |"]
    for fault, row in r["faults"].items():
        lines.append(f"| {fault} | {len(row['moc_run_all_s'])} | {row['moc_train_s']:.3f} s "
                     f"| {row['moc_run_s']:.3f} s | {row['ratio']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="moc bench injob", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--every", type=int, default=10,
                   help="steps between faults, F (default 10; at least 6: the fault "
                        "after a checkpoint)")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs of each job, in turn (default 1)")
    p.add_argument("--hang-timeout", type=float, default=5.0,
                   help="seconds without a step before a rank is taken for hung, in both "
                        "(default 5)")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    if not EXAMPLE.is_file():
        p.error(f"{EXAMPLE}: not found; this benchmark runs the repository's example "
                "(run it from a checkout of moc)")
    if args.every < INTERVAL + 1 or args.repeat < 1 or args.hang_timeout <= 0:
        p.error(f"--every must be >= {INTERVAL + 1}, --repeat >= 1, --hang-timeout > 0")
    with tempfile.TemporaryDirectory() as tmp:
        result = run(args, Path(tmp))
    publish("moc bench injob",
            [("jobs", "2 simulated nodes x 1 rank, a spare process each, a checkpoint "
                      f"every {INTERVAL} steps"),
             ("faults", f"rank 1 SIGKILLed every {args.every} steps (3 times), then "
                        f"SIGSTOPped (--hang-timeout {args.hang_timeout:g}); "
                        f"{args.repeat} run(s) each")],
            markdown(result), result, args.json, None, lambda path: None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
