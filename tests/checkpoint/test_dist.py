"""The distributed helper: every collective of the engines, on 1 rank and on real ranks."""

from __future__ import annotations

import pytest
import torch

from moc.checkpoint.dist import SHARE_BYTES, Dist, RankError, describe, raise_failures
from moc.checkpoint.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
)
from moc.topology import ParallelGroups
from tests.distributed import run_ranks


def _world() -> Dist:
    return Dist(ParallelGroups.from_world(1, 6))


# -- one process: every collective is a no-op ------------------------------------------


def test_without_a_process_group_every_collective_returns_what_one_rank_sees():
    d = Dist(ParallelGroups.single(4))
    t = {"a": torch.ones(2)}
    counts = torch.arange(4)
    assert d.all_gather("x") == ["x"] and d.broadcast("x") == "x"
    assert d.gather_tensors(t, 0) == [t] and d.gather_tensors(t, 0, edp=True) == [t]
    assert d.exchange({"share": 1}, counts) == {"share": 1}
    assert torch.equal(d.all_reduce_(counts), torch.arange(4))
    d.barrier()
    assert d.agree(None) == []
    d.raise_if_any(None)
    with pytest.raises(CorruptCheckpointError, match=r"^bad byte$"):  # no rank named
        d.raise_if_any(CorruptCheckpointError("bad byte"))


def test_the_most_severe_failure_decides_the_exception_and_every_rank_is_named():
    failures = [RankError(0, "OSError", "disk full"),
                RankError(2, "CorruptCheckpointError", "bad byte"),
                RankError(3, "CorruptCheckpointError", "bad byte")]
    with pytest.raises(CorruptCheckpointError) as info:
        raise_failures(failures, 4)
    assert str(info.value) == "rank 0: disk full; ranks 2, 3: bad byte"
    with pytest.raises(IncompatibleCheckpointError):
        raise_failures([*failures, RankError(1, "IncompatibleCheckpointError", "shape")], 4)
    with pytest.raises(CheckpointError):
        raise_failures(failures[:1], 4)
    raise_failures([], 4)  # nothing failed: nothing raised
    # An error every rank met alike (already agreed) is not prefixed by every rank.
    assert describe([RankError(r, "X", "same") for r in range(4)], 4) == "same"


# -- real ranks ----------------------------------------------------------------------------


def _tensors(rank: int) -> dict[str, torch.Tensor]:
    if rank == 1:
        return {}  # a rank with nothing to send still takes part
    g = torch.Generator().manual_seed(rank)
    return {f"r{rank}/f32": torch.randn(3, 5, generator=g),
            f"r{rank}/bf16": torch.randn(7, generator=g).bfloat16(),
            f"r{rank}/step": torch.tensor(float(rank)),
            f"r{rank}/mask": torch.tensor([True, False, True]),
            f"r{rank}/i64": torch.arange(rank, rank + 3)}


def _gather(rank: int, world: int) -> list[dict[str, torch.Tensor]]:
    got = _world().gather_tensors(_tensors(rank), 2)
    # Views into one receive buffer; clone so the harness can torch.save them.
    return [{k: v.clone() for k, v in d.items()} for d in got]


def test_gather_tensors_delivers_every_rank_bitwise_to_dst_only():
    results = run_ranks(_gather, 3)
    assert results[0] == [] and results[1] == []
    assert len(results[2]) == 3
    for rank, got in enumerate(results[2]):
        want = _tensors(rank)
        assert got.keys() == want.keys()
        for k in want:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


def _collectives(rank: int, world: int) -> dict:
    d = _world()
    counts = torch.full((2, 3), rank + 1, dtype=torch.int64)
    out = {"gather": d.all_gather(rank * 10), "bcast": d.broadcast(f"from {rank}", src=1),
           "sum": d.all_reduce_(counts.clone()).tolist(),
           "small": d.exchange("results" if rank == 0 else None, counts),
           "counts": counts.tolist(),
           "large": d.exchange("x" * (2 * SHARE_BYTES) if rank == 0 else None)}
    # Rank 1 fails, rank 0 does not: both must raise the same exception.
    try:
        d.raise_if_any(CorruptCheckpointError("flipped bit") if rank == 1 else None)
        out["raised"] = None
    except CheckpointError as e:
        out["raised"] = (type(e).__name__, str(e))
    out["agree"] = d.agree(OSError(5, "I/O") if rank == 0 else None)
    return out


def test_every_rank_sees_the_same_results_and_the_same_failure():
    results = run_ranks(_collectives, 2)
    for r in results:
        assert r["gather"] == [0, 10] and r["bcast"] == "from 1"
        assert r["sum"] == [[3] * 3] * 2
        # Rank 0's object reaches every rank and the counts are summed, in one
        # all-reduce, also when the object is too large for it (a second collective).
        assert r["small"] == "results" and r["counts"] == [[3] * 3] * 2
        assert r["large"] == "x" * (2 * SHARE_BYTES)
        assert r["raised"] == ("CorruptCheckpointError", "rank 1: flipped bit")
        assert r["agree"] == [RankError(0, "OSError", "[Errno 5] I/O")]


def _engine_objects(rank: int, world: int, marker: str) -> dict:
    from tests.checkpoint.test_codec import ENGINE_OBJECTS

    d = _world()
    out = {"gather": d.all_gather(ENGINE_OBJECTS[rank::2]),
           "bcast": d.broadcast(ENGINE_OBJECTS if rank == 1 else None, src=1),
           "exchange": d.exchange(ENGINE_OBJECTS if rank == 0 else None)}
    # A peer that speaks pickle (all_gather_object's encoding) into the same collective:
    # refused as a CheckpointError on the receiving rank, and never run.
    import pickle

    import torch.distributed as dist

    from tests.checkpoint.test_codec import _Marker
    if rank == 1:
        data = torch.frombuffer(bytearray(pickle.dumps(_Marker(marker))), dtype=torch.uint8)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(sizes, torch.tensor([data.numel()]), group=d._group)
        padded = torch.zeros(int(max(sizes)), dtype=torch.uint8)
        padded[:data.numel()] = data
        dist.all_gather([torch.empty_like(padded) for _ in range(world)], padded,
                        group=d._group)
    else:
        try:
            d.all_gather(None)
        except CheckpointError as e:
            out["pickle"] = str(e)
    return out


def test_every_engine_object_crosses_real_ranks_exactly_and_a_pickle_never_runs(tmp_path):
    from tests.checkpoint.test_codec import ENGINE_OBJECTS, _types

    marker = tmp_path / "pwned"
    results = run_ranks(_engine_objects, 2, str(marker))
    for r in results:
        want = [ENGINE_OBJECTS[0::2], ENGINE_OBJECTS[1::2]]
        for got in (r["gather"], [r["bcast"]], [r["exchange"]]):
            expected = want if got is r["gather"] else [ENGINE_OBJECTS]
            assert got == expected and _types(got) == _types(expected)
    assert "not a moc message" in results[0]["pickle"]
    assert not marker.exists()
