"""`moc simulate`: effective training time (ETTR) and the best checkpoint interval of each
strategy, from the costs `moc bench overhead --json FILE` measured.

The model (first order, the one behind Young/Daly's interval; docs/SIMULATE.md):

    T  step time without checkpoints          (the `none` strategy's mean step time)
    C  extra training time one checkpoint costs
         = (strategy's mean step time - none's) x the bench's interval, never below the
           strategy's median stall (captures the stall and the CPU a background copy steals)
    R  cost of one restart = a fixed restart time (notice the fault, restart processes)
                           + the restore time (from memory for a process fault when the
                             strategy keeps snapshots in memory, from storage otherwise)
       or a run's measured downtime, which holds both (`Downtime`: --downtime-s,
       --downtime-from, or the bench's own when --restart-s is not given)
    λ  failure rate = nodes / MTBF per node (faults arrive as a Poisson process)

    With a checkpoint every I steps, one interval takes W = I T + C. Each failure costs R
    plus, on average, half an interval of lost work W / 2 (the same for every strategy:
    a strategy that recovers exactly from memory still loses the steps since its newest
    snapshot). Hence

        ETTR(I) = (I T / W) * max(0, 1 - λ (R + W / 2))

    ETTR is concave in W, maximal at W* = sqrt(2 C (1 - λ R) / λ); the best integer
    interval is the better of floor and ceil of (W* - C) / T. Young/Daly's interval
    sqrt(2 C / λ) / T is printed beside it for reference (the two agree when λ R and
    C / W are small).

`--peers` prints another table: node faults on 2,048 and 16,384 GPUs (`--gpus`) with the
state sized from a model (default DeepSeek-V3's), for blocking, dcp-async, moc and moc
with peer replicas (each node's snapshot in the host memory of node (i + jump) mod n);
docs/SIMULATE.md "Peer tier" has its formulas, docs/SCALING.md its figures.

`--recovery-modes` prints a third: ETTR per recovery mode (an assumed 60 s cluster
restart, then each measured downtime: torchrun restart, in-job, in-job with a spare) at a
job MTBF of 10 minutes, a 2 s step and DeepSeekMoE-16B-sized state restored from a peer,
beside MoEvement's published 0.94; docs/SIMULATE.md "Recovery modes".

`--validate` checks how the measured components combine on real `moc train` runs with
deterministic faults (a SIGKILL every F steps); see `validate` below.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from moc.cliparse import OneLineParser

DEFAULT_OVERHEAD = Path(__file__).resolve().parents[2] / "docs" / "bench-overhead.json"
"""The overhead benchmark measured for docs/ (found from any working directory)."""

DEFAULT_NODES = 2048
"""Llama 3 405B's pre-training cluster: 16,384 H100s, 8 per server ("The Llama 3 Herd of
Models", Meta 2024)."""

DEFAULT_MTBF_HOURS = 6335.0
"""MTBF per node of that cluster: 419 unexpected interruptions in a 54-day snapshot on
2,048 nodes, 54 x 24 h x 2048 / 419 = 6335 h (one job failure every ~3.1 h)."""

DEFAULT_RESTART_S = 5.0
"""Time to notice a fault and restart the job, restore excluded: about what a torchrun
restart of 2 CPU ranks of the tiny model took on the 2-core VM (`moc simulate
--validate` measured 3.0-3.8 s for blocking and 4.5-5.1 s for moc in its quieter runs,
up to 8.6 s under load; docs/SIMULATE.md). A GPU cluster's restart (rescheduling, NCCL
setup, loading the job) takes minutes: pass --restart-s for it."""

VALIDATE_STEPS = 100
VALIDATE_INTERVAL = 10
VALIDATE_FAULT_EVERY = 35
"""Faults at steps 35 and 70 of 100: one loses 4 steps since the checkpoint at 30, one
loses 9 since the checkpoint at 60 (a fault at step s kills before step s runs)."""
VALIDATE_TIMEOUT_S = 600
"""Per training run: a hung restart must not hold the command forever."""


@dataclass(frozen=True)
class Costs:
    """What one strategy costs, in seconds: the inputs of the model."""

    name: str
    step_s: float
    """T: a training step without checkpoints."""
    ckpt_s: float
    """C: the extra training time one checkpoint costs."""
    restart_s: float
    """The fixed part of R: noticing the fault and restarting processes; with a measured
    downtime (`Downtime`), the whole of it, restore included."""
    restore_s: float
    """The restore part of R (0 when `restart_s` is a measured downtime, which holds it)."""
    restore_from: str
    """"memory" or "storage": where the restore reads; "measured downtime" (or "<source>,
    measured downtime") when R is a run's measured downtime."""

    def __post_init__(self) -> None:
        if not self.step_s > 0:
            raise ValueError(f"{self.name}: step time T must be > 0 s, got {self.step_s}")
        for field_name in ("ckpt_s", "restart_s", "restore_s"):
            value = getattr(self, field_name)
            if not value >= 0:
                raise ValueError(f"{self.name}: {field_name} must be >= 0 s, got {value}")

    @property
    def recovery_s(self) -> float:
        """R: everything a failure costs apart from the lost work."""
        return self.restart_s + self.restore_s


def failure_rate(nodes: int, mtbf_hours: float) -> float:
    """λ in failures per second: any node's failure stops the synchronous job."""
    if nodes < 1:
        raise ValueError(f"--nodes must be >= 1, got {nodes}")
    if not mtbf_hours > 0:
        raise ValueError(f"--mtbf-hours must be > 0, got {mtbf_hours}")
    return nodes / (mtbf_hours * 3600.0)


def ettr(interval: int, costs: Costs, rate: float) -> float:
    """Expected fraction of wall time spent on useful steps, a checkpoint every
    `interval` steps and failures at `rate` per second (module docstring)."""
    if interval < 1:
        raise ValueError(f"interval must be >= 1 step, got {interval}")
    work = interval * costs.step_s
    w = work + costs.ckpt_s
    return (work / w) * max(0.0, 1.0 - rate * (costs.recovery_s + w / 2))


def best_interval(costs: Costs, rate: float) -> int | None:
    """The integer interval with the highest ETTR; None when no interval makes progress
    (a failure comes, on average, before a restart is over).

    ETTR is concave in W = I T + C, so over the integers its maximum lies at the floor or
    the ceiling of the continuous optimum I* = (W* - C) / T, W* = sqrt(2 C (1 - λ R) / λ);
    no search over a range that can span millions of steps is needed."""
    if rate <= 0:
        raise ValueError(f"the failure rate must be > 0, got {rate}")
    a = 1.0 - rate * costs.recovery_s
    if a <= 0:
        return None
    w_star = math.sqrt(2.0 * costs.ckpt_s * a / rate)
    i_star = (w_star - costs.ckpt_s) / costs.step_s
    candidates = {max(1, math.floor(i_star)), max(1, math.ceil(i_star))}
    best = max(sorted(candidates), key=lambda i: ettr(i, costs, rate))
    return best if ettr(best, costs, rate) > 0 else None


def young_daly_interval(costs: Costs, rate: float) -> float:
    """Young/Daly's first-order optimum sqrt(2 C / λ), in steps of T (for reference)."""
    return math.sqrt(2.0 * costs.ckpt_s / rate) / costs.step_s


# ---------------------------------------------------------------------------------------
# Inputs: the JSON of `moc bench overhead`


def load_overhead(path: Path) -> dict[str, Any]:
    """The bench result at `path`, with the fields the model needs checked."""
    if not path.is_file():
        raise ValueError(f"--overhead {path}: no such file; write one with "
                         f"`moc bench overhead --json {path}`")
    try:
        result = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"--overhead {path}: not JSON ({e})") from None
    if not isinstance(result, dict) or not isinstance(result.get("strategies"), dict):
        raise ValueError(f"--overhead {path}: expected the JSON `moc bench overhead --json` "
                         "writes, with a \"strategies\" object")
    interval = result.get("config", {}).get("interval")
    if not isinstance(interval, int) or interval < 1:
        raise ValueError(f"--overhead {path}: config.interval must be a positive integer, "
                         f"got {interval!r}")
    if "none" not in result["strategies"]:
        raise ValueError(f"--overhead {path}: no \"none\" strategy, the step time without "
                         "checkpoints; rerun `moc bench overhead` with it")
    return result


