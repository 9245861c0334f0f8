"""An MoE laid out as PyTorch-native training lays it out (torchtitan): FSDP2 on the dense
layers, batched experts as DTensors sharded over an expert-parallel mesh, checkpointed
with moc's two-level engine; a rank is SIGKILLed, torchrun restarts the job, and training
resumes exactly where it was.

    # an uninterrupted run:
    torchrun --standalone --nproc-per-node 2 examples/train_fsdp2_ep.py --out runs/fsdp2-straight
    # rank 1 SIGKILLs itself at step 13; torchrun restarts both ranks, which recover
    # from their snapshots in shared memory (the checkpoint of step 10):
    torchrun --standalone --nproc-per-node 2 --max-restarts 1 examples/train_fsdp2_ep.py \\
        --out runs/fsdp2-fault --fault-at 13
    # every step's loss is bitwise equal to the uninterrupted run's:
    python examples/train_fsdp2_ep.py --compare runs/fsdp2-straight runs/fsdp2-fault

On two nodes (here two torchrun agents on one machine, each with its own node memory,
MOC_SHM_ROOT), every snapshot is also copied to the other node (peer replicas), and a
lost node (`--lose-memory`: its memory goes with its rank) comes back from its peer:

    for n in 0 1; do MOC_SHM_ROOT=/dev/shm/node$n torchrun --nnodes 2 --nproc-per-node 1 \
        --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29500 --rdzv-id fsdp2 --max-restarts 1 \
        examples/train_fsdp2_ep.py --out runs/fsdp2-node --fault-at 13 --lose-memory & done

Each rank writes its own pieces of the FSDP2 parameters and its experts, by global id;
the checkpoint restores on any number of ranks, or into one plain process
(`moc export runs/fsdp2-fault/ckpt out/` assembles the whole model from the files).

The experts' forward gathers every expert's weights (an all-gather whose backward sums
and averages the gradients, as FSDP does), where real expert parallelism would send
tokens to the experts with an all-to-all: the checkpointed layout is the same.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

import moc

VOCAB, D, F, E, LAYERS = 64, 16, 32, 4, 2


class Gather(torch.autograd.Function):
    """Every rank's rows of an expert tensor, in rank order; the gradient of the rows a
    rank holds is the mean over the ranks of theirs."""

    @staticmethod
    def forward(ctx, local: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, local.contiguous())
        ctx.rows = local.shape[0]
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        grad = grad.contiguous()
        dist.all_reduce(grad)
        start = dist.get_rank() * ctx.rows
        return grad[start:start + ctx.rows] / dist.get_world_size()


class Experts(nn.Module):
    """E experts' weights stacked: w1 [E, D, F], w2 [E, F, D] (DTensors sharded on dim 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(E, D, F) * D ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E, F, D) * F ** -0.5)

    def forward(self, h: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
        w1, w2 = (Gather.apply(w.to_local()) for w in (self.w1, self.w2))
        y = torch.einsum("td,tdf->tf", h, w1[top]).relu()
        return torch.einsum("tf,tfd->td", y, w2[top])


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(D, D)
        self.router = nn.Linear(D, E, bias=False)
        self.experts = Experts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.mix(x).tanh()
        gate, top = self.router(h).softmax(-1).max(-1)
        return h + gate[:, None] * self.experts(h, top)


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build(seed: int) -> MoE:
    """The same seeded model on every rank, then laid out: experts Shard(0) over the
    expert-parallel mesh (each rank holds E / world of them), FSDP2 on the rest."""
    torch.manual_seed(seed)
    model = MoE()
    mesh = init_device_mesh("cpu" if not torch.cuda.is_available() else "cuda",
                            (dist.get_world_size(),))
    for block in model.layers:
        for name in ("w1", "w2"):
            w = getattr(block.experts, name)
            setattr(block.experts, name, nn.Parameter(distribute_tensor(w.data, mesh, [Shard(0)])))
        fully_shard(block.mix, mesh=mesh)
        fully_shard(block.router, mesh=mesh)
    fully_shard(model.embed, mesh=mesh)
    fully_shard(model.head, mesh=mesh)
    return model


def batch(seed: int, step: int, rank: int, tokens: int = 32) -> torch.Tensor:
    """Token ids for this step and rank, the same on every run: an arithmetic sequence
    with a random start and stride, something a model can learn."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + rank)
    start, stride = torch.randint(VOCAB, (1,), generator=g), torch.randint(1, 5, (1,), generator=g)
    return (start + stride * torch.arange(tokens)) % VOCAB


def top1(module: nn.Module, inputs: tuple, logits: torch.Tensor) -> torch.Tensor:
    """The expert each token went to, from its router's logits (for `watch_routing`)."""
    return logits.argmax(-1, keepdim=True)


def train(args: argparse.Namespace) -> None:
    if not moc.init_distributed():  # gloo on the CPU, nccl on CUDA; survives restarts
        sys.exit("train_fsdp2_ep.py: run it under torchrun (see the commands at its top)")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ckpt = moc.TwoLevelCheckpointer(
        model, optimizer, args.out / "ckpt",
        policy=moc.PECPolicy(k=1),              # storage: 1 of 4 experts per layer ...
        interval=args.interval, keep_last=2)    # ... the memory snapshot: all of them
    report = ckpt.restore()                     # None on a fresh start
    start = report.step if report else 0
    restart = attempt()
    if report and rank == 0:
        print(f"restart {restart}: resumed from step {report.step} ({report.source}), "
              f"lost tokens {report.lost_tokens}", flush=True)
    ckpt.watch_routing(model, routers={i: b.router for i, b in enumerate(model.layers)},
                       indices=top1)            # counts routed tokens: PLT, Dynamic-K
    losses = open(args.out / "losses.jsonl", "a") if rank == 0 else None  # noqa: SIM115
    for step in range(start + 1, args.steps + 1):
        if step == args.fault_at and restart == 0:
            if args.lose_memory:
                # Between checkpoints, as in a real run whose interval outlasts a persist
                # and a replica round: both finished first (collective).
                ckpt.flush()
                ckpt.wait_for_replicas()
                if rank == 1:     # the node is lost: its memory goes with it
                    lose_node_memory()
            if rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)  # a crash, as real as they come
        idx = batch(args.seed, step, rank)
        loss = nn.functional.cross_entropy(model(idx[:-1]), idx[1:])
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


