"""`moc bench trainer`: time per step of `transformers.Trainer` with moc's checkpoints
against Trainer's own `save_steps` checkpointing at the same interval, and against no
checkpoint at all, on the same model and data, side by side in one run.

Each run is a fresh process (`--worker MODE`) that trains a Mixtral for `--steps`
optimizer steps and reports the wall time of every step (from one `on_step_end` to the
next: forward, backward, optimizer, and any checkpoint taken at the step). The modes run
in paired rounds (none, trainer, moc; `--repeat` rounds), so a noisy stretch of a shared
machine hits all three alike. The figures: the mean step time of each mode over all
rounds, its ratio to no checkpoint (throughput), and the mean time of the steps that
checkpointed.

- `trainer`: `save_strategy="steps"`, `save_steps=--interval`, `save_total_limit=2`:
  Trainer writes the model (safetensors), the optimizer, scheduler and RNG files,
  synchronously, at each checkpoint step.
- `moc`: `MocTrainer`, `MocArguments(interval=--interval, policy=PECPolicy(k=1))`:
  a snapshot to host memory behind the next steps, a background persist of the partial
  checkpoint; the restart takes it (tests/integrations/test_hf_trainer.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from moc.cliparse import OneLineParser

MODES = ("none", "trainer", "moc")


def worker(a: argparse.Namespace) -> dict[str, Any]:
    """One run of one mode, in this process: its step times."""
    import torch
    from transformers import (
        MixtralConfig,
        MixtralForCausalLM,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from moc.checkpoint.policy.selection import PECPolicy
    from moc.integrations.hf_trainer import MocArguments, MocTrainer

    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(
        vocab_size=1024, hidden_size=a.hidden, intermediate_size=2 * a.hidden,
        num_hidden_layers=a.layers, num_attention_heads=8, num_key_value_heads=4,
        num_local_experts=a.experts, num_experts_per_tok=2))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1024, (a.batch * (a.steps + 1), a.seq), generator=g)
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(
        output_dir=str(a.dir / "trainer"), max_steps=a.steps, per_device_train_batch_size=a.batch,
        learning_rate=1e-3, report_to="none", disable_tqdm=True, use_cpu=True,
        dataloader_pin_memory=False, logging_strategy="no",
        save_strategy="steps" if a.worker == "trainer" else "no", save_steps=a.interval,
        save_total_limit=2)
    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    if a.worker == "moc":
        trainer = MocTrainer(model=model, args=args, train_dataset=data, moc=MocArguments(
            dir=a.dir / "moc", interval=a.interval, policy=PECPolicy(k=1)))
    else:
        trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.add_callback(Clock())
    trainer.train()
    # A Trainer save happens after on_step_end (in _maybe_log_save_evaluate), so it lands
    # in the next step's interval: step s's time is ends[s] - ends[s-1], s = 2 .. steps;
    # the save of step s is in the time of step s + 1.
    steps = [ends[i] - ends[i - 1] for i in range(1, len(ends))]
    after_save = [steps[i - 1] for i in range(1, len(steps) + 1)
                  if (i + 1) % a.interval == 1 and i + 1 > a.interval]
    params = sum(p.numel() for p in model.parameters())
    return {"mode": a.worker, "step_s": steps, "after_save_s": after_save,
            "steady_from": 2 * a.interval + 2,  # the first step after the second checkpoint
            "params": params, "results": len(getattr(trainer, "checkpoint_results", []))}


def run_mode(mode: str, a: argparse.Namespace, root: Path) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp(prefix=f"{mode}-", dir=root))
    cmd = [sys.executable, "-m", "moc.bench.trainer", "--worker", mode, "--dir", str(out),
           *(f"--{k}={getattr(a, k)}" for k in ("steps", "interval", "hidden", "layers",
                                                 "experts", "batch", "seq"))]
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"{mode} run failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def steady(run: dict[str, Any]) -> list[float]:
    """The run's step times from the step after its second checkpoint on (`step_s[j]` is
    step j + 2)."""
    return run["step_s"][max(0, run["steady_from"] - 2):]


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per mode, over all steps ("all") and in the steady state ("steady"): the mean step,
    its ratio to `none` (throughput, and per paired round) and the step after a save."""
    out: dict[str, dict[str, Any]] = {}
    for part, pick, skip in (("all", lambda r: r["step_s"], 0), ("steady", steady, 2)):
        rows: dict[str, Any] = {}
        for mode in MODES:
            mine = [r for r in runs if r["mode"] == mode]
            saves = [s for r in mine for s in r["after_save_s"][skip:]]
            rounds = [statistics.mean(pick(r)) for r in mine]
            rows[mode] = {"mean_step_s": statistics.mean(s for r in mine for s in pick(r)),
                          "rounds_s": rounds,
                          "checkpoint_step_s": statistics.mean(saves) if saves else None}
        for mode in MODES:
            rows[mode]["throughput"] = rows["none"]["mean_step_s"] / rows[mode]["mean_step_s"]
            rows[mode]["paired"] = [n / m for n, m in zip(rows["none"]["rounds_s"],
                                                          rows[mode]["rounds_s"], strict=True)]
        out[part] = rows
    return out


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="moc bench trainer", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100, help="optimizer steps per run")
    p.add_argument("--interval", type=int, default=10, help="steps between checkpoints "
                   "(moc's interval and Trainer's save_steps)")
    p.add_argument("--hidden", type=int, default=256, help="the Mixtral's hidden size")
    p.add_argument("--layers", type=int, default=4, help="its layers (each an MoE)")
    p.add_argument("--experts", type=int, default=8, help="experts per layer (top-2)")
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    p.add_argument("--repeat", type=int, default=3, help="paired rounds of the three modes")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each run")
    p.add_argument("--json", type=Path, help="write the runs and the summary here")
    p.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        print(json.dumps(worker(a)))
        return 0
    runs = []
    with tempfile.TemporaryDirectory(prefix="moc-bench-trainer-") as root:
        for i in range(a.repeat):
            for mode in MODES:
                runs.append(run_mode(mode, a, Path(root)))
                print(f"round {i + 1}/{a.repeat} {mode:8s} mean step "
                      f"{statistics.mean(runs[-1]['step_s']) * 1e3:.1f} ms", flush=True)
    summary = summarize(runs)
    print(f"\nmoc bench trainer: Mixtral {runs[0]['params'] / 1e6:.1f}M params, "
          f"{a.steps} steps, a checkpoint every {a.interval}, {a.repeat} paired rounds")
    for part, title in (("all", "over all steps"),
                        ("steady", "steady state (after the second checkpoint)")):
        print(f"\n{title}\n{'mode':8s} {'mean step':>10s} {'throughput':>10s} "
              f"{'paired':>22s} {'step after a save':>18s}")
        for mode in MODES:
            r = summary[part][mode]
            save = (f"{r['checkpoint_step_s'] * 1e3:.1f} ms"
                    if r["checkpoint_step_s"] is not None and mode != "none" else "-")
            paired = ", ".join(f"{x:.3f}" for x in r["paired"])
            print(f"{mode:8s} {r['mean_step_s'] * 1e3:8.1f} ms {r['throughput']:10.3f} "
                  f"{paired:>22s} {save:>18s}")
    if a.json:
        a.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()},
                                      "summary": summary, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
