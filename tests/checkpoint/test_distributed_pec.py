"""PEC on real ranks: every rank agrees on the selection and writes its share."""

from __future__ import annotations

import pytest
import torch

from moc.baselines.blocking import MegatronPlacement
from moc.checkpoint.policy.selection import PECPolicy
from moc.checkpoint.store.manifest import Manifest
from moc.checkpoint.sync import Checkpointer
from tests.distributed import build_sharded, run_ranks
from tests.engines import save_now

pytestmark = pytest.mark.integration  # real processes: see README, Tests


def _save_load_aware(rank: int, world: int, root: str, sharded: bool) -> dict:
    groups, model, opt = build_sharded(2)
    ckpt = Checkpointer(model, opt, root, groups=groups, interval=1,
                        placement=None if sharded else MegatronPlacement(),
                        policy=PECPolicy(k=1, selection="load-aware"))
    ckpt.save(0)
    # Ranks see different local routing; only the sum over ranks may decide.
    local = torch.zeros(2, 4, dtype=torch.int64)
    local[0, rank] = 10 + rank     # layer 0: ranks 0..3 vote for experts 0..3
    local[1, 3 - rank] = 5         # layer 1: a tie broken by staleness, then id
    ckpt.record_routing(local)
    stats = save_now(ckpt, 1)
    return {"selected": stats.experts_saved, "bytes": stats.bytes_per_rank}


@pytest.mark.parametrize("sharded", [True, False])
def test_load_aware_selection_is_identical_on_every_rank(tmp_path, sharded):
    results = run_ranks(_save_load_aware, 4, str(tmp_path), sharded)
    # Global layer-0 counts: expert e got 10 + e tokens -> expert 3 wins.
    assert all(r["selected"] == [[3], [0]] for r in results)
    manifest = Manifest.load(tmp_path, 1)
    assert manifest.experts_saved == {"0": [3], "1": [0]}
    b = results[0]["bytes"]
    if sharded:  # every rank writes a share
        assert all(n > 0 for n in b)
    else:  # baseline: rank 0 (dense) and EP group 0 (ranks 0, 1) write; 2, 3 do not
        assert b[0] > 0 and b[1] > 0 and b[2] == 0 and b[3] == 0
    fresh = [k for k, e in manifest.entries.items() if e.step == 1 and "/expert=" in k]
    assert {k.split("/expert=")[1].split("/")[0] for k in fresh
            if "layers.0." in k} == {"3"}


def _one_rank_fails(rank: int, world: int, root: str) -> list[object]:
    import moc.checkpoint.store.format as tensor_files

    groups, model, opt = build_sharded(2)
    ckpt = Checkpointer(model, opt, root, groups=groups, interval=1, policy=PECPolicy(k=1))
    results: list[object] = [save_now(ckpt, 1).ok]
    real_write = tensor_files.write_safetensors
    if rank == 1:
        def failing(path, tensors):
            raise OSError(5, "Input/output error")
        tensor_files.write_safetensors = failing
    failed = save_now(ckpt, 2)
    tensor_files.write_safetensors = real_write
    results += [failed.ok, failed.error, save_now(ckpt, 3).ok]
    return results


def test_a_failed_write_on_one_rank_fails_the_step_on_every_rank_without_hanging(tmp_path):
    from moc.checkpoint.store.steps import complete_steps

    results = run_ranks(_one_rank_fails, 2, str(tmp_path), timeout=120)
    for ok1, ok2, error, ok3 in results:
        assert ok1 and not ok2 and ok3
        assert "rank 1 could not write" in error and "Input/output error" in error
    assert complete_steps(tmp_path) == [1, 3]
    assert Manifest.load(tmp_path, 3).policy["index"] == 1
