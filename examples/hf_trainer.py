"""A tiny Mixtral (or Qwen2-MoE) trained by `transformers.Trainer` with moc's two-level
checkpoints; killed with SIGKILL mid-run and started again, it resumes exactly.

    pip install 'moc[hf]'
    # straight, 2 ranks (Trainer's DDP; gloo on the CPU):
    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --dir runs/hft-a --steps 30
    # rank 1 SIGKILLs itself in step 17 (torchrun then stops the job) ...
    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --dir runs/hft-b \
        --steps 30 --fault-at 17
    # ... and the same command without --fault-at resumes from moc's memory snapshot:
    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --dir runs/hft-b --steps 30
    # one process, Qwen2-MoE:
    python examples/hf_trainer.py --dir runs/hft-q --steps 30 --model qwen2_moe

It prints one JSON line per optimizer step, {"step": s, "loss": x, "hex": ...} (the loss
of the step's micro-batches, averaged over the ranks; "hex" is exact), and
{"resumed": s, "source": ...} when it resumed. moc checkpoints every step (`--interval
1`, the default), so a resumed run goes on at the step after the last one printed: no
step is printed twice. Attention dropout is on, so the losses after a resume equal an
uninterrupted run's only if every RNG came back, and the learning rate follows a cosine
schedule with warmup, so they do only if the scheduler came back.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    TrainerCallback,
    TrainingArguments,
)
from transformers.trainer_callback import PrinterCallback

import moc
from moc.integrations.hf_trainer import MocArguments, MocTrainer

VOCAB, LENGTH = 128, 16


def build_model(kind: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)  # the same initial weights on every rank and every run
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  attention_dropout=0.1)
    if kind == "mixtral":
        return MixtralForCausalLM(MixtralConfig(**common, num_local_experts=4,
                                                num_experts_per_tok=2))
    return Qwen2MoeForCausalLM(Qwen2MoeConfig(**common, num_experts=4, num_experts_per_tok=2,
                                              moe_intermediate_size=32,
                                              shared_expert_intermediate_size=32))


def dataset(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """`n` fixed sequences: arithmetic progressions mod VOCAB, something to learn."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(VOCAB, (n, 1), generator=g)
    stride = torch.randint(1, 5, (n, 1), generator=g)
    ids = (start + stride * torch.arange(LENGTH)) % VOCAB
    return [{"input_ids": row, "labels": row} for row in ids]


class ExampleTrainer(MocTrainer):
    """Trainer with moc, that also keeps each optimizer step's exact loss."""

    step_loss = torch.tensor(0.0)

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.step_loss = self.step_loss + loss.detach().cpu()  # summed over micro-batches
        return loss


class Report(TrainerCallback):
    """Prints each step's loss on rank 0; SIGKILLs the last rank in step `fault_at`,
    after its optimizer step (the step's update applied, its checkpoint not taken)."""

    def __init__(self, trainer: ExampleTrainer, fault_at: int | None) -> None:
        self.trainer, self.fault_at = trainer, fault_at

    def on_train_begin(self, args, state, control, **kwargs):
        r = self.trainer.recovery  # set before Trainer starts: what moc resumed from
        if r is not None and args.process_index == 0:
            print(json.dumps({"resumed": r.step, "source": r.source,
                              "recovery_s": round(r.recovery_s, 4),
                              "lost_tokens": r.lost_tokens}), flush=True)

    def on_optimizer_step(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.fault_at and args.process_index == args.world_size - 1:
            os.kill(os.getpid(), signal.SIGKILL)  # a crash, as real as they come

    def on_step_end(self, args, state, control, **kwargs):
        loss, self.trainer.step_loss = self.trainer.step_loss, torch.tensor(0.0)
        if dist.is_initialized():
            loss = loss.to(args.device)  # NCCL reduces on the GPU, gloo on the CPU
            dist.all_reduce(loss)  # every rank's micro-batches
            loss = loss / dist.get_world_size()
        if args.process_index == 0:
            value = loss.item()
            print(json.dumps({"step": state.global_step, "loss": value, "hex": value.hex()}),
                  flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, required=True,
                   help="run directory: moc/ (moc's checkpoints) and trainer/ (Trainer's)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps (max_steps)")
    p.add_argument("--fault-at", type=int, help="the last rank SIGKILLs itself in this step")
    p.add_argument("--model", choices=("mixtral", "qwen2_moe"), default="mixtral")
    p.add_argument("--interval", type=int, default=1, help="steps between moc checkpoints")
    p.add_argument("--grad-accum", type=int, default=2, help="gradient_accumulation_steps")
    p.add_argument("--batch-size", type=int, default=4, help="per device")
    p.add_argument("--samples", type=int, default=48, help="dataset size (epochs turn over)")
    p.add_argument("--trainer-save-steps", type=int, default=0,
                   help="Trainer's own checkpoints too, every N steps (0: off)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    args = TrainingArguments(
        output_dir=str(a.dir / "trainer"), max_steps=a.steps, seed=a.seed,
        per_device_train_batch_size=a.batch_size, gradient_accumulation_steps=a.grad_accum,
        learning_rate=3e-3, lr_scheduler_type="cosine", warmup_steps=3, logging_steps=1,
        save_strategy="steps" if a.trainer_save_steps else "no",
        save_steps=a.trainer_save_steps or 500, report_to="none", disable_tqdm=True,
        ddp_find_unused_parameters=False, dataloader_num_workers=0,
        dataloader_pin_memory=False,
        use_cpu=not torch.cuda.is_available())  # on the CPU, DDP over gloo needs it
    trainer = ExampleTrainer(
        model=build_model(a.model, a.seed), args=args, train_dataset=dataset(a.samples, a.seed),
        moc=MocArguments(dir=a.dir / "moc", interval=a.interval, policy=moc.PECPolicy(k=1)))
    trainer.remove_callback(PrinterCallback)  # its log dicts are not JSON lines
    trainer.add_callback(Report(trainer, a.fault_at))
    try:
        trainer.train()
    except (ValueError, moc.CheckpointError) as e:
        sys.exit(f"hf_trainer.py: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
