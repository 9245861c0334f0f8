"""The smallest complete training loop with moc: one process, a small MoE, partial experts
checkpoints (`moc.Checkpointer`), resume on the next run.

    python examples/minimal.py --steps 30     # trains steps 1-30, a checkpoint every 10
    python examples/minimal.py --steps 60     # resumes from step 30, trains 31-60

Runs in seconds on a CPU and needs nothing beyond moc itself.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import moc
from moc.model import ModelConfig, Transformer


def batch(step: int, config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets (8, seq_len) of this step, the same on every run: a resumed run
    sees the batches an uninterrupted one would have. Arithmetic sequences with a random
    start and stride (something to learn); the targets are the next tokens."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(config.vocab_size, (8, 1), generator=g)
    stride = torch.randint(1, 5, (8, 1), generator=g)
    tokens = (start + stride * torch.arange(config.seq_len + 1)) % config.vocab_size
    return tokens[:, :-1], tokens[:, 1:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30, help="train up to this step (default 30)")
    p.add_argument("--dir", type=Path, default=Path("runs/minimal/ckpt"),
                   help="checkpoint directory, resumed from (default runs/minimal/ckpt)")
    args = p.parse_args()

    torch.manual_seed(0)
    config = ModelConfig(vocab_size=64, seq_len=32, d_model=32, n_layers=2, n_heads=2,
                         d_ffn=64, n_experts=4)
    model = Transformer(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ckpt = moc.Checkpointer(model, optimizer, args.dir,
                            experts=moc.ExpertSpec.infer(model),
                            policy=moc.PECPolicy(k=1),  # 1 of 4 experts per layer per save
                            interval=10, keep_last=3)
    report = ckpt.restore()                     # None on a fresh start
    start = report.step if report else 0
    print(f"resumed from step {report.step}, lost tokens {report.lost_tokens}" if report
          else "fresh start")
    ckpt.watch_routing(model)                   # counts routed tokens: PLT, Dynamic-K
    for step in range(start + 1, args.steps + 1):
        x_BT, y_BT = batch(step, config)
        loss = model(x_BT, y_BT).loss
        loss.backward()
        ckpt.wait_for_snapshot()                # the only place training may wait
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ckpt.maybe_save(step, extra_state={"steps": args.steps}, final=step == args.steps)
        if ckpt.pending:                        # no work on ordinary steps
            for result in ckpt.drain_completed():
                print(f"step {step}: loss {loss.item():.4f}, checkpoint {result.bytes} bytes, "
                      f"{result.n_experts_saved} experts, stall {result.stall_s:.4f}s")
    ckpt.flush()                                # finish what is in flight ...
    ckpt.drain_completed()                      # ... and take its results
    ckpt.close()


if __name__ == "__main__":
    main()
