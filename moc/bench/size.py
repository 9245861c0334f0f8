"""`moc bench size`: bytes written per checkpoint, PEC K = 1, 2, N against the blocking
baseline, measured by real `moc train` runs (torchrun, W ranks) on the same model/data.

Each strategy trains a few steps with a checkpoint every step. The first checkpoint of a
PEC chain saves every expert (there is no older copy yet), so the figure reported is the
median over the later checkpoints. Beside each measurement the table prints the paper's
size model, C = (P_ne + K/N P_e)(B_w + B_o), with B_w = 4 (fp32 weights) and B_o = 8
(AdamW's two fp32 moments); the difference is metadata (headers, RNG, step counters).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from moc.train.config import PRESETS
from moc.train.metrics import read_events, table

B_W, B_O = 4, 8
"""Bytes per parameter: fp32 weights; AdamW exp_avg + exp_avg_sq in fp32."""


def parameter_counts(config: str) -> tuple[int, int]:
    """(non-expert, expert) parameters of a preset's model."""
    from moc.model import Transformer
    from moc.parallel import split_parameters

    dense, experts = split_parameters(Transformer(PRESETS[config]["model"]))
    return sum(p.numel() for _, p in dense), sum(p.numel() for _, p in experts)


def _run(workdir: Path, args: list[str], nproc: int, config: str, steps: int) -> list[dict]:
    metrics = workdir / "metrics.jsonl"
    cmd = [sys.executable, "-m", "moc", "train", "--nproc", str(nproc), "--config", config,
           "--steps", str(steps), "--ckpt-interval", "1", "--ckpt-dir", str(workdir / "ckpt"),
           "--metrics", str(metrics), *args]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    return [e for e in read_events(metrics) if e["event"] == "checkpoint"]


def run(nproc: int, config: str, steps: int, ks: list[int], workdir: Path) -> dict[str, Any]:
    n = PRESETS[config]["model"].n_experts
    p_ne, p_e = parameter_counts(config)
    strategies: list[tuple[str, list[str], int]] = [("blocking", ["--ckpt-mode", "blocking"], n)]
    strategies += [(f"pec-k{k}", ["--ckpt-mode", "pec", "--k-persist", str(k)], k) for k in ks]
    strategies.append((f"pec-k{n} (all)", ["--ckpt-mode", "pec", "--k-persist", "all"], n))
    results: dict[str, Any] = {}
    for name, args, k in strategies:
        d = workdir / name.split()[0]
        events = _run(d, args, nproc, config, steps)
        shutil.rmtree(d, ignore_errors=True)
        later = events[1:] if name.startswith("pec") else events
        results[name] = {
            "k": k,
            "bytes_per_ckpt": int(statistics.median(e["bytes"] for e in later)),
            "first_ckpt_bytes": events[0]["bytes"],
            "predicted_bytes": int((p_ne + k / n * p_e) * (B_W + B_O)),
            "stall_median_s": statistics.median(e["stall_s"] for e in later),
            "checkpoints": len(events),
        }
    base = results["blocking"]["bytes_per_ckpt"]
    for r in results.values():
        r["ratio_vs_blocking"] = r["bytes_per_ckpt"] / base
        r["predicted_ratio"] = r["predicted_bytes"] / results["blocking"]["predicted_bytes"]
    return {"config": {"preset": config, "nproc": nproc, "steps": steps, "n_experts": n,
                       "params_non_expert": p_ne, "params_expert": p_e},
            "strategies": results}


def markdown(result: dict[str, Any]) -> str:
    lines = ["| strategy | K | bytes/ckpt | predicted | vs blocking | predicted ratio "
             "| median stall |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in result["strategies"].items():
        lines.append(f"| {name} | {r['k']} | {r['bytes_per_ckpt'] / 1e6:.1f} MB "
                     f"| {r['predicted_bytes'] / 1e6:.1f} MB | {r['ratio_vs_blocking']:.3f} "
                     f"| {r['predicted_ratio']:.3f} | {r['stall_median_s']:.3f} s |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="moc bench size", description=__doc__)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--config", default="bench", choices=sorted(PRESETS))
    p.add_argument("--steps", type=int, default=5, help="steps (= checkpoints) per strategy")
    p.add_argument("--k", type=int, nargs="+", default=[1, 2], help="partial K values")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--workdir", type=Path, help="where checkpoints are written "
                                                "(default: a temporary directory)")
    args = p.parse_args(argv)
    if args.steps < 2:
        raise ValueError("--steps must be >= 2: a PEC chain's first checkpoint is full")
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        result = run(args.nproc, args.config, args.steps, args.k, Path(tmp))
    cfg = result["config"]
    print(table([("model", f"{cfg['preset']}: {cfg['params_non_expert']:,} non-expert + "
                           f"{cfg['params_expert']:,} expert parameters, N = {cfg['n_experts']}"),
                 ("ranks", str(cfg["nproc"]))], "moc bench size"))
    print()
    print(markdown(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0
