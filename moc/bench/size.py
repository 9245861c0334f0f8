"""`moc bench size`: what a checkpoint writes, in total and per rank: PEC K = 1, 2, N,
sharded (every rank writes a share) and with the baseline placement (rank 0 and
expert-parallel group 0 write), against the blocking baseline. Measured by real
`moc train` runs (torchrun, W ranks) on the same model and data.

Imbalance is the busiest rank's bytes over the mean (1.0: every rank wrote the same),
the median over a strategy's checkpoints.

Each strategy trains a few steps with a checkpoint every step. The first checkpoint of a
PEC chain saves every expert (there is no older copy yet), and so does the run's final
one (complete by design: whoever continues or exports a finished run gets every expert
of one step), so the figure reported is the median over the checkpoints between them
(issue 50: with --steps 3 the final one made K=1 read 1.9 MB against 1.2 MB
predicted). Beside each measurement the table prints the paper's size model,
C = (P_ne + K/N P_e)(B_w + B_o), with B_w = 4 (fp32 weights) and B_o = 8 (AdamW's two
fp32 moments); the difference is metadata (headers, RNG, step counters).
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

from moc.bench.plots import publish, train_run
from moc.cliparse import OneLineParser
from moc.progress import Progress, progress
from moc.train.config import PRESETS

B_W, B_O = 4, 8
"""Bytes per parameter: fp32 weights; AdamW exp_avg + exp_avg_sq in fp32."""


def parameter_counts(config: str) -> tuple[int, int]:
    """(non-expert, expert) parameters of a preset's model."""
    from moc.model import Transformer
    from moc.parallel import split_parameters

    dense, experts = split_parameters(Transformer(PRESETS[config]["model"]))
    return sum(p.numel() for _, p in dense), sum(p.numel() for _, p in experts)


def _run(workdir: Path, args: list[str], nproc: int, ep: int | None, config: str,
         steps: int) -> list[dict]:
    if ep is not None:
        args = [*args, "--ep", str(ep)]
    events = train_run(["--nproc", str(nproc), "--config", config, "--steps", str(steps),
                        "--ckpt-interval", "1", *args], workdir)
    return [e for e in events if e["event"] == "checkpoint"]


def strategies(n_experts: int, ks: list[int]) -> list[tuple[str, str, list[str], int]]:
    """(name, placement, moc train options, K) of every strategy measured."""
    pec = ["--ckpt-mode", "pec", "--k-persist"]
    out = [("blocking", "baseline", ["--ckpt-mode", "blocking"], n_experts),
           ("pec-all", "sharded", [*pec, "all"], n_experts),
           ("pec-all", "baseline", [*pec, "all", "--no-shard"], n_experts)]
    for k in ks:
        out.append((f"pec-k{k}", "sharded", [*pec, str(k)], k))
    out.append((f"pec-k{ks[0]}", "baseline", [*pec, str(ks[0]), "--no-shard"], ks[0]))
    return out


def run(nproc: int, ep: int | None, config: str, steps: int, ks: list[int], workdir: Path,
        bar: Progress | None = None) -> dict[str, Any]:
    """Every strategy's sizes; `bar` advances by one per strategy run."""
    n = PRESETS[config]["model"].n_experts
    p_ne, p_e = parameter_counts(config)
    results: dict[str, Any] = {}
    for name, placement, args, k in strategies(n, ks):
        label = f"{name} ({placement})"
        if bar is not None:
            bar.note(label)
        d = workdir / f"{name}-{placement}"
        events = _run(d, args, nproc, ep, config, steps)
        shutil.rmtree(d, ignore_errors=True)
        if bar is not None:
            bar.update()
        later = ([e for e in events[1:] if e["step"] != steps] if name.startswith("pec")
                 else events)
        results[label] = {
            "k": k,
            "placement": placement,
            "bytes_per_ckpt": int(statistics.median(e["bytes"] for e in later)),
            "first_ckpt_bytes": events[0]["bytes"],
            "predicted_bytes": int((p_ne + k / n * p_e) * (B_W + B_O)),
            "bytes_per_rank": later[-1]["bytes_per_rank"],
            "imbalance": statistics.median(e["imbalance"] for e in later),
            "stall_median_s": statistics.median(e["stall_s"] for e in later),
            "checkpoints": len(events),
        }
    base = results["blocking (baseline)"]
    for r in results.values():
        r["ratio_vs_blocking"] = r["bytes_per_ckpt"] / base["bytes_per_ckpt"]
        r["predicted_ratio"] = r["predicted_bytes"] / base["predicted_bytes"]
    return {"config": {"preset": config, "nproc": nproc, "ep": ep, "steps": steps,
                       "n_experts": n, "params_non_expert": p_ne, "params_expert": p_e},
            "strategies": results}


def markdown(result: dict[str, Any]) -> str:
    lines = ["| strategy | K | bytes/ckpt | predicted | vs blocking | predicted ratio "
             "| imbalance | median stall |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in result["strategies"].items():
        lines.append(f"| {name} | {r['k']} | {r['bytes_per_ckpt'] / 1e6:.1f} MB "
                     f"| {r['predicted_bytes'] / 1e6:.1f} MB | {r['ratio_vs_blocking']:.3f} "
                     f"| {r['predicted_ratio']:.3f} | {r['imbalance']:.3f} "
                     f"| {r['stall_median_s']:.3f} s |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="moc bench size", description=__doc__)
    p.add_argument("--nproc", type=int, default=2,
                   help="ranks of each moc train run (default 2)")
    p.add_argument("--ep", type=int, help="expert-parallel degree (moc train's default)")
    p.add_argument("--config", default="bench", choices=sorted(PRESETS),
                   help="model preset (default bench)")
    p.add_argument("--steps", type=int, default=5,
                   help="steps (= checkpoints) per strategy, at least 3 (default 5)")
    p.add_argument("--k", type=int, nargs="+", default=[1, 2], help="partial K values")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--workdir", type=Path, help="where checkpoints are written "
                                                "(default: a temporary directory)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (drawn only on a terminal, never under CI)")
    args = p.parse_args(argv)
    if args.steps < 3:
        raise ValueError(f"--steps must be >= 3, got {args.steps}: a PEC chain's first "
                         "checkpoint and a run's final one save every expert, and the "
                         "partial ones are measured between them")
    n_runs = len(strategies(PRESETS[args.config]["model"].n_experts, args.k))
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp, \
            progress(n_runs, "bench size", "run", disable=args.no_progress) as bar:
        result = run(args.nproc, args.ep, args.config, args.steps, args.k, Path(tmp), bar)
    cfg = result["config"]
    publish("moc bench size",
            [("model", f"{cfg['preset']}: {cfg['params_non_expert']:,} non-expert + "
                       f"{cfg['params_expert']:,} expert parameters, N = {cfg['n_experts']}"),
             ("ranks / ep", f"{cfg['nproc']} / {cfg['ep'] or 'default'}")],
            markdown(result), result, args.json, None, lambda path: None)
    return 0
