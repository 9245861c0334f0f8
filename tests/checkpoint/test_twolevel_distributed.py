"""Two-level recovery on real ranks: one rank's snapshot is gone, the other's is not."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import torch

from moc.checkpoint.selection import PECPolicy
from moc.checkpoint.snapshot import default_job_id, job_dir
from moc.checkpoint.twolevel import TwoLevelCheckpointer
from moc.parallel import clip_grad_norm_, sync_gradients
from tests.distributed import build_sharded, run_ranks


@pytest.fixture(autouse=True)
def shm(tmp_path, monkeypatch):
    monkeypatch.setenv("MOC_SHM_ROOT", str(tmp_path / "shm"))  # inherited by the ranks


def _train(rank: int, world: int, root: str) -> dict[str, torch.Tensor]:
    groups, model, opt = build_sharded(1)  # every expert replicated
    ckpt = TwoLevelCheckpointer(model, opt, root, groups=groups, policy=PECPolicy(k=1),
                                interval=1, persist_policy="wait")
    for step in range(1, 5):
        idx = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(10 * step
                                                                                     + rank))
        out = model(idx, idx)
        out.loss.backward()
        sync_gradients(model, groups)
        clip_grad_norm_(model, groups, 1.0)
        ckpt.wait_for_snapshot()
        opt.step()
        model.zero_grad()
        ckpt.record_routing(out.tokens_per_expert)
        ckpt.maybe_save(step, {"step": step})
    ckpt.close(keep_snapshots=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _restore(rank: int, world: int, root: str) -> dict:
    groups, model, opt = build_sharded(1)  # every expert replicated
    ckpt = TwoLevelCheckpointer(model, opt, root, groups=groups, policy=PECPolicy(k=1))
    report = ckpt.restore()
    ckpt.close()
    return {"step": report.step, "source": report.source, "lost": report.lost_tokens,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def test_a_rank_without_its_snapshot_restores_from_storage_and_replicas_agree(tmp_path):
    root = str(tmp_path / "ckpt")
    saved = run_ranks(_train, 2, root)
    shutil.rmtree(job_dir(default_job_id(root)) / "rank-00001")  # rank 1 lost its memory
    results = run_ranks(_restore, 2, root)
    for res in results:
        assert (res["step"], res["source"]) == (4, "mixed")
        assert res["lost"] == 0  # every expert's weights came back from rank 0's memory
        for name, p in res["params"].items():
            assert torch.equal(p, saved[0][name]), name


def _save_while_the_peer_is_late(rank: int, world: int, root: str) -> dict:
    groups, model, opt = build_sharded(1)
    ckpt = TwoLevelCheckpointer(model, opt, root, groups=groups, policy=PECPolicy(k=1),
                                interval=1)
    out = model(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))
    out.loss.backward()
    opt.step()
    ckpt.record_routing(out.tokens_per_expert)
    marker = Path(root) / "rank-0-save-returned"
    seen = None
    if rank == 0:
        ckpt.save(1, {"step": 1})  # its collective waits for rank 1; save() must not
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    else:
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        seen = marker.exists()
        ckpt.save(1, {"step": 1})
    ckpt.wait_for_snapshot()
    ckpt.flush()
    records = ckpt.drain_completed()
    ckpt.close()
    return {"seen": seen, "records": [(r.step, r.error, r.persist_skipped) for r in records]}


def test_save_returns_before_its_collective_so_a_late_peer_does_not_stall_it(tmp_path):
    """save() hands the collective (persist results, token counts) to the snapshot
    thread: rank 0's save returns while rank 1 has not even called save yet, and the
    checkpoint still completes on both."""
    results = run_ranks(_save_while_the_peer_is_late, 2, str(tmp_path / "ckpt"))
    assert results[1]["seen"] is True
    for res in results:
        assert res["records"] == [(1, None, False)]


def _exchange_on(rank: int, world: int) -> list:
    from moc.checkpoint.twolevel import SHARE_BYTES, _exchange
    from moc.parallel import ParallelGroups

    groups = ParallelGroups.from_world(1, 4)
    out = []
    for share in ([("done", 5, True, None, 0.1, [1, 2])], "x" * (2 * SHARE_BYTES)):
        counts = torch.full((2, 4), rank + 1, dtype=torch.int64)
        mine = share if rank == 0 else None  # only rank 0's share counts
        out.append((_exchange(mine, counts, groups), counts.tolist()))
    return out


def test_persist_results_and_token_counts_travel_in_one_exchange():
    """Rank 0's results reach every rank and the counts are summed, also when the
    results are too large for the all-reduce and take the fallback broadcast."""
    from moc.checkpoint.twolevel import SHARE_BYTES

    for got in run_ranks(_exchange_on, 2):
        (small, counts_a), (large, counts_b) = got
        assert small == [("done", 5, True, None, 0.1, [1, 2])]
        assert large == "x" * (2 * SHARE_BYTES)
        assert counts_a == counts_b == [[3] * 4] * 2