def attempt() -> int:
    """The job's attempt, the same on every rank: the largest of the agents' restart
    counts (torchrun's TORCHELASTIC_RESTART_COUNT). On several nodes they differ: the
    agent whose workers failed counts a restart, the others restart theirs for the new
    membership without counting it. Collective."""
    count = torch.tensor([int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))])
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count)


def lose_node_memory() -> None:
    """Empty this node's memory root (MOC_SHM_ROOT): its snapshots, and the replicas it
    held of the other node's, are gone, as a lost machine's would be."""
    root = os.environ.get("MOC_SHM_ROOT")
    if not root:
        sys.exit("train_fsdp2_ep.py: --lose-memory needs MOC_SHM_ROOT (this node's memory)")
    for entry in Path(root).iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


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
    p.add_argument("--out", type=Path, default=Path("runs/fsdp2-ep"),
                   help="output directory: ckpt/ and losses.jsonl (default runs/fsdp2-ep)")
    p.add_argument("--steps", type=int, default=20, help="steps to train (default 20)")
    p.add_argument("--interval", type=int, default=5,
                   help="steps between checkpoints (default 5)")
    p.add_argument("--fault-at", type=int, help="rank 1 SIGKILLs itself at this step "
                                               "(first attempt only)")
    p.add_argument("--lose-memory", action="store_true",
                   help="with --fault-at: rank 1's node loses its memory (MOC_SHM_ROOT) too")
    p.add_argument("--seed", type=int, default=0, help="weights and data (default 0)")
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
