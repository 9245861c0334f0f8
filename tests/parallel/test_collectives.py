from __future__ import annotations

import torch

from moc.parallel.collectives import gather_tensors
from tests.distributed import run_ranks


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
    got = gather_tensors(_tensors(rank), 2, torch.distributed.group.WORLD)
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


def test_without_a_group_nothing_moves():
    t = {"a": torch.ones(2)}
    assert gather_tensors(t, 0, None) == [t]
