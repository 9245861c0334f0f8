"""`moc bench accuracy`: what partial checkpoints cost the model, under recurring faults.

Every run trains the same model (`small` by default) on the same data with the same seed
for the same number of steps, a checkpoint every `interval` steps and a SIGKILL of rank 1
every `fault_every` steps (torchrun restarts the job, which resumes from its newest
checkpoint). Runs:

    no-fault            no checkpoints, no faults: the reference losses
    full                every expert in every checkpoint (the blocking baseline);
                        process faults: recovery is exact
    moc-process         moc (K_persist = 1, complete snapshot in memory); process faults:
                        recovery from memory, exact
    pec-k1              moc, K_persist = 1, sequential selection; node faults: the
                        snapshots are lost, recovery from storage loses expert updates
    pec-k2              the same with K_persist = 2
    pec-k1-load-aware   K_persist = 1, the most loaded experts first
    pec-k1-dynamic-k    K_persist = 1 with Dynamic-K (K doubles when PLT passes 3.75%)

Per run: final train loss (mean of the last `LAST_STEPS` steps, the final attempt's
values), validation loss (a fixed held-out set), cumulative PLT, expert tokens lost,
faults, wall time over all attempts. Also a PNG of the loss curves with the fault steps
marked, and `--json FILE` shaped `{"runs": {"<name>": {...}}}`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from moc.bench.plots import publish, train_run
from moc.cliparse import OneLineParser
from moc.progress import progress

RUNS: dict[str, list[str]] = {
    "no-fault": ["--ckpt-mode", "none"],
    "full": ["--ckpt-mode", "blocking", "--fault-kind", "process"],
    "moc-process": ["--ckpt-mode", "moc", "--k-persist", "1", "--fault-kind", "process"],
    "pec-k1": ["--ckpt-mode", "moc", "--k-persist", "1", "--fault-kind", "node"],
    "pec-k2": ["--ckpt-mode", "moc", "--k-persist", "2", "--fault-kind", "node"],
    "pec-k1-load-aware": ["--ckpt-mode", "moc", "--k-persist", "1", "--selection",
                          "load-aware", "--fault-kind", "node"],
    "pec-k1-dynamic-k": ["--ckpt-mode", "moc", "--k-persist", "1", "--dynamic-k",
                         "--fault-kind", "node"],
}

LAST_STEPS = 20
"""Steps averaged for the final train loss: one step's loss is one batch's, too noisy to
compare runs by."""


def final_losses(events: list[dict[str, Any]]) -> dict[int, float]:
    """Loss per step as the run finally computed it: a step replayed after a restart
    counts with its last value."""
    out: dict[int, float] = {}
    for e in events:
        if e["event"] == "step":
            out[e["step"]] = e["loss"]
    return out


def summarize(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The accuracy figures of one run from its metrics events."""
    losses = final_losses(events)
    summary = [e for e in events if e["event"] == "summary"]
    if not summary:
        raise RuntimeError("the run did not finish (no summary event)")
    recoveries = [e for e in events if e["event"] == "recovery"]
    last = [losses[s] for s in sorted(losses)[-LAST_STEPS:]]
    timed = [e["time"] for e in events if "time" in e]
    return {
        "final_train_loss": statistics.mean(last),
        "val_loss": summary[-1]["val_loss"],
        "plt": recoveries[-1]["plt"] if recoveries else 0.0,
        "lost_tokens": sum(e["lost_tokens"] for e in recoveries),
        "faults": sum(1 for e in events if e["event"] == "fault"),
        "recovery_sources": [e["source"] for e in recoveries],
        "k_final": max([e["k"] for e in events if e["event"] == "dynamic_k"], default=None),
        "wall_s": max(timed) - min(timed) if timed else None,
        "fault_steps": [e["step"] for e in events if e["event"] == "fault"],
        "losses": {str(s): v for s, v in sorted(losses.items())},
    }