def _figure(result: dict[str, Any], path: Path, name: str, key: str) -> float:
    value = result["strategies"][name].get(key)
    if value is None:
        raise ValueError(f"--overhead {path}: strategy {name!r} has no {key!r} (missing or "
                         f"null); rerun `moc bench overhead --strategies none {name}` or "
                         "leave the strategy out with --strategies")
    return float(value)


def costs_from_overhead(result: dict[str, Any], path: Path, names: list[str], *,
                        restart_s: float, fault_kind: str, step_time: float | None = None,
                        scale_costs: bool = False, downtime: Downtime | None = None,
                        measured_downtime: bool = False) -> tuple[list[Costs], str]:
    """The model's inputs for each strategy in `names`, and the basis of the step times
    ("steady" or "all steps").

    The steady-state means (after the first checkpoints' one-time costs) are used when
    both `none` and every strategy have them, so that T and C compare like with like.
    `step_time` replaces T (e.g. a GPU cluster's step); C and the restore times stay as
    measured unless `scale_costs`, which multiplies them by the ratio of step times (a
    crude assumption: checkpoint work scales like compute). The restart time never
    scales.

    R is `restart_s` + the restore, unless a downtime was measured: `downtime` (given on
    the command line) is every strategy's R; with `measured_downtime`, a strategy whose
    result holds the downtime of a recovery from the source the restore reads
    (`downtime_memory_s`, `downtime_storage_s`: `moc bench overhead` records them) gets
    that as R. A measured downtime never scales: it is wall time, restore included."""
    strategies = result["strategies"]
    for name in names:
        if name not in strategies:
            raise ValueError(f"--overhead {path}: no strategy {name!r}; it has "
                             f"{', '.join(strategies)}")
    steady = all(strategies[n].get("mean_step_time_steady_s") is not None
                 for n in ["none", *names])
    key = "mean_step_time_steady_s" if steady else "mean_step_time_s"
    t_ref = _figure(result, path, "none", key)
    interval = result["config"]["interval"]
    scale = 1.0
    if step_time is not None:
        if not step_time > 0:
            raise ValueError(f"--step-time must be > 0 s, got {step_time}")
        scale = step_time / t_ref if scale_costs else 1.0
    t = step_time if step_time is not None else t_ref
    out = []
    for name in names:
        mean = _figure(result, path, name, key)
        stall = strategies[name].get("stall_median_s") or 0.0
        ckpt = max(stall, (mean - t_ref) * interval, 0.0) * scale
        if downtime is not None:
            out.append(Costs(name, t, ckpt, downtime.seconds, 0.0, "measured downtime"))
            continue
        memory = strategies[name].get("restore_memory_s")
        if fault_kind == "process" and memory is not None:
            restore, source = float(memory), "memory"
        else:
            restore, source = _figure(result, path, name, "restore_storage_s"), "storage"
        measured = strategies[name].get(f"downtime_{source}_s")
        if measured_downtime and measured is not None:
            out.append(Costs(name, t, ckpt, float(measured), 0.0,
                             f"{source}, measured downtime"))
        else:
            out.append(Costs(name, t, ckpt, restart_s, restore * scale, source))
    return out, "steady" if steady else "all steps"


# ---------------------------------------------------------------------------------------
# Inputs: the per-fault downtime a run measured (`recovery` events' `downtime_s`)


@dataclass(frozen=True)
class Downtime:
    """What one fault costs apart from the lost work: noticing it, the restart (or the
    in-job re-formation) and the restore, as `moc train` logs it in each `recovery`
    event's `downtime_s` (from the last step done before the fault to the first step
    after it), or an assumed figure. It takes the place of restart + restore in R."""

    label: str
    """The recovery mode it stands for, e.g. "restart", "in-job", "in-job-spare"."""
    seconds: float
    source: str
    """Where the figure comes from: "assumed", "given" (a number on the command line) or
    a metrics file's path."""
    events: int = 0
    """How many recovery events it is the median of (0: not read from a file)."""
    kinds: tuple[str, ...] = ()
    """Those events' `kind`s ("restart", "in-job")."""

    def __post_init__(self) -> None:
        if not (self.seconds >= 0 and math.isfinite(self.seconds)):
            raise ValueError(f"downtime {self.label!r} must be a finite number of seconds "
                             f">= 0, got {self.seconds}")

    def describe(self) -> str:
        """Where the figure comes from, in words."""
        if not self.events:
            return self.source
        kinds = ", ".join(self.kinds) or "kind not logged"
        return f"median of {self.events} recovery events ({kinds}) in {self.source}"


def downtime_of_events(events: list[dict[str, Any]], label: str, source: str,
                       where: str = "") -> Downtime:
    """The median `downtime_s` of the `recovery` events among `events` (read from
    `source`); events without one (written before moc logged it, or with no step before
    the fault) are left out. `where` begins an error's message (default: `source`)."""
    recoveries = [e for e in events
                  if e.get("event") == "recovery" and e.get("downtime_s") is not None]
    if not recoveries:
        raise ValueError(f"{where or source}: no recovery event with a downtime_s; expected the "
                         "--metrics file of a `moc train` run with faults (--fault-every "
                         "or --fault-at) by a moc that logs the downtime")
    kinds = tuple(sorted({str(e["kind"]) for e in recoveries if e.get("kind")}))
    return Downtime(label, statistics.median(float(e["downtime_s"]) for e in recoveries),
                    source, len(recoveries), kinds)


def downtime_from_metrics(path: Path, label: str, where: str) -> Downtime:
    """`downtime_of_events` over the metrics JSONL file at `path` (a torn last line, from
    a rank killed mid-write, is ignored); `where` (the option and the path) begins an
    error's message."""
    from moc.train.metrics import read_events  # torch-free, like this module

    if not path.is_file():
        raise ValueError(f"{where}: no such file; expected the --metrics file of a `moc "
                         "train` run with faults")
    return downtime_of_events(read_events(path), label, str(path), where)


def parse_downtime(text: str) -> Downtime:
    """`--downtimes` entry LABEL=SECONDS or LABEL=METRICS.jsonl (the median of that run's
    recovery events)."""
    label, sep, value = text.partition("=")
    if not sep or not label or not value:
        raise ValueError(f"--downtimes: expected LABEL=SECONDS or LABEL=METRICS.jsonl "
                         f"(e.g. in-job=2.9), got {text!r}")
    try:
        seconds = float(value)
    except ValueError:
        return downtime_from_metrics(Path(value), label, f"--downtimes {text}")
    if not (seconds >= 0 and math.isfinite(seconds)):
        raise ValueError(f"--downtimes {text}: the downtime must be >= 0 s")
    return Downtime(label, seconds, "given")


def measured_downtime(seconds: float | None, metrics: Path | None) -> Downtime | None:
    """The downtime of `--downtime-s` or `--downtime-from` (None: neither given)."""
    if seconds is not None and metrics is not None:
        raise ValueError("--downtime-s and --downtime-from both give the per-fault "
                         "downtime; pass one of them")
    if seconds is not None:
        if not (seconds >= 0 and math.isfinite(seconds)):
            raise ValueError(f"--downtime-s must be >= 0, got {seconds}")
        return Downtime("measured", seconds, "--downtime-s")
    if metrics is not None:
        return downtime_from_metrics(metrics, "measured", f"--downtime-from {metrics}")
    return None


# ---------------------------------------------------------------------------------------
# Outputs


def simulate(costs: list[Costs], rate: float, interval: int) -> dict[str, dict[str, Any]]:
    """Per strategy: its inputs, the best interval, ETTR there and at `interval`."""
    out = {}
    for c in costs:
        best = best_interval(c, rate)
        out[c.name] = {**asdict(c), "recovery_s": c.recovery_s, "best_interval": best,
                       "ettr_best": ettr(best, c, rate) if best is not None else 0.0,
                       "young_daly_interval": young_daly_interval(c, rate),
                       "interval": interval, "ettr_at_interval": ettr(interval, c, rate)}
    return out


