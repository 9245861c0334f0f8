"""A torchtitan MoE (Qwen3) trained with torchtitan's own objects and moc's two-level
checkpoints; a rank is SIGKILLed, torchrun restarts the job, and training resumes exactly.

    pip install '.[torchtitan]'           # torchtitan (and triton, which it imports)
    # an uninterrupted run, on 2 CPU ranks (gloo):
    torchrun --standalone --nproc-per-node 2 examples/train_torchtitan.py --out runs/tt-straight
    # rank 1 SIGKILLs itself at step 8; torchrun restarts both ranks, which recover from
    # their snapshots in shared memory (the checkpoint of step 6):
    torchrun --standalone --nproc-per-node 2 --max-restarts 1 examples/train_torchtitan.py \
        --out runs/tt-fault --fault-at 8
    # every step's loss is bitwise equal to the uninterrupted run's:
    python examples/train_torchtitan.py --compare runs/tt-straight runs/tt-fault

The model, its parallelisation (expert parallel over the 2 ranks, FSDP2), the
`OptimizersContainer`, the LR schedulers and the stateful dataloader are torchtitan's
(examples/torchtitan_model.py builds them as its Trainer does, on the CPU); they are
handed to `moc.integrations.torchtitan.TitanCheckpointer` as they are. In torchtitan's
own Trainer, `MocCheckpointManager` does the same from the job config
(docs/guide/torchtitan.md).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import torch.distributed as dist
from torchtitan_model import build

import moc
from moc.integrations.torchtitan import TitanCheckpointer


def train(args: argparse.Namespace) -> None:
    run = build(seed=0)  # joins torchrun's process group (gloo)
    rank, restart = dist.get_rank(), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = TitanCheckpointer(out / "ckpt", model_parts=[run.model], optimizers=run.optimizers,
                             lr_schedulers=run.lr_schedulers, dataloader=run.dataloader,
                             policy=moc.PECPolicy(k=1), interval=args.interval)
    start = ckpt.restore()  # 0 on a fresh start; the dataloader's position comes back too
    if rank == 0 and ckpt.report is not None:
        r = ckpt.report
        print(f"restart {restart}: resumed from step {r.step} ({r.source}), lost tokens "
              f"{r.lost_tokens}", flush=True)
    for step in range(start + 1, args.steps + 1):
        loss = run.step()  # forward, backward, optimizers.step() (moc waits for its copy)
        if rank == 0:
            with (out / "losses.jsonl").open("a") as f:
                f.write(json.dumps({"step": step, "loss": loss, "hex": loss.hex(),
                                    "restart": restart}) + "\n")
        ckpt.maybe_save(step, final=step == args.steps)
        if step == args.fault_at and restart == 0 and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # a crash, at the worst moment
    ckpt.close()
    dist.destroy_process_group()


def compare(a: Path, b: Path) -> None:
    def losses(d: Path) -> list[dict]:
        return [json.loads(x) for x in (d / "losses.jsonl").read_text().splitlines()]

    straight = {e["step"]: e["hex"] for e in losses(a)}
    bad = [e["step"] for e in losses(b) if straight.get(e["step"]) != e["hex"]]
    if bad:
        sys.exit(f"losses differ at steps {bad}")
    print(f"every loss bitwise equal ({len(losses(b))} steps of {b})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/torchtitan")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--interval", type=int, default=3)
    ap.add_argument("--fault-at", type=int, default=None,
                    help="rank 1 SIGKILLs itself after this step (first attempt only)")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("STRAIGHT", "FAULTED"))
    args = ap.parse_args()
    if args.compare:
        compare(*args.compare)
    else:
        train(args)


if __name__ == "__main__":
    main()
