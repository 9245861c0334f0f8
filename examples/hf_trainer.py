"""A tiny Mixtral (or Qwen2-MoE) trained by `transformers.Trainer` with moc's two-level
checkpoints; killed with SIGKILL mid-run and started again, it resumes exactly.

    pip install '.[hf]'
    # straight, 2 ranks (Trainer's DDP; gloo on the CPU):
    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --dir runs/hft-a --steps 30
    # rank 1 SIGKILLs itself in step 17 (torchrun then stops the job) ...
    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --dir runs/hft-b \
        --steps 30 --fault-at 17
    # ... and the same command without --fault-at resumes from moc's memory snapshot:
    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --dir runs/hft-b --steps 30
    # one process, Qwen2-MoE:
    python examples/hf_trainer.py --dir runs/hft-q --steps 30 --model qwen2_moe
    # in-job recovery (moc run): the killed rank is replaced, the other keeps its process
    # and enters train() again with the same model and optimizer, all from memory:
    moc run --nproc 2 examples/hf_trainer.py --dir runs/hft-j --steps 30 --fault-at 17 --in-job
    # on 2 simulated nodes with spares: 3 kills, then a stop, one per generation
    moc run --nodes 2 --nproc 1 --spares 1 examples/hf_trainer.py --dir runs/hft-n --in-job \
        --fault kill:1:8 --fault kill:0:14 --fault kill:1:20 --fault stop:0:26

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

VOCAB, LENGTH, LR = 128, 16, 3e-3


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
    """Prints each step's loss on rank 0; `fault` (KIND, RANK, STEP): SIGKILLs (or with
    KIND "stop" SIGSTOPs) rank RANK (-1: the last) in step STEP, after its optimizer
    step (the step's update applied, its checkpoint not taken)."""

    def __init__(self, trainer: ExampleTrainer, fault: tuple[str, int, int] | None) -> None:
        self.trainer, self.fault = trainer, fault

    def on_train_begin(self, args, state, control, **kwargs):
        r = self.trainer.recovery  # set before Trainer starts: what moc resumed from
        if r is not None and args.process_index == 0:
            print(json.dumps({"resumed": r.step, "source": r.source,
                              "recovery_s": round(r.recovery_s, 4),
                              "lost_tokens": r.lost_tokens}), flush=True)

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.fault is None:
            return
        kind, rank, step = self.fault
        if state.global_step + 1 == step and args.process_index == rank % args.world_size:
            # a crash, as real as they come; or a hang
            os.kill(os.getpid(), signal.SIGKILL if kind == "kill" else signal.SIGSTOP)

    def on_step_end(self, args, state, control, **kwargs):
        loss, self.trainer.step_loss = self.trainer.step_loss, torch.tensor(0.0)
        if dist.is_initialized():
            loss = loss.to(args.device)  # NCCL reduces on the GPU, gloo on the CPU
            dist.all_reduce(loss)  # every rank's micro-batches
            loss = loss / dist.get_world_size()
        if args.process_index == 0:
            value = loss.item()
            print(json.dumps({"step": state.global_step, "loss": value, "hex": value.hex(),
                              "pid": os.getpid()}), flush=True)


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
    p.add_argument("--in-job", action="store_true",
                   help="under `moc run`: train() entered again in this process after a "
                        "peer is replaced (moc.run), the fault in the first generation only")
    p.add_argument("--fault", type=fault, action="append", default=[],
                   metavar="KIND:RANK:STEP", help="with --in-job: kill or stop rank RANK in "
                   "step STEP; the i-th --fault strikes in generation i (repeat it)")
    a = p.parse_args()
    faults = [("kill", -1, a.fault_at)] * (a.fault_at is not None) + a.fault
    model = build_model(a.model, a.seed)
    try:
        if not a.in_job:
            make_trainer(a, model, faults[0] if faults else None).train()
            return 0
        # Made once, kept across generations: the engine of each is built over them.
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)

        def train(gen: moc.Generation) -> None:
            make_trainer(a, model, faults[gen.number] if gen.number < len(faults) else None,
                         optimizer=optimizer, engine=gen.engine).train()

        moc.run(train, engine=lambda: moc.TwoLevelCheckpointer(
            model, optimizer, a.dir / "moc", policy=moc.PECPolicy(k=1), interval=a.interval))
    except (ValueError, moc.CheckpointError) as e:
        sys.exit(f"hf_trainer.py: {e}")
    return 0


def fault(text: str) -> tuple[str, int, int]:
    """`--fault KIND:RANK:STEP`, e.g. kill:1:12 or stop:0:9."""
    kind, rank, step = text.split(":")
    if kind not in ("kill", "stop"):
        raise argparse.ArgumentTypeError(f"{text}: KIND is kill or stop")
    return kind, int(rank), int(step)


def make_trainer(a: argparse.Namespace, model: torch.nn.Module,
                 fault: tuple[str, int, int] | None,
                 optimizer: torch.optim.Optimizer | None = None,
                 engine: moc.TwoLevelCheckpointer | None = None) -> ExampleTrainer:
    """The Trainer of this run; with `engine`, saving to `moc.run`'s engine, over
    `optimizer` (in-job: made inside each generation, after its process group)."""
    args = TrainingArguments(
        output_dir=str(a.dir / "trainer"), max_steps=a.steps, seed=a.seed,
        per_device_train_batch_size=a.batch_size, gradient_accumulation_steps=a.grad_accum,
        learning_rate=LR, lr_scheduler_type="cosine", warmup_steps=3, logging_steps=1,
        save_strategy="steps" if a.trainer_save_steps else "no",
        save_steps=a.trainer_save_steps or 500, report_to="none", disable_tqdm=True,
        ddp_find_unused_parameters=False, dataloader_num_workers=0,
        dataloader_pin_memory=False,
        use_cpu=not torch.cuda.is_available())  # on the CPU, DDP over gloo needs it
    trainer = ExampleTrainer(
        model=model, args=args, train_dataset=dataset(a.samples, a.seed),
        optimizers=(optimizer, None),
        moc=MocArguments(dir=a.dir / "moc", interval=a.interval, policy=moc.PECPolicy(k=1),
                         engine=engine))
    trainer.remove_callback(PrinterCallback)  # its log dicts are not JSON lines
    trainer.add_callback(Report(trainer, fault))
    return trainer


if __name__ == "__main__":
    sys.exit(main())
