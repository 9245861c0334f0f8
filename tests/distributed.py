"""Run a function on W real processes joined by a gloo process group."""

from __future__ import annotations

import os
import socket
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moc.model import ModelConfig, Transformer
from moc.parallel import ParallelGroups, ShardedAdamW, shard_experts

TINY = ModelConfig(seq_len=8, d_model=16, n_layers=2, n_heads=2, d_ffn=32, n_experts=4)
"""A model small enough for many ranks on two cores, with real experts to shard."""


def build_sharded(ep: int, cfg: ModelConfig = TINY
                  ) -> tuple[ParallelGroups, Transformer, ShardedAdamW]:
    """Inside a rank: the same seeded model on every rank, this rank's experts kept,
    sharded AdamW. Collective (creates the process groups)."""
    groups = ParallelGroups.from_world(ep, cfg.n_experts)
    torch.manual_seed(0)
    model = Transformer(cfg)
    shard_experts(model, groups)
    return groups, model, ShardedAdamW(model, groups, lr=1e-2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn: Callable, rank: int, world: int, port: int, out: str, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    status = 1
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = fn(rank, world, *args)
        torch.save(result, Path(out) / f"rank{rank}.pt")
        status = 0
    except BaseException:
        (Path(out) / f"rank{rank}.err").write_text(traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # What the rank did is in its files. Not the interpreter's teardown after it: torch's
    # C++ threads freed there once aborted a rank whose work was done and whose groups
    # were destroyed ("terminate called without an active exception", exit -6, a CI run
    # of 2026-12-05), a failure of the harness, not of the function under test.
    os._exit(status)


PRELOAD = ["torch", "torch.distributed", "moc", "moc.checkpoint.twolevel.checkpointer",
           "tests.distributed"]
"""What every rank process finds imported: they are forked from a server that imported
these once per test session. A spawned rank paid torch's import (3.2 s of CPU on the
project's VM) every time, the largest part of many integration tests."""


def rank_process(target: Callable, *args: Any) -> mp.Process:
    """A process running target(*args) in this process's environment and working
    directory at the call (a forkserver's children inherit the server's, fixed when the
    server started: a test's `monkeypatch.setenv` must still reach its ranks), forked
    from a server with `PRELOAD` imported. Not started."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx.Process(target=_as_caller, args=(dict(os.environ), os.getcwd(), target, args))


def ranks_parent() -> int:
    """The pid every rank process has as its parent (the forkserver's): a test that plants
    a job directory's owner as 'the ranks' launcher, alive' names this pid."""
    with tempfile.TemporaryDirectory() as out:
        p = rank_process(_write_parent, str(Path(out) / "ppid"))
        p.start()
        p.join(60)
        return int((Path(out) / "ppid").read_text())


def _write_parent(path: str) -> None:
    Path(path).write_text(str(os.getppid()))


def _as_caller(env: dict[str, str], cwd: str, target: Callable, args: tuple) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    target(*args)


def run_ranks(fn: Callable, world: int, *args: Any, timeout: float = 180) -> list[Any]:
    """Start `world` processes running fn(rank, world, *args); return their results."""
    port = free_port()
    with tempfile.TemporaryDirectory() as out:
        procs = [rank_process(_entry, fn, r, world, port, out, args) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        for p in procs:
            if p.is_alive():  # hung: its exit code says so (-9)
                p.kill()
                p.join()
        errors = [(Path(out) / f"rank{r}.err") for r in range(world)]
        msgs = [e.read_text() for e in errors if e.exists()]
        if msgs or any(p.exitcode != 0 for p in procs):
            raise AssertionError(f"ranks failed (exit codes {[p.exitcode for p in procs]}):\n"
                                 + "\n".join(msgs))
        return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(world)]
