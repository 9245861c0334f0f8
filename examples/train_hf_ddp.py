"""A transformers Mixtral trained with plain DDP and moc's two-level checkpoints; a rank
is SIGKILLed, torchrun restarts the job, and training resumes exactly where it was.

    pip install '.[hf]'                 # transformers
    # an uninterrupted run:
    torchrun --standalone --nproc-per-node 2 examples/train_hf_ddp.py --out runs/hf-straight
    # rank 1 SIGKILLs itself at step 13; torchrun restarts both ranks, which recover
    # from their snapshots in shared memory (the checkpoint of step 10):
    torchrun --standalone --nproc-per-node 2 --max-restarts 1 examples/train_hf_ddp.py \
        --out runs/hf-fault --fault-at 13
    # every step's loss is bitwise equal to the uninterrupted run's:
    python examples/train_hf_ddp.py --compare runs/hf-straight runs/hf-fault

moc restores the model, the optimizer and every rank's RNG; the data is this script's
to restore, so here a batch is a function of (seed, step, rank): a resumed run sees the
batches the lost one would have seen. With your own DataLoader, save its position in
`extra_state` and restore it from `report.extra`.
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
from torch.nn.parallel import DistributedDataParallel
from transformers import MixtralConfig, MixtralForCausalLM

import moc


def batch(seed: int, step: int, rank: int, size: int, length: int, vocab: int) -> torch.Tensor:
    """Token ids (size, length) for this step and rank, the same on every run:
    arithmetic sequences with a random start and stride, something a model can learn."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + rank)
    start = torch.randint(vocab, (size, 1), generator=g)
    stride = torch.randint(1, 5, (size, 1), generator=g)
    return (start + stride * torch.arange(length)) % vocab


def train(args: argparse.Namespace) -> None:
    if not moc.init_distributed():  # gloo on the CPU, nccl on CUDA; survives restarts
        sys.exit("train_hf_ddp.py: run it under torchrun (see the commands at its top)")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available()
                          else "cpu")
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    config = MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           num_local_experts=4, num_experts_per_tok=2)
    model = MixtralForCausalLM(config).to(device)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ckpt = moc.TwoLevelCheckpointer(
        ddp, optimizer, args.out / "ckpt",
        experts=moc.ExpertSpec.infer(model),    # the batched experts of every MoE layer
        policy=moc.PECPolicy(k=1),              # storage: 1 of 4 experts per layer ...
        interval=args.interval, keep_last=2)    # ... the memory snapshot: all of them
    report = ckpt.restore()                     # None on a fresh start
    start = report.step if report else 0
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # set by torchrun
    if report and rank == 0:
        print(f"restart {restart}: resumed from step {report.step} ({report.source}), "
              f"lost tokens {report.lost_tokens}", flush=True)
    ckpt.watch_routing(model)                   # counts routed tokens: PLT, Dynamic-K
    losses = open(args.out / "losses.jsonl", "a") if rank == 0 else None  # noqa: SIM115
    ddp.train()
    for step in range(start + 1, args.steps + 1):
        if step == args.fault_at and rank == 1 and restart == 0:
            os.kill(os.getpid(), signal.SIGKILL)  # a crash, as real as they come
        input_ids = batch(args.seed, step, rank, 8, 16, config.vocab_size).to(device)
        loss = ddp(input_ids, labels=input_ids).loss
        loss.backward()
        ckpt.wait_for_snapshot()                # the only place training may wait
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ckpt.maybe_save(step, extra_state={"seed": args.seed}, final=step == args.steps)
        if ckpt.pending:                        # no work on ordinary steps
            for result in ckpt.drain_completed():
                log_checkpoint(result, rank)
        mean = loss.detach().clone()
        dist.all_reduce(mean)                   # the loss over all ranks' batches
        if losses is not None:
            value = mean.item() / world
            losses.write(json.dumps({"step": step, "loss": value, "hex": value.hex(),
                                     "restart": restart}) + "\n")
            losses.flush()                      # a SIGKILL loses nothing already logged
    ckpt.flush()                                # finish what is in flight ...
    for result in ckpt.drain_completed():       # ... and take its results
        log_checkpoint(result, rank)
    ckpt.close()
    dist.destroy_process_group()


def log_checkpoint(result: moc.CheckpointResult, rank: int) -> None:
    if rank != 0:
        return
    where = (f"failed: {result.error}" if result.error else "in memory only (a persist was "
             "running)" if result.persist_skipped else f"{result.bytes} bytes persisted")
    print(f"checkpoint {result.step}: {where}, training waited {result.stall_s:.4f}s",
          flush=True)


def last_losses(out: Path) -> dict[int, str]:
    """step -> loss (exact, as float.hex) of the last attempt that ran the step."""
    lines = (json.loads(line) for line in (out / "losses.jsonl").read_text().splitlines())
    return {e["step"]: e["hex"] for e in lines}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("runs/hf-ddp"),
                   help="output directory: ckpt/ and losses.jsonl (default runs/hf-ddp)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--interval", type=int, default=5, help="steps between checkpoints")
    p.add_argument("--fault-at", type=int, help="rank 1 SIGKILLs itself at this step "
                                               "(first attempt only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare", nargs=2, type=Path, metavar=("OUT_A", "OUT_B"),
                   help="compare two runs' losses bitwise instead of training")
    args = p.parse_args()
    if args.compare:
        a, b = (last_losses(out) for out in args.compare)
        differ = sorted(s for s in a.keys() | b.keys() if a.get(s) != b.get(s))
        print(f"{len(a)} and {len(b)} steps; "
              + (f"differ at steps {differ}" if differ else "every loss bitwise equal"))
        return 1 if differ else 0
    args.out.mkdir(parents=True, exist_ok=True)
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
