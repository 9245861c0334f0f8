"""A tiny Mixtral (or Qwen2-MoE) trained by a loop of your own under
`accelerate.Accelerator`, with moc's two-level checkpoints; killed with SIGKILL mid-run
and started again, it resumes exactly.

    pip install '.[hf]' accelerate
    torchrun --standalone --nproc-per-node 2 examples/accelerate_loop.py --dir runs/acc-a
    # rank 1 SIGKILLs itself in step 17; the same command without --fault-at resumes:
    torchrun --standalone --nproc-per-node 2 examples/accelerate_loop.py --dir runs/acc-b \
        --fault-at 17
    torchrun --standalone --nproc-per-node 2 examples/accelerate_loop.py --dir runs/acc-b
    python examples/accelerate_loop.py --dir runs/acc-q --model qwen2_moe   # one process

Output as examples/hf_trainer.py's: one JSON line per optimizer step, {"step", "loss",
"hex"}, and {"resumed": s, "source": ...} after a resume. Gradient accumulation (2),
shuffled epochs, attention dropout and a cosine schedule are all on, so a resume is exact
only if the data position, every RNG and the scheduler came back.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch.utils.data import DataLoader
from transformers import get_cosine_schedule_with_warmup

import moc
from moc.integrations.accelerate import AcceleratorCheckpointer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_trainer import build_model, dataset  # the same model and data


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, required=True, help="moc's checkpoint directory")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps")
    p.add_argument("--fault-at", type=int, help="the last rank SIGKILLs itself in this step")
    p.add_argument("--model", choices=("mixtral", "qwen2_moe"), default="mixtral")
    p.add_argument("--interval", type=int, default=1, help="steps between moc checkpoints")
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=4, help="per process")
    p.add_argument("--samples", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(), gradient_accumulation_steps=a.grad_accum,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    set_seed(a.seed)
    model = build_model(a.model, a.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = DataLoader(dataset(a.samples, a.seed), batch_size=a.batch_size, shuffle=True)
    # A prepared scheduler steps once per process at each call (accelerate's convention
    # for schedules written for one process): the schedule spans steps x processes.
    n = accelerator.num_processes
    scheduler = get_cosine_schedule_with_warmup(optimizer, 3 * n, a.steps * n)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader,
                                                              scheduler)
    ckpt = AcceleratorCheckpointer(accelerator, model, optimizer, a.dir, dataloader=loader,
                                   scheduler=scheduler, interval=a.interval,
                                   policy=moc.PECPolicy(k=1))
    try:
        step, epoch = ckpt.restore()
    except (ValueError, moc.CheckpointError) as e:
        sys.exit(f"accelerate_loop.py: {e}")
    if ckpt.recovery is not None and accelerator.is_main_process:
        r = ckpt.recovery
        print(json.dumps({"resumed": r.step, "source": r.source,
                          "recovery_s": round(r.recovery_s, 4),
                          "lost_tokens": r.lost_tokens}), flush=True)
    model.train()
    step_loss = torch.tensor(0.0)
    while step < a.steps:
        for batch in ckpt.batches(epoch):
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                step_loss += loss.detach().cpu() / a.grad_accum
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            step += 1
            if step == a.fault_at and accelerator.process_index == accelerator.num_processes - 1:
                os.kill(os.getpid(), signal.SIGKILL)  # its update applied, not checkpointed
            mean = accelerator.reduce(step_loss.to(accelerator.device), reduction="mean")
            step_loss = torch.tensor(0.0)
            if accelerator.is_main_process:
                value = mean.item()
                print(json.dumps({"step": step, "loss": value, "hex": value.hex()}), flush=True)
            ckpt.maybe_save(step, final=step == a.steps)
            if step == a.steps:
                break
        epoch += 1
    ckpt.close()
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
