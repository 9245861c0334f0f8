"""Attacks on two-level checkpointing across nodes: 2 real ranks, each its own simulated
node (LOCAL_WORLD_SIZE=1 and a memory root of its own, as `moc train --nodes 2` gives
each node). A corrupt peer replica of a lost node's rank is refused, said so, and sends
only that rank to storage; node 1's persist process killed in the middle of its part,
or while rank 0 waits for the commit, fails that step only, and never stalls the job
for the persist timeout (docs/DECISIONS.md, "Issue 14: attacks")."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from moc.checkpoint.policy.selection import PECPolicy
from moc.checkpoint.store.manifest import Manifest
from moc.checkpoint.store.steps import complete_steps
from moc.checkpoint.twolevel.checkpointer import TwoLevelCheckpointer
from moc.checkpoint.twolevel.memory.jobdir import default_job_id
from moc.parallel import clip_grad_norm_, sync_gradients
from tests.distributed import build_sharded, run_ranks

# Real 2-node runs (about 20 s each): the slow tier, beside the crash sweep.
pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 4


def _as_node(rank: int, base: str) -> None:
    """This rank is node `rank` of 2: its own memory root, one rank per node."""
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    os.environ["MOC_SHM_ROOT"] = str(Path(base) / f"node-{rank}")


def _steps(model, opt, groups, ckpt: TwoLevelCheckpointer, *,
           seed: Callable[[int], int] = lambda step: step, clip: bool = False,
           after: Callable[[int], None] = lambda step: None) -> list:
    """STEPS steps of the contract's loop, a checkpoint at each `interval`; `after(step)`
    right after each save (where an attack strikes). The results drained meanwhile."""
    results = []
    for step in range(1, STEPS + 1):
        idx = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(seed(step)))
        out = model(idx, idx)
        out.loss.backward()
        sync_gradients(model, groups)
        if clip:
            clip_grad_norm_(model, groups, 1.0)
        ckpt.wait_for_snapshot()
        opt.step()
        model.zero_grad()
        ckpt.record_routing(out.tokens_per_expert)
        ckpt.maybe_save(step, {"step": step})
        after(step)
        results += ckpt.drain_completed()
    return results


def _train(rank: int, world: int, root: str, base: str) -> dict[str, torch.Tensor]:
    """Train STEPS steps, a checkpoint each (persisted with K = 1), then crash: the
    processes end without `close`, their snapshots and replicas stay in memory."""
    _as_node(rank, base)
    groups, model, opt = build_sharded(2)  # each expert on one rank only
    ckpt = TwoLevelCheckpointer(model, opt, root, groups=groups, policy=PECPolicy(k=1),
                                interval=1, persist_policy="wait")
    _steps(model, opt, groups, ckpt, seed=lambda step: 10 * step + rank, clip=True)
    ckpt.flush()  # the persist of step STEPS and the replicas of its snapshot are done
    ckpt.persist.stop()  # what a crash leaves: no close, memory kept
    return {n: p.detach().clone() for n, p in model.named_parameters()}


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _restore(rank: int, world: int, root: str, base: str) -> dict:
    _as_node(rank, base)
    warnings = _Warnings()
    logging.getLogger("moc").addHandler(warnings)
    groups, model, opt = build_sharded(2)
    ckpt = TwoLevelCheckpointer(model, opt, root, groups=groups, policy=PECPolicy(k=1))
    report = ckpt.restore()
    ckpt.close()
    return {"step": report.step, "source": report.source, "sources": report.sources,
            "lost": report.lost_tokens, "warnings": warnings.lines,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _flip_newest_replica(base: Path, root: str, src: int) -> Path:
    """Flip one byte of the newest replica of rank `src` that node 0 keeps."""
    rdir = base / "node-0" / f"moc-{default_job_id(root)}" / f"replica-{src:05d}"
    slots = sorted(rdir.glob("slot-*.json"), key=lambda p: p.stat().st_mtime)
    assert slots, f"no replica of rank {src} in {rdir}"
    data = slots[-1].with_suffix(".bin")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(raw)
    return data


def test_a_corrupt_peer_replica_is_refused_and_only_its_rank_goes_to_storage(tmp_path):
    root, base = str(tmp_path / "ckpt"), tmp_path / "mem"
    base.mkdir(mode=0o700)
    saved = run_ranks(_train, 2, root, str(base))
    shutil.rmtree(base / "node-1")  # node 1 lost: its memory with it
    (base / "node-1").mkdir(mode=0o700)  # a replaced machine: empty memory
    bad = _flip_newest_replica(base, root, src=1)
    results = run_ranks(_restore, 2, root, str(base))
    for res in results:
        # Rank 0's own snapshot of step 4 is good: it is used; rank 1's only copy in
        # memory is bad, so rank 1 alone comes from storage (step 4, K_persist = 1).
        assert (res["step"], res["source"]) == (STEPS, "mixed")
        assert res["sources"] == {"memory": [0], "storage": [1]}
        assert res["lost"] > 0  # rank 1's experts not persisted at step 4 are older
    assert all(torch.equal(saved[0][n], p) for n, p in results[0]["params"].items())
    # The holder says which copy it refused and why; rank 1 says where it went instead.
    said = "\n".join(results[0]["warnings"] + results[1]["warnings"])
    assert str(bad.with_suffix("")) in said and "checksum mismatch" in said, said
    assert "storage" in said, said


def _kill_node_1s_persist(rank: int, world: int, root: str, base: str) -> dict:
    """Node 1's persist process is slow (MOC_PERSIST_STALL_S) and SIGKILLed in the middle
    of its part of step 2, while node 0's waits for that part to commit."""
    _as_node(rank, base)
    if rank == 1:
        os.environ["MOC_PERSIST_STALL_S"] = "2"
    groups, model, opt = build_sharded(2)
    ckpt = TwoLevelCheckpointer(model, opt, root, groups=groups, policy=PECPolicy(k=1),
                                interval=1, persist_policy="wait")

    def after(step: int) -> None:
        if step == 2 and rank == 1:
            ckpt.wait_for_snapshot()  # its Ready is sent: the process is in its stall
            time.sleep(0.5)
            os.kill(ckpt.persist.process.pid, signal.SIGKILL)
            ckpt.persist.process.wait()  # gone before the next plan checks it

    results = _steps(model, opt, groups, ckpt, after=after)
    ckpt.close()
    results += ckpt.drain_completed()
    return {"errors": {r.step: r.error for r in results}, "generation": ckpt.persist.generation}