def markdown(rows: dict[str, dict[str, Any]]) -> str:
    interval = next(iter(rows.values()))["interval"] if rows else "-"
    lines = ["| strategy | T | C | R | best I | Young/Daly I | ETTR at best I "
             f"| ETTR at I = {interval} |",
             "| --- | " + " | ".join(["---:"] * 7) + " |"]
    for name, r in rows.items():
        best = "-" if r["best_interval"] is None else str(r["best_interval"])
        lines.append(
            f"| {name} | {r['step_s']:.4f} s | {r['ckpt_s']:.4f} s "
            f"| {r['recovery_s']:.2f} s ({r['restore_from']}) | {best} "
            f"| {r['young_daly_interval']:.0f} | {r['ettr_best']:.4f} "
            f"| {r['ettr_at_interval']:.4f} |")
    return "\n".join(lines)


def write_png(path: Path, costs: list[Costs], rows: dict[str, dict[str, Any]], rate: float,
              title: str) -> None:
    """ETTR against the interval (log x), one line per strategy, the best interval marked."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--png needs matplotlib: pip install 'matplotlib>=3.7' (moc's plots "
                         "extra)") from None
    matplotlib.use("Agg")  # files only: no display on a training node
    import matplotlib.pyplot as plt

    bests = [r["best_interval"] for r in rows.values() if r["best_interval"]]
    top = max([10, *(10 * b for b in bests), 10 * next(iter(rows.values()))["interval"]])
    xs = sorted({max(1, round(10 ** (k * math.log10(top) / 300))) for k in range(301)})
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for c in costs:
        best = rows[c.name]["best_interval"]
        # The best interval goes in the legend: marks of close strategies overlap.
        label = c.name if best is None else (f"{c.name}: best I = {best}, "
                                             f"ETTR {ettr(best, c, rate):.4f}")
        line, = ax.plot(xs, [ettr(i, c, rate) for i in xs], label=label)
        if best is not None:
            ax.plot([best], [ettr(best, c, rate)], "o", color=line.get_color())
    interval = next(iter(rows.values()))["interval"]
    ax.axvline(interval, color="grey", linestyle=":", label=f"I = {interval}")
    ax.set_xscale("log")
    ax.set_xlabel("checkpoint interval I (steps)")
    ax.set_ylabel("ETTR")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------
# Validation: real runs with deterministic faults


def lost_steps(fault_step: int, interval: int) -> int:
    """Completed steps a fault at `fault_step` throws away: the fault kills a rank before
    that step runs, so steps up to fault_step - 1 are done and training resumes from the
    newest checkpoint at or before it."""
    done = fault_step - 1
    return done - (done // interval) * interval


def span_s(events: list[dict[str, Any]], steps: int) -> float:
    """Wall time of a run's training: from the start of its first step (the first step
    event's time minus its step time) to the end of step `steps` in the attempt that
    finished. Process start-up before step 1 and the validation after the last step are
    outside, in the measurement and in the prediction alike."""
    step_events = [e for e in events if e["event"] == "step"]
    if not step_events or step_events[-1]["step"] != steps:
        raise RuntimeError(f"the run did not reach step {steps}")
    first = step_events[0]
    return step_events[-1]["time"] - (first["time"] - first["step_time_s"])


def restarts(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per recovery: the last step done before the fault, the step resumed from and R =
    the time from the end of that last step to the start of the first step after the
    recovery (the first step event's time minus its step time). R holds what the model's
    R holds: the rest of the fault step until the survivors notice, process teardown and
    restart, initialisation, and the restore."""
    out = []
    last_step: dict[str, Any] | None = None
    pending: dict[str, Any] | None = None
    for e in events:
        if e["event"] == "recovery":
            if last_step is None:
                raise RuntimeError("a recovery before any step: not a fault mid-run")
            pending = {"last_step": last_step["step"], "resumed_from": e["resumed_from"],
                       "source": e["source"], "restore_s": e["recovery_s"],
                       "t_fault": last_step["time"]}
        elif e["event"] == "step":
            if pending is not None:
                pending["restart_s"] = e["time"] - e["step_time_s"] - pending.pop("t_fault")
                out.append(pending)
                pending = None
            last_step = e
    return out


