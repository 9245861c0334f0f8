"""A training job of the two-level engine, as its own process, for tests that run several
jobs on one checkpoint directory (each "host" its own MOC_SHM_ROOT, set by the caller).

    python -m tests.checkpoint.twolevel.job ROOT --steps 50 [--data N] [--restore]
        [--crash] [--resume-step S] [--persist-policy wait]

It restores (with --restore), trains up to --steps with a checkpoint every 10 steps,
and prints one JSON line: the restore's step and source, and a digest of the model at
the end. --crash SIGKILLs the job right after the last step's snapshot is complete (its
memory survives, its persist may not have run); otherwise it closes (a complete final
checkpoint on storage).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys

import torch

from moc.checkpoint.policy.selection import PECPolicy
from moc.checkpoint.twolevel.checkpointer import TwoLevelCheckpointer
from moc.model import ModelConfig, Transformer

CFG = ModelConfig(seq_len=8, d_model=32, n_layers=2, n_heads=2, d_ffn=64, n_experts=8)


def digest(model: torch.nn.Module) -> str:
    """The model's parameters, bit for bit, as a short hex string."""
    h = hashlib.sha1()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--data", type=int, default=0,
                    help="which batches (another value: another trajectory, since the "
                         "learning rate is restored with the optimizer's param groups)")
    ap.add_argument("--restore", action="store_true")
    ap.add_argument("--resume-step", type=int)
    ap.add_argument("--crash", action="store_true")
    ap.add_argument("--persist-policy", default="skip")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    model = Transformer(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ckpt = TwoLevelCheckpointer(model, opt, args.root, policy=PECPolicy(k=1), interval=10,
                                persist_policy=args.persist_policy)
    report = None
    if args.resume_step is not None:
        report = ckpt.restore(args.resume_step)
    elif args.restore:
        report = ckpt.restore()
    start = report.step if report is not None else 0
    out = {"restored": None if report is None else [report.step, report.source],
           "restored_digest": digest(model)}
    for step in range(start + 1, args.steps + 1):
        idx = torch.randint(0, 256, (2, 8),
                            generator=torch.Generator().manual_seed(step + 10**6 * args.data))
        loss = model(idx, idx)
        loss.loss.backward()
        ckpt.wait_for_snapshot()
        opt.step()
        opt.zero_grad()
        ckpt.record_routing(loss.tokens_per_expert)
        ckpt.maybe_save(step, {"step": step})
        ckpt.drain_completed()
    out["digest"] = digest(model)
    if args.crash:
        ckpt.wait_for_snapshot()  # the last snapshot is complete in memory
        print(json.dumps(out), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    ckpt.close()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