def test_node_1s_persist_killed_mid_part_fails_that_step_only(tmp_path):
    root, base = str(tmp_path / "ckpt"), tmp_path / "mem"
    base.mkdir(mode=0o700)
    rank0, rank1 = run_ranks(_kill_node_1s_persist, 2, root, str(base))
    # Node 0's process stopped waiting for the part that never came (node 1's leader
    # reported it lost); the step failed, and the next ones committed across both nodes.
    assert rank0["errors"][2] is not None and "persist" in rank0["errors"][2]
    assert all(rank0["errors"][s] is None for s in (1, 3, 4)), rank0["errors"]
    assert rank1["generation"] == 1 and rank0["generation"] == 0
    steps = complete_steps(Path(root))
    assert 2 not in steps and {1, 3, 4} <= set(steps)
    manifest = Manifest.load(Path(root), steps[-1])
    assert sorted(manifest.files) == ["rank-00000.safetensors", "rank-00001.safetensors"]


def _kill_node_1s_persist_before_node_0_begins(rank: int, world: int, root: str,
                                                base: str) -> dict:
    """Node 0's persist process is slow to begin step 2 (MOC_PERSIST_STALL_S: a slow
    disk), and node 1's is SIGKILLed while it waits for that begin, a second after the
    step's snapshot: by then node 1's leader has passed its check of the process at the
    plan of step 4 and waits in that plan's collective, for rank 0, which waits for node
    0's process (persist_policy "wait"), which waits for node 1's part."""
    _as_node(rank, base)
    if rank == 0:
        os.environ["MOC_PERSIST_STALL_S"] = "3"
    groups, model, opt = build_sharded(2)
    ckpt = TwoLevelCheckpointer(model, opt, root, groups=groups, policy=PECPolicy(k=1),
                                interval=2, persist_policy="wait")

    def after(step: int) -> None:
        if step == 2 and rank == 1:
            threading.Timer(1.0, os.kill, (ckpt.persist.process.pid, signal.SIGKILL)).start()

    results = _steps(model, opt, groups, ckpt, after=after)
    ckpt.close()
    results += ckpt.drain_completed()
    return {"errors": {r.step: r.error for r in results}}


def test_node_1s_persist_dying_while_rank_0_waits_for_the_commit_ends_the_wait(tmp_path):
    root, base = str(tmp_path / "ckpt"), tmp_path / "mem"
    base.mkdir(mode=0o700)
    # Without the lost part reaching node 0, its process waits PERSIST_TIMEOUT_S (600 s)
    # and rank 0 with it (persist_policy "wait"): the ranks are then killed after 60 s.
    rank0, _ = run_ranks(_kill_node_1s_persist_before_node_0_begins, 2, root, str(base),
                         timeout=60)
    assert rank0["errors"][2] is not None and "persist" in rank0["errors"][2]
    assert rank0["errors"][4] is None, rank0["errors"]
    assert 4 in complete_steps(Path(root)) and 2 not in complete_steps(Path(root))
