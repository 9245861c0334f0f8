"""`moc bench dtensor`: host memory and bytes of a checkpoint on the layout PyTorch-native
MoE training uses (FSDP2 on the dense layers, batched experts as DTensors `Shard(0)`
over the ranks), on W real gloo ranks.

Each rank's growth of resident memory during one save (the peak, sampled every 0.2 ms
by a thread reading /proc/self/statm, over the resident size just before it) is printed
against the rank's local state (its pieces of the parameters and of AdamW's moments):
the save path never gathers a tensor, so the growth is proportional to the rank's own
shards. For the synchronous engine the pieces are written from memory as they are; for
the two-level engine the save is the snapshot into shared memory (a complete copy of the
rank's state, by design: the memory level of the checkpoint), which the training process
maps. The first save of a chain writes every expert; the bytes of the second (PEC K) are
printed beside the formula: non-expert state + K/N of the experts.

    moc bench dtensor [--ranks 2] [--mb 64] [--k 1]
"""

from __future__ import annotations

import gc
import json
import logging
import os
import socket
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from moc.cliparse import OneLineParser

LAYERS, E = 2, 4
PAGE = os.sysconf("SC_PAGE_SIZE")


def resident() -> int:
    """This process's resident memory in bytes (shared pages it maps included)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class Peak:
    """The largest resident size seen while the `with` block runs."""

    def __init__(self, every_s: float = 0.0002) -> None:
        self.every_s, self.peak = every_s, 0
        self._stop = threading.Event()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, resident())
            time.sleep(self.every_s)

    def __enter__(self) -> Peak:
        self.peak = resident()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, resident())


def _model(d: int, mesh: Any) -> nn.Module:
    """Dense layers (FSDP2) and, per layer, batched experts [E, d, 4d] and [E, 4d, d]
    as DTensors Shard(0) over the ranks. No forward: the benchmark needs the state."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    model = nn.Module()
    model.layers = nn.ModuleList()
    for _ in range(LAYERS):
        block = nn.Module()
        block.attn = nn.Linear(d, d)
        block.router = nn.Linear(d, E, bias=False)
        block.experts = nn.Module()
        for name, shape in (("w1", (E, d, 4 * d)), ("w2", (E, 4 * d, d))):
            w = distribute_tensor(torch.randn(shape) * 0.02, mesh, [Shard(0)])
            setattr(block.experts, name, nn.Parameter(w))
        fully_shard(block.attn, mesh=mesh)
        fully_shard(block.router, mesh=mesh)
        model.layers.append(block)
    return model


def _local_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    from moc.checkpoint.shards import local

    total = 0
    for p in model.parameters():
        total += local(p).numel() * p.element_size()
        for v in opt.state[p].values():
            total += local(v).numel() * local(v).element_size()
    return total


def _rank(rank: int, world: int, port: int, root: str, d: int, k: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # no routing is recorded: the state is what counts
    logging.disable(logging.WARNING)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    import moc

    mesh = init_device_mesh("cpu", (world,))
    results: dict[str, Any] = {}
    for engine in (moc.Checkpointer, moc.TwoLevelCheckpointer):
        torch.manual_seed(0)
        model = _model(d, mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for p in model.parameters():  # AdamW's moments exist after a first step
            p.grad = torch.zeros_like(p)
        opt.step()
        directory = Path(root) / engine.__name__
        ckpt = engine(model, opt, directory, policy=moc.PECPolicy(k=k))
        local = _local_bytes(model, opt)
        growth = []
        for step in (1, 2):
            gc.collect()
            dist.barrier()
            with Peak() as peak:
                before = resident()
                ckpt.save(step)
                ckpt.wait_for_snapshot()
            growth.append(peak.peak - before)
            ckpt.flush()
            ckpt.drain_completed()
        # Before close(): the two-level engine's close completes the newest step.
        step2 = _step_bytes(directory, 2) if rank == 0 else None
        ckpt.close()
        results[engine.__name__] = {"local_bytes": local, "growth": growth, "step2": step2}
        del ckpt, model, opt
        gc.collect()
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def _step_bytes(directory: Path, step: int) -> dict[str, int]:
    from moc.checkpoint.store.format import ITEM_SIZES

    manifest = json.loads((directory / f"step-{step:08d}" / "manifest.json").read_text())

    def size(e: dict) -> int:
        n = ITEM_SIZES[e["dtype"]]
        for s in e["shape"]:
            n *= s
        return n
    entries = manifest["entries"]
    return {"written": sum(size(e) for e in entries.values() if e["step"] == step),
            "experts": sum(size(e) for key, e in entries.items() if "/expert=" in key),
            "dense": sum(size(e) for key, e in entries.items() if "/expert=" not in key),
            "files": sum(manifest["files"].values()), "n": manifest["experts"]["n_experts"]}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(ranks: int, mb: float, k: int) -> dict[str, Any]:
    """Every rank's measurements, and the bytes of each engine's second (PEC K) step."""
    # d from the size: the experts (2 tensors of E x d x 4d per layer) are most of it.
    d = max(8, int((mb * 2**20 / (LAYERS * 2 * E * 4 * 4)) ** 0.5))
    ctx = mp.get_context("spawn")
    port = _free_port()
    with tempfile.TemporaryDirectory() as root, tempfile.TemporaryDirectory() as out:
        procs = [ctx.Process(target=_rank, args=(r, ranks, port, root, d, k, out))
                 for r in range(ranks)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join()
        if any(proc.exitcode != 0 for proc in procs):
            raise SystemExit(f"moc bench dtensor: ranks exited {[p.exitcode for p in procs]}")
        per_rank = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(ranks)]
        steps = {name: m["step2"] for name, m in per_rank[0].items()}
    return {"ranks": ranks, "d": d, "k": k, "per_rank": per_rank, "step2": steps}


def report(results: dict[str, Any]) -> str:
    """The table: per engine and rank, growth / local state for the first save (every
    expert) and the second (PEC K); then the second step's bytes against the formula."""
    lines = [f"FSDP2 + DTensor EP on {results['ranks']} gloo ranks, d={results['d']}, "
             f"{LAYERS} layers of {E} experts; K={results['k']}",
             f"{'engine':<22}{'rank':>5}{'local state':>14}{'growth 1st':>13}"
             f"{'ratio':>7}{'growth 2nd':>13}{'ratio':>7}"]
    for name in results["per_rank"][0]:
        for rank, measured in enumerate(results["per_rank"]):
            m = measured[name]
            local, (g1, g2) = m["local_bytes"], m["growth"]
            lines.append(f"{name:<22}{rank:>5}{local / 2**20:>11.1f} MB{g1 / 2**20:>10.1f} MB"
                         f"{g1 / local:>7.2f}{g2 / 2**20:>10.1f} MB{g2 / local:>7.2f}")
    lines.append("bytes of step 2 (PEC K), tensor data: written vs non-expert + K/N experts")
    for name, b in results["step2"].items():
        formula = b["dense"] + b["experts"] * results["k"] / b["n"]
        lines.append(f"{name:<22}{b['written']:>14,d} B vs {formula:>14,.0f} B = "
                     f"{b['written'] / formula:.3f} (files with headers: {b['files']:,d} B)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="moc bench dtensor", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="gloo ranks (default 2)")
    p.add_argument("--mb", type=float, default=64,
                   help="parameters of the whole model in MB, fp32 (default 64)")
    p.add_argument("--k", type=int, default=1, help="PEC K of the second save (default 1)")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    results = run(args.ranks, args.mb, args.k)
    print(report(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0
