"""In-job recovery for a loop of one's own: a small MoE of this file's own (a router and
an `experts` ModuleList), DDP on gloo, `moc.TwoLevelCheckpointer`, under `moc run`.

    moc run --nproc 2 examples/own_loop.py --out runs/own --fault-at 12
    moc run --nproc 2 examples/own_loop.py --out runs/own-straight
    python examples/own_loop.py --compare runs/own-straight runs/own

Rank 1 SIGKILLs itself at step 12 (`--fault-at`; `--hang-at` SIGSTOPs it instead;
`--fault KIND:RANK:STEP`, repeated, strikes once per generation: the first in generation
0, the next in generation 1, ...). Its host starts a new process; rank 0 keeps its own:
its next collective fails, `moc.run` leaves the generation, rejoins with the newcomer
and enters `train` again, where both restore from memory. Every loss equals the
uninterrupted run's, bit for bit (`--compare`); each line of losses.jsonl says which
process logged it, in which generation and when, and pids.jsonl which process each rank
ran in each generation.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import moc


class MoE(nn.Module):
    """Top-1 routing over `experts` (what moc finds by structure, `ExpertSpec.infer`)."""

    def __init__(self, dim: int, n_experts: int) -> None:
        super().__init__()
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(),
                                                   nn.Linear(2 * dim, dim))
                                     for _ in range(n_experts))

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        gate_NE = self.router(x_ND).softmax(-1)
        weight_N, index_N = gate_NE.max(-1)
        out_ND = torch.zeros_like(x_ND)
        for e, expert in enumerate(self.experts):
            mask_N = index_N == e
            out_ND[mask_N] = weight_N[mask_N, None] * expert(x_ND[mask_N])
        return x_ND + out_ND


class Net(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32, n_experts: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(MoE(dim, n_experts) for _ in range(2))
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx_N: torch.Tensor) -> torch.Tensor:
        x_ND = self.embed(idx_N)
        for layer in self.layers:
            x_ND = layer(x_ND)
        return self.head(x_ND)


def batch(step: int, rank: int) -> torch.Tensor:
    """This rank's tokens at `step`, the same in every run: a resumed run sees the
    batches an uninterrupted one saw."""
    g = torch.Generator().manual_seed(step * 1000 + rank)
    start, stride = torch.randint(64, (1,), generator=g), torch.randint(1, 5, (1,), generator=g)
    return (start + stride * torch.arange(65)) % 64


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("runs/own"),
                   help="output directory: ckpt/ and losses.jsonl (default runs/own)")
    p.add_argument("--steps", type=int, default=20, help="steps to train (default 20)")
    p.add_argument("--fault-at", type=int, help="rank 1 SIGKILLs itself at this step")
    p.add_argument("--hang-at", type=int, help="rank 1 SIGSTOPs itself at this step")
    p.add_argument("--fault", type=fault, action="append", default=[],
                   metavar="KIND:RANK:STEP", help="kill or stop rank RANK at STEP, or lose "
                   "its machine (KIND machine, under moc run --nodes); the i-th --fault "
                   "strikes in generation i (repeat it)")
    p.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"),
                   help="say whether two runs' losses are bitwise equal, and exit")
    args = p.parse_args()
    args.fault[:0] = [("kill", 1, args.fault_at)] * (args.fault_at is not None) + [
        ("stop", 1, args.hang_at)] * (args.hang_at is not None)
    if args.compare:
        a, b = (last_losses(d) for d in args.compare)
        same = a == b
        print("every loss bitwise equal" if same else "losses differ")
        raise SystemExit(0 if same else 1)

    torch.manual_seed(0)
    model = Net()                               # made once: kept across generations
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def train(gen: moc.Generation) -> None:     # entered again after each recovery
        ddp = DistributedDataParallel(model)    # holds the process group: made here
        ckpt = gen.engine
        ckpt.watch_routing(model, top_k=1)      # routed tokens: PLT, Dynamic-K
        report = ckpt.restore()
        start = report.step if report else 0
        if gen.rank == 0 and report is not None:
            print(f"generation {gen.number}: resumed from step {report.step} "
                  f"({report.source}), lost tokens {report.lost_tokens}", flush=True)
        losses = open(args.out / "losses.jsonl", "a") if gen.rank == 0 else None  # noqa: SIM115
        with open(args.out / "pids.jsonl", "a") as f:  # who trains in this generation
            f.write(json.dumps({"generation": gen.number, "rank": gen.rank,
                                "pid": os.getpid()}) + "\n")
        strike = args.fault[gen.number] if gen.number < len(args.fault) else None
        for step in range(start + 1, args.steps + 1):
            if strike is not None and strike[1:] == (gen.rank, step):
                if strike[0] == "machine":  # a simulated machine lost: agent, hosts, memory
                    from moc.injob.machines import lose_machine
                    lose_machine()
                os.kill(os.getpid(), signal.SIGSTOP if strike[0] == "stop" else signal.SIGKILL)
            idx = batch(step, gen.rank)
            loss = nn.functional.cross_entropy(ddp(idx[:-1]), idx[1:])
            loss.backward()
            ckpt.wait_for_snapshot()            # the only place training may wait
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            ckpt.maybe_save(step, final=step == args.steps)
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            if losses is not None:
                value = mean.item() / gen.world_size
                losses.write(json.dumps({"step": step, "hex": value.hex(),
                                         "generation": gen.number, "pid": os.getpid(),
                                         "t": time.time()})
                             + "\n")
                losses.flush()

    moc.run(train, engine=lambda: moc.TwoLevelCheckpointer(
        model, optimizer, args.out / "ckpt", policy=moc.PECPolicy(k=1), interval=5))


def fault(text: str) -> tuple[str, int, int]:
    """`--fault KIND:RANK:STEP`, e.g. kill:1:12, stop:0:9 or machine:1:12 (with `moc run
    --nodes`: the rank's whole simulated machine lost, its memory with it)."""
    kind, rank, step = text.split(":")
    if kind not in ("kill", "stop", "machine"):
        raise argparse.ArgumentTypeError(f"{text}: KIND is kill, stop or machine")
    return kind, int(rank), int(step)


def last_losses(out: Path) -> dict[int, str]:
    """step -> loss (float.hex) as the run kept it (the last line of each step)."""
    lines = (json.loads(x) for x in (out / "losses.jsonl").read_text().splitlines())
    return {e["step"]: e["hex"] for e in lines}


if __name__ == "__main__":
    main()