def run(name: str, common: list[str], steps: int, fault_every: int, workdir: Path,
        nproc: int = 2) -> dict[str, Any]:
    """One run of `name`; its faults kill the last rank (rank 0 itself with one)."""
    faults = [] if name == "no-fault" else [
        "--fault-every", str(fault_every), "--fault-rank", str(nproc - 1),
        "--max-restarts", str(steps // fault_every)]
    return summarize(train_run([*common, *RUNS[name], *faults], workdir))


def markdown(runs: dict[str, dict[str, Any]]) -> str:
    ref = runs.get("no-fault", {}).get("val_loss")
    lines = ["| run | faults | recovered from | final train loss | val loss | vs no-fault "
             "| PLT | lost tokens | final K | wall |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in runs.items():
        rel = f"{100 * (r['val_loss'] / ref - 1):+.2f}%" if ref else "-"
        sources = ", ".join(sorted(set(r["recovery_sources"]))) or "-"
        k = "-" if r["k_final"] is None else str(r["k_final"])
        lines.append(f"| {name} | {r['faults']} | {sources} | {r['final_train_loss']:.4f} "
                     f"| {r['val_loss']:.4f} | {rel} | {100 * r['plt']:.2f}% "
                     f"| {r['lost_tokens']} | {k} | {r['wall_s']:.0f} s |")
    return "\n".join(lines)


def plot(runs: dict[str, dict[str, Any]], path: Path, smooth: int = 10) -> None:
    """Loss curves (a moving average over `smooth` steps) with the fault steps marked,
    and below them each run's difference to the no-fault run, where the curves would
    otherwise lie on top of each other."""
    from moc.bench.plots import pyplot

    def average(values: list[float]) -> list[float]:
        return [statistics.mean(values[max(0, i - smooth + 1):i + 1])
                for i in range(len(values))]

    plt = pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 8), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 2]})
    ref = runs.get("no-fault", {}).get("losses")
    for name, r in runs.items():
        steps = [int(s) for s in r["losses"]]
        (line,) = top.plot(steps, average(list(r["losses"].values())), label=name,
                           linewidth=1.2)
        for s in r["fault_steps"]:
            for ax in (top, bottom):
                ax.axvline(s, color=line.get_color(), linestyle=":", linewidth=0.8,
                           alpha=0.6)
        if ref is not None:
            diff = [r["losses"][k] - ref[k] for k in r["losses"] if k in ref]
            bottom.plot([int(k) for k in r["losses"] if k in ref], average(diff),
                        color=line.get_color(), linewidth=1.2)
    top.set_ylabel(f"train loss ({smooth}-step moving average)")
    top.set_title("moc bench accuracy: loss under recurring faults (dotted: faults)")
    top.legend(fontsize=8)
    bottom.set_ylabel("minus the no-fault run's loss")
    bottom.set_xlabel("step")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="moc bench accuracy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="small", help="model preset (default small)")
    p.add_argument("--nproc", type=int, default=2,
                   help="ranks of each moc train run (default 2)")
    p.add_argument("--steps", type=int, default=300, help="steps per run (default 300)")
    p.add_argument("--interval", type=int, default=5, help="steps between checkpoints")
    p.add_argument("--fault-every", type=int, default=100,
                   help="SIGKILL rank 1 at every multiple of this many steps")
    p.add_argument("--quick", action="store_true",
                   help="120 steps, a fault every 45, three runs: a spot check")
    p.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS),
                   help="which runs (default: all of them)")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--png", type=Path, help="loss curves with the faults marked")
    p.add_argument("--workdir", type=Path, help="checkpoint location (default: a temp dir)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (drawn only on a terminal, never under CI)")
    args = p.parse_args(argv)
    steps, fault_every, names = args.steps, args.fault_every, args.runs
    if args.quick:
        steps, fault_every = 120, 45
        names = [n for n in names if n in ("no-fault", "moc-process", "pec-k1")]
    if not 1 <= fault_every < steps:
        raise ValueError(f"--fault-every must be in 1..{steps - 1}, got {fault_every}")
    common = ["--nproc", str(args.nproc), "--config", args.config, "--steps", str(steps),
              "--ckpt-interval", str(args.interval)]
    t0 = time.perf_counter()
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp, \
            progress(len(names), "bench accuracy", "run", disable=args.no_progress) as bar:
        for name in names:
            workdir = Path(tmp) / name
            workdir.mkdir()
            bar.note(name)
            runs[name] = run(name, common, steps, fault_every, workdir, args.nproc)
            bar.update()
            bar.write(f"{name}: val loss {runs[name]['val_loss']:.4f}, "
                      f"PLT {100 * runs[name]['plt']:.2f}%")
    result = {"config": {"preset": args.config, "nproc": args.nproc, "steps": steps,
                         "interval": args.interval, "fault_every": fault_every,
                         "wall_s": time.perf_counter() - t0},
              "runs": runs}
    publish("moc bench accuracy",
            [("config", f"{args.config}, {args.nproc} ranks, {steps} steps, a checkpoint "
                        f"every {args.interval}, a fault every {fault_every}"),
             ("wall", f"{result['config']['wall_s']:.0f} s")],
            markdown(runs), result, args.json, args.png, lambda path: plot(runs, path))
    return 0