def predict_faulted_run(steps: int, interval: int, fault_every: int, step_s: float,
                        ckpt_s: float, restarts_s: list[float]) -> dict[str, Any]:
    """The model with the run's deterministic faults instead of the random average:
    steps x T + (checkpoints) x C + sum over faults of (R_i + lost_i x T)."""
    faults = list(range(fault_every, steps + 1, fault_every))
    if len(restarts_s) != len(faults):
        raise RuntimeError(f"expected {len(faults)} recoveries (faults at {faults}), "
                           f"the run logged {len(restarts_s)}")
    lost = [lost_steps(f, interval) for f in faults]
    wall = (steps * step_s + (steps // interval) * ckpt_s
            + sum(restarts_s) + sum(lost) * step_s)
    return {"faults": faults, "lost_steps": lost, "wall_s": wall,
            "ettr": steps * step_s / wall}


def median_step_s(events: list[dict[str, Any]], interval: int) -> float:
    """Median time of the steps that take no checkpoint: how fast this run's machine was
    (a shared machine drifts between runs; the prediction assumes it does not)."""
    return statistics.median(e["step_time_s"] for e in events
                             if e["event"] == "step" and e["step"] % interval)


def _train(workdir: Path, args: list[str]) -> list[dict[str, Any]]:
    from moc.bench.plots import train_run

    return train_run(["--nproc", "2", "--ep", "2", "--config", "tiny", *args], workdir,
                     timeout=VALIDATE_TIMEOUT_S)


def validate(names: list[str], steps: int, interval: int, fault_every: int, fault_kind: str,
             repeat: int = 1, workdir: Path | None = None, no_progress: bool = False
             ) -> dict[str, Any]:
    """Per strategy, three runs back to back (tiny, 2 ranks, ep 2):

        (a) no checkpoints                   -> T = span_a / steps
        (b) a checkpoint every `interval`    -> C = (span_b - steps T) / checkpoints,
                                                never below (b)'s median stall
        (c) as (b), SIGKILL of rank 1 every  -> R_i per fault (`restarts`), and the
            `fault_every` steps                 measured span

    Predicted wall time of (c) = steps T + checkpoints C + sum(R_i + lost_i T)
    (`predict_faulted_run`); measured and predicted ETTR of (c) are steps T over the two
    times. R_i comes from (c) itself, so the check is of how the parts add up (T and C
    from other runs, lost work from the fault steps), not of R. Each strategy gets its
    own (a), right before its (b) and (c): on a shared machine the speed drifts between
    runs, and the closer in time, the less. `repeat` rounds are independent checks. A
    bar counts the runs on a terminal (`no_progress`: none)."""
    from moc.bench.overhead import STRATEGIES
    from moc.progress import progress

    for name in names:
        if name == "none" or name not in STRATEGIES:
            raise ValueError(f"--strategies: cannot validate {name!r}; choose from "
                             f"{', '.join(n for n in STRATEGIES if n != 'none')}")
    if not 1 <= interval <= steps:
        raise ValueError(f"--validate-interval must be in 1..{steps}, got {interval}")
    if not 1 <= fault_every <= steps:
        raise ValueError(f"--validate-fault-every must be in 1..{steps}, got {fault_every}")
    if repeat < 1:
        raise ValueError(f"--validate-repeat must be >= 1, got {repeat}")
    common = ["--steps", str(steps), "--ckpt-interval", str(interval)]
    fault = ["--fault-every", str(fault_every), "--fault-rank", "1",
             "--max-restarts", str(steps // fault_every), "--fault-kind", fault_kind]
    n_ckpt = steps // interval
    rounds: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=workdir) as tmp, \
            progress(3 * repeat * len(names), "simulate --validate", "run",
                     disable=no_progress) as bar:

        def run(label: str, args: list[str]) -> list[dict[str, Any]]:
            d = Path(tmp) / label
            d.mkdir()
            bar.write(f"moc simulate --validate: {label} ({time.perf_counter() - t0:.0f} s)")
            bar.note(label)
            events = _train(d, [*common, *args])
            bar.update()
            return events

        for i in range(repeat):
            results: dict[str, Any] = {}
            for name in names:
                base = run(f"{i}-{name}-a-none", STRATEGIES["none"])
                clean = run(f"{i}-{name}-b-ckpt", STRATEGIES[name])
                faulted = run(f"{i}-{name}-c-faults", [*STRATEGIES[name], *fault])
                step_s = span_s(base, steps) / steps
                stalls = [e["stall_s"] for e in clean if e["event"] == "checkpoint"]
                ckpt_s = max(statistics.median(stalls) if stalls else 0.0,
                             (span_s(clean, steps) - steps * step_s) / n_ckpt)
                rs = restarts(faulted)
                measured = span_s(faulted, steps)
                results[name] = {
                    "step_s": step_s, "ckpt_s": ckpt_s, "restarts": rs,
                    "predicted": predict_faulted_run(steps, interval, fault_every, step_s,
                                                     ckpt_s, [r["restart_s"] for r in rs]),
                    "measured": {"wall_s": measured, "ettr": steps * step_s / measured,
                                 "lost_steps": [r["last_step"] - r["resumed_from"]
                                                for r in rs]},
                    "median_step_s": {"a": median_step_s(base, interval),
                                      "b": median_step_s(clean, interval),
                                      "c": median_step_s(faulted, interval)}}
            rounds.append(results)
    return {"steps": steps, "interval": interval, "fault_every": fault_every,
            "fault_kind": fault_kind, "rounds": rounds, "wall_s": time.perf_counter() - t0}


def validation_markdown(v: dict[str, Any]) -> str:
    lines = [f"tiny, 2 ranks, {v['steps']} steps, a checkpoint every {v['interval']}, "
             f"SIGKILL of rank 1 every {v['fault_every']} steps ({v['fault_kind']} faults)",
             "",
             "| strategy | T | C | R per fault | restore | lost steps (model / run) "
             "| predicted wall | measured wall | predicted ETTR | measured ETTR | error "
             "| median step a / b / c |",
             "| --- | " + " | ".join(["---:"] * 11) + " |"]
    for i, results in enumerate(v["rounds"]):
        for name, s in results.items():
            p, m = s["predicted"], s["measured"]
            label = name if len(v["rounds"]) == 1 else f"{name} (round {i + 1})"
            rs = ", ".join(f"{r['restart_s']:.2f}" for r in s["restarts"])
            restore = ", ".join(f"{r['restore_s']:.3f}" for r in s["restarts"])
            sources = sorted({r["source"] for r in s["restarts"]})
            lines.append(
                f"| {label} | {s['step_s']:.4f} s | {s['ckpt_s']:.4f} s | {rs} s "
                f"| {restore} s ({', '.join(sources)}) "
                f"| {p['lost_steps']} / {m['lost_steps']} | {p['wall_s']:.2f} s "
                f"| {m['wall_s']:.2f} s | {p['ettr']:.4f} | {m['ettr']:.4f} "
                f"| {100 * (p['ettr'] - m['ettr']) / m['ettr']:+.1f}% "
                f"| {' / '.join(f'{t:.4f}' for t in s['median_step_s'].values())} s |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# The peer tier, at scale (docs/SIMULATE.md "Peer tier", docs/SCALING.md)

GPUS_PER_NODE = 8
"""H100/H200 servers hold 8 GPUs (Llama 3's cluster above)."""

SCALE_GPUS = (2048, 16384)
"""The GPU counts of the scale table: a 256-node job and Llama 3 405B's 2,048 nodes."""

DEFAULT_NET_GBPS = 25.0
"""Network bandwidth per node left for replicas, GB/s: one 200 Gb/s NIC carries 25 GB/s,
and an 8-GPU server has several (one per GPU on training fabrics); 25 GB/s is what one NIC
gives, the low end (pass 50 for two 400 Gb/s NICs' worth)."""

DEFAULT_STORAGE_GBPS = 2.0
"""Read bandwidth of shared storage per node, GB/s, for a restore from storage at scale:
a parallel file system delivering ~500 GB/s in aggregate, shared by 256 nodes, gives each
about 2 GB/s (and 16x less each on 16x the nodes if the aggregate stays)."""

DEEPSEEK_V3 = {"params_b": 671.0, "active_params_b": 37.0, "experts": 256, "top_k": 8}
"""DeepSeek-V3's size: 671B parameters, 37B activated, 256 routed experts per MoE layer of
which 8 are activated per token (one shared expert more, counted as non-expert state)."""

DEEPSEEK_MOE_16B = {"params_b": 16.4, "active_params_b": 2.8, "experts": 64, "top_k": 6}
"""DeepSeekMoE 16B's size ("DeepSeekMoE: Towards Ultimate Expert Specialization in
Mixture-of-Experts Language Models", Dai et al. 2024, arXiv:2401.06066, and its released
config: 28 layers, hidden size 2048): 16.4B parameters, 2.8B activated, 64 routed experts
per MoE layer of which 6 are activated per token (2 shared experts more, counted as
non-expert state). The size of the models MoEvement evaluates (up to 64 experts)."""

DEFAULT_BYTES_PER_PARAM = 14
"""Checkpointed bytes per parameter: bf16 weights (2) + fp32 master weights (4) + fp32
Adam m and v (4 + 4). Gradients are not checkpointed."""

N_SLOTS_OWN = 3
"""moc's own snapshot slots per node (moc.checkpoint.twolevel.memory.slots.N_SLOTS, not imported:
the simulator stays free of torch)."""

REPLICA_SLOTS = 2
"""Replica slots per node: one complete (checksums verified) replica is kept while the
next is being received, so a node loss during a transfer still finds a whole one."""


@dataclass(frozen=True)
class ModelSize:
    """How much training state there is, split into routed experts and the rest."""

    params_b: float
    """Total parameters, in billions."""
    active_params_b: float
    """Parameters activated per token, in billions (non-expert + top_k routed experts)."""
    experts: int
    """Routed experts per MoE layer."""
    top_k: int
    """Routed experts activated per token."""
    bytes_per_param: float = DEFAULT_BYTES_PER_PARAM
    """Checkpointed bytes per parameter (weights + optimizer state)."""

    def __post_init__(self) -> None:
        if not 0 < self.active_params_b <= self.params_b:
            raise ValueError(f"--active-params-b must be in (0, --params-b = "
                             f"{self.params_b}], got {self.active_params_b}")
        if not 1 <= self.top_k < self.experts:
            raise ValueError(f"--top-k must be in 1..{self.experts - 1} (--experts "
                             f"{self.experts}), got {self.top_k}")
        if not self.bytes_per_param > 0:
            raise ValueError(f"--bytes-per-param must be > 0, got {self.bytes_per_param}")
        if self.nonexpert_params < 0:
            raise ValueError(f"--params-b {self.params_b}, --active-params-b "
                             f"{self.active_params_b} with top {self.top_k} of "
                             f"{self.experts} experts leave no room for non-expert state")

    @property
    def expert_params(self) -> float:
        """Routed-expert parameters: total - active = (experts - top_k) experts' worth, so
        all routed experts are experts / (experts - top_k) times that."""
        return (self.params_b - self.active_params_b) * 1e9 * self.experts / (
            self.experts - self.top_k)

    @property
    def nonexpert_params(self) -> float:
        """Everything else: attention, embeddings, norms, routers, shared experts."""
        return self.params_b * 1e9 - self.expert_params

    def state_bytes(self, k_experts: int | None = None) -> float:
        """Checkpointed bytes of the whole job; with `k_experts`, of K experts per layer
        (PEC) plus all non-expert state."""
        k = self.experts if k_experts is None else k_experts
        return self.bytes_per_param * (self.nonexpert_params
                                       + self.expert_params * k / self.experts)


def p_peer_lost(window_s: float, mtbf_hours: float) -> float:
    """Given that a node fails, the probability that its peer (which holds its replica)
    also failed within the `window_s` before: 1 - exp(-window / MTBF) for independent
    exponential failures (memoryless: the peer's failure time is the same distribution
    whatever the first node did)."""
    if window_s < 0:
        raise ValueError(f"the window must be >= 0 s, got {window_s}")
    if not mtbf_hours > 0:
        raise ValueError(f"--mtbf-hours must be > 0, got {mtbf_hours}")
    return -math.expm1(-window_s / (mtbf_hours * 3600.0))


def p_both_fail(window_s: float, mtbf_hours: float) -> float:
    """The probability that a given node and its peer both fail within one window of
    `window_s`: (1 - exp(-window / MTBF))^2, independent exponential failures."""
    return p_peer_lost(window_s, mtbf_hours) ** 2


@dataclass(frozen=True)
class PeerTier:
    """What the peer replicas cost and give, per node (docs/SIMULATE.md "Peer tier")."""

    replica_bytes: float
    """Bytes each node sends to its peer after a snapshot (and pulls back after a loss)."""
    net_Bps: float
    """Network bandwidth per node the replica may use, bytes per second."""
    mtbf_hours: float
    """MTBF of one node: how likely the peer is gone too."""

    def __post_init__(self) -> None:
        if not self.net_Bps > 0:
            raise ValueError(f"--net-GBps must be > 0, got {self.net_Bps / 1e9}")
        if not self.replica_bytes >= 0:
            raise ValueError(f"replica bytes must be >= 0, got {self.replica_bytes}")

    @property
    def replicate_s(self) -> float:
        """Time to send one replica (and to pull it back after a node loss)."""
        return self.replica_bytes / self.net_Bps

    def lag(self, w: float) -> int:
        """Checkpoints per replica: 1 when a replica fits in the interval W; else a new
        replica starts only when the previous one is done (a snapshot whose predecessor
        is still on the wire is not sent), every ceil(t_rep / W) checkpoints."""
        return max(1, math.ceil(self.replicate_s / w))

    def lost_work_s(self, w: float) -> float:
        """Expected work lost when recovering from the peer: replicas start every k W
        (k = `lag`) and land t_rep later; a failure at u uniform in [0, k W) after a start
        finds the newest one (age u) if u >= t_rep, the one before (age u + k W)
        otherwise: k W / 2 + t_rep on average (W / 2 + t_rep when it fits)."""
        return self.lag(w) * w / 2 + self.replicate_s

    def window_s(self, w: float) -> float:
        """How long a node's replica is exposed to its peer's loss: a replica is rebuilt
        only by the next one, so a peer lost within one replica period plus the transfer
        takes it away."""
        return self.lag(w) * w + self.replicate_s

    def net_share(self, w: float) -> float:
        """Fraction of the replica bandwidth the replicas use on average."""
        return self.replicate_s / (self.lag(w) * w)


def ettr_peers(interval: int, costs: Costs, rate: float, peer: PeerTier) -> float:
    """ETTR of a strategy with peer replicas under node faults: a failure costs the
    restart + the pull from the peer + the peer's lost work, unless the peer was lost too
    (`p_peer_lost` over `window_s`), when it costs R + W / 2 from storage as without."""
    if interval < 1:
        raise ValueError(f"interval must be >= 1 step, got {interval}")
    work = interval * costs.step_s
    w = work + costs.ckpt_s
    p = p_peer_lost(peer.window_s(w), peer.mtbf_hours)
    from_peer = costs.restart_s + peer.replicate_s + peer.lost_work_s(w)
    from_storage = costs.recovery_s + w / 2
    per_failure = (1 - p) * from_peer + p * from_storage
    return (work / w) * max(0.0, 1.0 - rate * per_failure)


def best_interval_peers(costs: Costs, rate: float, peer: PeerTier) -> int | None:
    """The best interval with peers. No closed form (the replica's lag and the peer-loss
    window depend on W), so: a geometric grid of 400 points up to 100x the interval
    without peers, then every integer within 2% of the grid's best."""
    top = 100 * max(10, best_interval(costs, rate) or 10)
    grid = sorted({max(1, round(top ** (k / 400))) for k in range(401)})
    best = max(grid, key=lambda i: ettr_peers(i, costs, rate, peer))
    span = max(2, best // 50)
    best = max(range(max(1, best - span), best + span + 1),
               key=lambda i: ettr_peers(i, costs, rate, peer))
    return best if ettr_peers(best, costs, rate, peer) > 0 else None


def nodes_of(n_gpus: int, gpus_per_node: int) -> int:
    """Nodes of a job on `n_gpus` GPUs, `gpus_per_node` to a node (whole nodes only)."""
    if gpus_per_node < 1:
        raise ValueError(f"--gpus-per-node must be >= 1, got {gpus_per_node}")
    if n_gpus < gpus_per_node or n_gpus % gpus_per_node:
        raise ValueError(f"--gpus: {n_gpus} is not a multiple of --gpus-per-node "
                         f"{gpus_per_node}")
    return n_gpus // gpus_per_node


def scale_table(costs: list[Costs], model: ModelSize, *, gpus: list[int], gpus_per_node: int,
                mtbf_hours: float, net_GBps: float, storage_GBps: float,
                k_replica: int | None, peers_of: str | None) -> list[dict[str, Any]]:
    """Per GPU count and strategy, node faults: the restore from storage reads this node's
    share of the whole state at `storage_GBps`; `peers_of` (a strategy's name) also gets a
    "<name>+peers" row whose replicas hold K experts per layer (`k_replica`, None: all) plus
    all non-expert state."""
    if not storage_GBps > 0:
        raise ValueError(f"--storage-GBps must be > 0, got {storage_GBps}")
    if k_replica is not None and not 1 <= k_replica <= model.experts:
        raise ValueError(f"--k-replica must be in 1..{model.experts} or all, got {k_replica}")
    if peers_of is not None and peers_of not in [c.name for c in costs]:
        raise ValueError(f"--peers needs the {peers_of!r} strategy in --strategies")
    rows = []
    for n_gpus in gpus:
        nodes = nodes_of(n_gpus, gpus_per_node)
        rate = failure_rate(nodes, mtbf_hours)
        own = model.state_bytes() / nodes
        base = {"gpus": n_gpus, "nodes": nodes, "mtbf_hours": mtbf_hours,
                "failure_every_h": 1 / rate / 3600, "state_bytes_per_node": own}
        for c in costs:
            c = Costs(c.name, c.step_s, c.ckpt_s, c.restart_s, own / (storage_GBps * 1e9),
                      "storage")
            best = best_interval(c, rate)
            rows.append({**base, "strategy": c.name, "recovery_s": c.recovery_s,
                         "best_interval": best,
                         "ettr_best": ettr(best, c, rate) if best is not None else 0.0})
            if c.name != peers_of:
                continue
            peer = PeerTier(model.state_bytes(k_replica) / nodes, net_GBps * 1e9, mtbf_hours)
            best = best_interval_peers(c, rate, peer)
            w = (best or 1) * c.step_s + c.ckpt_s
            rows.append({**base, "strategy": f"{c.name}+peers",
                         "recovery_s": c.restart_s + peer.replicate_s, "best_interval": best,
                         "ettr_best": ettr_peers(best, c, rate, peer) if best else 0.0,
                         "replica_bytes_per_node": peer.replica_bytes,
                         "replicate_s": peer.replicate_s, "replica_lag": peer.lag(w),
                         "net_share": peer.net_share(w),
                         "p_peer_lost": p_peer_lost(peer.window_s(w), mtbf_hours),
                         "p_both_fail_per_interval": p_both_fail(w, mtbf_hours),
                         "host_bytes_per_node": N_SLOTS_OWN * own
                         + REPLICA_SLOTS * peer.replica_bytes})
    return rows


def scale_markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| GPUs | nodes | a failure every | strategy | R | best I | ETTR at best I "
             "| replica / node | t_rep | lag | NIC share | P(peer lost) | P(both in W) "
             "| host memory / node |",
             "| ---: | ---: | ---: | --- | " + " | ".join(["---:"] * 10) + " |"]
    for r in rows:
        best = "-" if r["best_interval"] is None else str(r["best_interval"])
        if "replica_bytes_per_node" in r:
            extra = (f"{r['replica_bytes_per_node'] / 1e9:.1f} GB | {r['replicate_s']:.2f} s "
                     f"| {r['replica_lag']} | {100 * r['net_share']:.1f}% "
                     f"| {r['p_peer_lost']:.2e} | {r['p_both_fail_per_interval']:.2e} "
                     f"| {r['host_bytes_per_node'] / 1e9:.0f} GB")
        else:
            extra = " | ".join(["-"] * 7)
        lines.append(f"| {r['gpus']} | {r['nodes']} | {r['failure_every_h']:.2f} h "
                     f"| {r['strategy']} | {r['recovery_s']:.1f} s | {best} "
                     f"| {r['ettr_best']:.4f} | {extra} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# Recovery modes at a job MTBF (docs/SIMULATE.md "Recovery modes")

JOB_MTBF_MIN = 10.0
"""Default job MTBF of the recovery-modes table, minutes: MoEvement's setting (below)."""

RECOVERY_STEP_S = 2.0
"""Default T of the recovery-modes table (unless --step-time): a 2 s step, as a
DeepSeekMoE-16B-sized model's step on a GPU cluster (the issue's setting; an assumption,
not a measurement)."""

CLUSTER_RESTART_S = 60.0
"""The assumed downtime of a torchrun restart on a GPU cluster (--cluster-restart-s):
rescheduling, process start, NCCL set-up and loading take a minute or more there; not
measured by this project (on its 2-core VM a restart takes ~5 s: `--downtimes`)."""

MOEVEMENT_ETTR = 0.94
"""MoEvement's published ETTR: "sustaining ETTR >= 0.94 even under frequent failures (MTBF
as low as 10 minutes)" (Gandhi and Kozyrakis, "Sparse Checkpointing for Fast and Reliable
MoE Training", NSDI '26, arXiv:2412.15411; MoE models of up to 64 experts). Printed beside
the model's figures for comparison; it is that paper's measurement, not an output here."""


def node_mtbf_hours(job_mtbf_min: float, nodes: int) -> float:
    """One node's MTBF, in hours, when a job on `nodes` independent nodes fails every
    `job_mtbf_min` minutes on average: the nodes' failure rates add up, so a node's MTBF
    is `nodes` times the job's (`failure_rate` inverted)."""
    if not job_mtbf_min > 0:
        raise ValueError(f"--job-mtbf-min must be > 0, got {job_mtbf_min}")
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    return nodes * job_mtbf_min / 60.0


def recovery_modes_table(costs: Costs, modes: list[Downtime], model: ModelSize, *,
                         gpus: list[int], gpus_per_node: int, job_mtbf_min: float,
                         net_GBps: float, storage_GBps: float, k_replica: int | None
                         ) -> list[dict[str, Any]]:
    """Per GPU count and recovery mode, node faults with the job failing every
    `job_mtbf_min` minutes: `costs`' T and C, and each mode's downtime as the fixed part
    of R. The rest is the `--peers` table's `<strategy>+peers` row (`scale_table`,
    `ettr_peers`): the replaced node pulls its share of the state from its peer (R =
    downtime + t_rep, lost work W/2 + t_rep), or, when the peer was lost too, reads it
    from storage (R = downtime + S / (n B_storage), lost work W/2)."""
    rows = []
    for n_gpus in gpus:
        mtbf_hours = node_mtbf_hours(job_mtbf_min, nodes_of(n_gpus, gpus_per_node))
        for mode in modes:
            c = replace(costs, name=mode.label, restart_s=mode.seconds, restore_s=0.0,
                        restore_from="measured downtime")
            *_, peers = scale_table([c], model, gpus=[n_gpus], gpus_per_node=gpus_per_node,
                                    mtbf_hours=mtbf_hours, net_GBps=net_GBps,
                                    storage_GBps=storage_GBps, k_replica=k_replica,
                                    peers_of=mode.label)
            rows.append({**peers, "strategy": f"{costs.name}+peers", "recovery": mode.label,
                         "downtime_s": mode.seconds, "downtime_source": mode.describe(),
                         "downtime_events": mode.events, "downtime_kinds": list(mode.kinds),
                         "job_mtbf_min": job_mtbf_min, "moevement_ettr": MOEVEMENT_ETTR})
    return rows


def recovery_modes_markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| GPUs | nodes | recovery | downtime | R = downtime + peer pull | best I "
             "| ETTR at best I | MoEvement (published) |",
             "| ---: | ---: | --- | " + " | ".join(["---:"] * 5) + " |"]
    for r in rows:
        best = "-" if r["best_interval"] is None else str(r["best_interval"])
        source = (f"median of {r['downtime_events']}" if r["downtime_events"]
                  else r["downtime_source"])
        lines.append(f"| {r['gpus']} | {r['nodes']} | {r['recovery']} "
                     f"| {r['downtime_s']:.2f} s ({source}) | {r['recovery_s']:.2f} s "
                     f"| {best} | {r['ettr_best']:.4f} | >= {r['moevement_ettr']:.2f} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# The command line


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="moc simulate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--overhead", type=Path, default=DEFAULT_OVERHEAD,
                   help=f"JSON of `moc bench overhead --json` (default {DEFAULT_OVERHEAD})")
    p.add_argument("--strategies", nargs="+",
                   help="strategies to model (default: all in the file but none); with "
                        "--validate: those to run (default: blocking moc); with "
                        "--recovery-modes: the one whose C is used (default moc)")
    p.add_argument("--nodes", type=int, default=DEFAULT_NODES,
                   help=f"nodes in the job (default {DEFAULT_NODES}: Llama 3 405B's 16,384 "
                        "GPUs, 8 per node)")
    p.add_argument("--mtbf-hours", type=float, default=DEFAULT_MTBF_HOURS,
                   help=f"mean time between failures of one node (default "
                        f"{DEFAULT_MTBF_HOURS:.0f}: Llama 3's 419 unexpected interruptions "
                        "in 54 days on 2,048 nodes)")
    p.add_argument("--step-time", type=float,
                   help="T in seconds instead of the measured one (e.g. a GPU cluster's "
                        "step; --recovery-modes: default "
                        f"{RECOVERY_STEP_S:g}); C and R stay as measured unless "
                        "--scale-costs")
    p.add_argument("--scale-costs", action="store_true",
                   help="with --step-time: scale C and the restore time by the ratio of "
                        "step times (the restart time and a measured downtime do not scale)")
    p.add_argument("--interval", type=int,
                   help="also report ETTR at this interval (default: the bench's)")
    p.add_argument("--restart-s", type=float,
                   help=f"time to notice a fault and restart, restore excluded (default "
                        f"{DEFAULT_RESTART_S:g}: a torchrun restart on the 2-core VM; "
                        "without it, a downtime the --overhead file measured is R)")
    p.add_argument("--fault-kind", choices=["process", "node"], default="process",
                   help="process: strategies with snapshots in memory restore from them; "
                        "node: every strategy restores from storage")
    # Not an argparse exclusive group: its error is not one line (`measured_downtime`).
    p.add_argument("--downtime-s", type=float, metavar="S",
                   help="the per-fault downtime a run measured (detection + restart or "
                        "re-formation + restore): R, in place of restart + restore (at "
                        "scale: in place of the restart; --recovery-modes: one more row)")
    p.add_argument("--downtime-from", type=Path, metavar="METRICS.jsonl",
                   help="as --downtime-s, the median downtime_s of the recovery events in "
                        "a `moc train --metrics` file")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--png", type=Path, help="plot ETTR against the interval here")
    _scale_arguments(p)
    _recovery_arguments(p)
    _validate_arguments(p)
    return p


def _scale_arguments(p: argparse.ArgumentParser) -> None:
    scale = p.add_argument_group(
        "at scale, with the peer tier (node faults; docs/SIMULATE.md \"Peer tier\")")
    scale.add_argument("--peers", action="store_true",
                       help="instead of the table above: ETTR under node faults for each "
                            "--gpus count (default blocking, dcp-async, moc), restores from "
                            "storage sized by the model, plus moc with peer replicas")
    scale.add_argument("--gpus", type=int, nargs="+", default=list(SCALE_GPUS),
                       help=f"GPU counts of the --peers and --recovery-modes tables (default "
                            f"{' '.join(map(str, SCALE_GPUS))})")
    scale.add_argument("--gpus-per-node", type=int, default=GPUS_PER_NODE,
                       help=f"default {GPUS_PER_NODE}")
    scale.add_argument("--net-GBps", type=float, default=DEFAULT_NET_GBPS,
                       help=f"network bandwidth per node for replicas, GB/s (default "
                            f"{DEFAULT_NET_GBPS:g}: one 200 Gb/s NIC)")
    scale.add_argument("--storage-GBps", type=float, default=DEFAULT_STORAGE_GBPS,
                       help=f"storage read bandwidth per node, GB/s (default "
                            f"{DEFAULT_STORAGE_GBPS:g}: ~500 GB/s shared by 256 nodes)")
    scale.add_argument("--k-replica", default="all",
                       help="experts per MoE layer in each replica, or all (default); "
                            "non-expert state is always replicated")
    scale.add_argument("--replica-jump", type=int, default=1,
                       help="node i replicates to node (i + jump) mod n (default 1); with "
                            "independent failures it does not change ETTR, it picks the "
                            "failure domain (a jump of a rack's size leaves the rack)")
    scale.add_argument("--params-b", type=float,
                       help="total parameters, billions (default: DeepSeek-V3's 671 for "
                            "--peers, DeepSeekMoE 16B's 16.4 for --recovery-modes)")
    scale.add_argument("--active-params-b", type=float,
                       help="activated parameters per token, billions (default 37, or 2.8)")
    scale.add_argument("--experts", type=int,
                       help="routed experts per MoE layer (default 256, or 64)")
    scale.add_argument("--top-k", type=int,
                       help="routed experts per token (default 8, or 6)")
    scale.add_argument("--bytes-per-param", type=float, default=DEFAULT_BYTES_PER_PARAM,
                       help=f"checkpointed bytes per parameter (default "
                            f"{DEFAULT_BYTES_PER_PARAM}: bf16 weights + fp32 master + Adam)")


def _recovery_arguments(p: argparse.ArgumentParser) -> None:
    modes = p.add_argument_group(
        "recovery modes at a job MTBF (node faults; docs/SIMULATE.md \"Recovery modes\")")
    modes.add_argument("--recovery-modes", action="store_true",
                       help="instead: ETTR per recovery mode (a GPU cluster's restart, "
                            "then each measured downtime) at a job MTBF of --job-mtbf-min, "
                            "state sized for DeepSeekMoE 16B, restores from a peer, on each "
                            "--gpus count, beside MoEvement's published ETTR")
    modes.add_argument("--downtimes", nargs="+", metavar="LABEL=S|LABEL=METRICS.jsonl",
                       help="--recovery-modes: measured downtimes, one row each, e.g. "
                            "restart=5.3 in-job=2.9 in-job-spare=0.4, or a `moc train "
                            "--metrics` file per label (its recovery events' median)")
    modes.add_argument("--job-mtbf-min", type=float, default=JOB_MTBF_MIN,
                       help=f"--recovery-modes: minutes between failures of the whole job "
                            f"(default {JOB_MTBF_MIN:g}: MoEvement's setting)")
    modes.add_argument("--cluster-restart-s", type=float, default=CLUSTER_RESTART_S,
                       help=f"--recovery-modes: the assumed downtime of a torchrun restart "
                            f"on a GPU cluster, the first row (default {CLUSTER_RESTART_S:g})")


def _validate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--validate", action="store_true",
                   help="instead: real tiny runs (2 ranks) with faults every F steps, the "
                        "model's prediction against the measured time (~2-3 minutes)")
    p.add_argument("--validate-steps", type=int, default=VALIDATE_STEPS,
                   help=f"--validate: steps per run (default {VALIDATE_STEPS})")
    p.add_argument("--validate-interval", type=int, default=VALIDATE_INTERVAL,
                   help=f"--validate: steps between checkpoints (default "
                        f"{VALIDATE_INTERVAL})")
    p.add_argument("--validate-fault-every", type=int, default=VALIDATE_FAULT_EVERY,
                   help=f"--validate: a fault at every multiple of this many steps "
                        f"(default {VALIDATE_FAULT_EVERY})")
    p.add_argument("--validate-repeat", type=int, default=1,
                   help="independent rounds of the validation (~100 s each)")
    p.add_argument("--workdir", type=Path, help="--validate: where the runs write "
                                                "(default: a temp dir)")
    p.add_argument("--no-progress", action="store_true",
                   help="--validate: no progress bar (drawn only on a terminal, never "
                        "under CI)")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `moc simulate -- --png x`: the top-level parser hands the separator on.
    args = _parser().parse_args(argv[1:] if argv[:1] == ["--"] else argv)

    if args.validate:
        v = validate(args.strategies or ["blocking", "moc"], args.validate_steps,
                     args.validate_interval, args.validate_fault_every, args.fault_kind,
                     args.validate_repeat, args.workdir, args.no_progress)
        print(validation_markdown(v))
        print(f"\n(validation wall time {v['wall_s']:.0f} s)")
        if args.json:
            args.json.write_text(json.dumps({"validation": v}, indent=1))
        return 0

    if args.peers and args.recovery_modes:
        raise ValueError("--peers and --recovery-modes print two different tables; pass one")
    if args.downtimes and not args.recovery_modes:
        raise ValueError("--downtimes gives the rows of --recovery-modes; add it (or give "
                         "one downtime with --downtime-s or --downtime-from)")
    if args.restart_s is not None and args.restart_s < 0:
        raise ValueError(f"--restart-s must be >= 0, got {args.restart_s}")
    downtime = measured_downtime(args.downtime_s, args.downtime_from)
    result = load_overhead(args.overhead)
    if args.peers:
        return _main_peers(args, result, downtime)
    if args.recovery_modes:
        return _main_recovery_modes(args, result, downtime)
    return _main_table(args, result, downtime)


def _r_text(restart_s: float, downtime: Downtime | None, costs: list[Costs]) -> str:
    """The header's account of R in the first table."""
    if downtime is not None:
        return f"R = the measured downtime {downtime.seconds:g} s ({downtime.describe()})"
    measured = [c.name for c in costs if c.restore_from.endswith("measured downtime")]
    if not measured:
        return f"restart {restart_s:g} s + restore"
    rest = ("" if len(measured) == len(costs)
            else f", restart {restart_s:g} s + restore for the rest")
    return (f"R = the downtime the bench measured for {', '.join(measured)}{rest} "
            "(--restart-s to assume one instead)")


def _main_table(args: argparse.Namespace, result: dict[str, Any],
                downtime: Downtime | None) -> int:
    """`moc simulate`: the first table, ETTR per strategy (`simulate`)."""
    names = args.strategies or [n for n in result["strategies"] if n != "none"]
    if "none" in names:
        raise ValueError("--strategies: none takes no checkpoints, it is the reference T; "
                         "leave it out")
    interval = args.interval if args.interval is not None else result["config"]["interval"]
    if interval < 1:
        raise ValueError(f"--interval must be >= 1, got {interval}")
    restart_s = DEFAULT_RESTART_S if args.restart_s is None else args.restart_s
    rate = failure_rate(args.nodes, args.mtbf_hours)
    costs, basis = costs_from_overhead(result, args.overhead, names, restart_s=restart_s,
                                       fault_kind=args.fault_kind, step_time=args.step_time,
                                       scale_costs=args.scale_costs, downtime=downtime,
                                       measured_downtime=args.restart_s is None)
    rows = simulate(costs, rate, interval)
    r_text = _r_text(restart_s, downtime, costs)
    print(f"{args.nodes} nodes, MTBF {args.mtbf_hours:g} h per node: a failure every "
          f"{1 / rate / 3600:.2f} h; {args.fault_kind} faults; {r_text}; T and C from "
          f"{args.overhead} ({basis} means, measured interval {result['config']['interval']})"
          + (f"; T set to {args.step_time:g} s" + (", C and restore scaled"
                                                   if args.scale_costs else "")
             if args.step_time is not None else ""))
    print()
    print(markdown(rows))
    if args.json:
        args.json.write_text(json.dumps(
            {"inputs": {"overhead": str(args.overhead), "nodes": args.nodes,
                        "mtbf_hours": args.mtbf_hours, "failure_rate_per_s": rate,
                        "restart_s": restart_s, "fault_kind": args.fault_kind,
                        "downtime": asdict(downtime) if downtime else None,
                        "step_time": args.step_time, "scale_costs": args.scale_costs,
                        "interval": interval, "basis": basis},
             "strategies": rows}, indent=1))
    if args.png:
        write_png(args.png, costs, rows, rate,
                  f"ETTR: {args.nodes} nodes, MTBF {args.mtbf_hours:g} h per node, "
                  f"{args.fault_kind} faults, {r_text}")
    return 0


def _k_replica(text: str) -> int | None:
    if text == "all":
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"--k-replica must be a number of experts or all, got {text!r}"
                         ) from None


def _model(args: argparse.Namespace, default: dict[str, Any]) -> ModelSize:
    """The model size of the options, each one not given taken from `default`."""
    given = {"params_b": args.params_b, "active_params_b": args.active_params_b,
             "experts": args.experts, "top_k": args.top_k}
    return ModelSize(**{k: default[k] if v is None else v for k, v in given.items()},
                     bytes_per_param=args.bytes_per_param)


def _main_peers(args: argparse.Namespace, result: dict[str, Any],
                downtime: Downtime | None) -> int:
    """`moc simulate --peers`: the scale table (`scale_table`). A measured downtime (only
    when given: the bench's is a tiny model's on this VM) takes the restart's place."""
    names = args.strategies or [n for n in ("blocking", "dcp-async", "moc")
                                if n in result["strategies"]]
    if "moc" not in names:
        raise ValueError("--peers: the peer replicas are moc's; include moc in --strategies "
                         f"(got {' '.join(names)})")
    if args.replica_jump < 1:
        raise ValueError(f"--replica-jump must be >= 1, got {args.replica_jump}")
    for n_gpus in args.gpus:
        nodes = n_gpus // max(1, args.gpus_per_node)
        if nodes > 1 and args.replica_jump % nodes == 0:
            raise ValueError(f"--replica-jump {args.replica_jump} sends node i's replica to "
                             f"itself on {nodes} nodes; choose a jump that is not a "
                             "multiple of the node count")
    model = _model(args, DEEPSEEK_V3)
    restart_s = DEFAULT_RESTART_S if args.restart_s is None else args.restart_s
    costs, basis = costs_from_overhead(result, args.overhead, names, restart_s=restart_s,
                                       fault_kind="node", step_time=args.step_time,
                                       scale_costs=args.scale_costs, downtime=downtime)
    k_replica = _k_replica(args.k_replica)
    rows = scale_table(costs, model, gpus=args.gpus, gpus_per_node=args.gpus_per_node,
                       mtbf_hours=args.mtbf_hours, net_GBps=args.net_GBps,
                       storage_GBps=args.storage_GBps, k_replica=k_replica,
                       peers_of="moc")
    fixed = (f"restart {restart_s:g} s" if downtime is None else
             f"downtime {downtime.seconds:g} s ({downtime.describe()}) in place of a restart")
    print(f"node faults, MTBF {args.mtbf_hours:g} h per node; model {model.params_b:g}B "
          f"params ({model.expert_params / 1e9:.1f}B in {model.experts} routed experts per "
          f"layer), {args.bytes_per_param:g} B/param = {model.state_bytes() / 1e12:.2f} TB; "
          f"replicas: {args.k_replica} experts per layer + non-expert state, jump "
          f"{args.replica_jump}, {args.net_GBps:g} GB/s per node; storage "
          f"{args.storage_GBps:g} GB/s per node; {fixed}; T and C "
          f"from {args.overhead} ({basis} means)"
          + (f"; T set to {args.step_time:g} s" + (", C scaled" if args.scale_costs else "")
             if args.step_time is not None else ""))
    print()
    print(scale_markdown(rows))
    if args.json:
        args.json.write_text(json.dumps(
            {"inputs": {"overhead": str(args.overhead), "mtbf_hours": args.mtbf_hours,
                        "restart_s": restart_s,
                        "downtime": asdict(downtime) if downtime else None,
                        "step_time": args.step_time,
                        "scale_costs": args.scale_costs, "basis": basis,
                        "gpus_per_node": args.gpus_per_node, "net_GBps": args.net_GBps,
                        "storage_GBps": args.storage_GBps, "k_replica": args.k_replica,
                        "replica_jump": args.replica_jump, "model": asdict(model),
                        "state_bytes": model.state_bytes(),
                        "expert_params": model.expert_params},
             "scale": rows}, indent=1))
    return 0


def recovery_modes(cluster_restart_s: float, measured: Downtime | None,
                   downtimes: list[str]) -> list[Downtime]:
    """The rows of `--recovery-modes`: the assumed cluster restart, then the measured
    downtimes (`--downtime-s`/`--downtime-from`, then each `--downtimes` entry)."""
    if not (cluster_restart_s >= 0 and math.isfinite(cluster_restart_s)):
        raise ValueError(f"--cluster-restart-s must be >= 0, got {cluster_restart_s}")
    modes = [*([measured] if measured is not None else []),
             *(parse_downtime(text) for text in downtimes)]
    if not modes:
        raise ValueError("--recovery-modes compares measured downtimes: give them with "
                         "--downtimes restart=S in-job=S in-job-spare=S (seconds, or a "
                         "`moc train --metrics` file per label), or one with --downtime-s "
                         "or --downtime-from")
    modes.insert(0, Downtime("restart, GPU cluster", cluster_restart_s, "assumed"))
    labels = [m.label for m in modes]
    if len(set(labels)) != len(labels):
        raise ValueError(f"--downtimes: each label once, got {' '.join(labels)}")
    return modes


def _main_recovery_modes(args: argparse.Namespace, result: dict[str, Any],
                         downtime: Downtime | None) -> int:
    """`moc simulate --recovery-modes`: ETTR per recovery mode (`recovery_modes_table`)."""
    names = args.strategies or ["moc"]
    if len(names) != 1 or names[0] == "none":
        raise ValueError("--recovery-modes: --strategies names the one strategy whose C "
                         f"the table uses (default moc), got {' '.join(names)}")
    modes = recovery_modes(args.cluster_restart_s, downtime, args.downtimes or [])
    step_time = RECOVERY_STEP_S if args.step_time is None else args.step_time
    # T and C alone: each mode's downtime replaces R (`recovery_modes_table`), so the
    # bench's restore figures are neither used nor required.
    (costs,), basis = costs_from_overhead(result, args.overhead, names, restart_s=0.0,
                                          fault_kind="node", step_time=step_time,
                                          scale_costs=args.scale_costs, downtime=modes[0])
    model = _model(args, DEEPSEEK_MOE_16B)
    rows = recovery_modes_table(costs, modes, model, gpus=args.gpus,
                                gpus_per_node=args.gpus_per_node,
                                job_mtbf_min=args.job_mtbf_min, net_GBps=args.net_GBps,
                                storage_GBps=args.storage_GBps,
                                k_replica=_k_replica(args.k_replica))
    print(f"node faults, the job failing every {args.job_mtbf_min:g} min; T = "
          f"{step_time:g} s, C = {costs.ckpt_s:.4f} s ({costs.name}, from {args.overhead}, "
          f"{basis} means{', scaled to T' if args.scale_costs else ', as measured'}); model "
          f"{model.params_b:g}B params, {model.experts} routed experts, top {model.top_k}, "
          f"{args.bytes_per_param:g} B/param = {model.state_bytes() / 1e9:.0f} GB; the "
          f"replaced node pulls its share from its peer at {args.net_GBps:g} GB/s (from "
          f"storage at {args.storage_GBps:g} GB/s if the peer is lost too)")
    print()
    print(recovery_modes_markdown(rows))
    print()
    for mode in modes:
        print(f"- {mode.label}: {mode.seconds:.2f} s, {mode.describe()}")
    print(f"- MoEvement: ETTR >= {MOEVEMENT_ETTR} at a job MTBF of 10 min, as published "
          "(arXiv:2412.15411), not modelled here")
    if args.json:
        args.json.write_text(json.dumps(
            {"inputs": {"overhead": str(args.overhead), "strategy": costs.name,
                        "job_mtbf_min": args.job_mtbf_min, "step_time": step_time,
                        "scale_costs": args.scale_costs, "basis": basis,
                        "ckpt_s": costs.ckpt_s, "modes": [asdict(m) for m in modes],
                        "gpus_per_node": args.gpus_per_node, "net_GBps": args.net_GBps,
                        "storage_GBps": args.storage_GBps, "k_replica": args.k_replica,
                        "model": asdict(model), "state_bytes": model.state_bytes(),
                        "moevement_ettr": MOEVEMENT_ETTR},
             "recovery_modes": rows}, indent=1))
    return 0


if __name__ == "__main__":
    # Through the `moc` command line, for its one-line errors.
    from moc.cli import main as moc_main

    sys.exit(moc_main(["simulate", *sys.argv[1:]]))  # moc_main adds the "--"
