from __future__ import annotations

import pytest

from moc.parallel import ParallelLayout


def test_layout_places_ep_groups_contiguously_and_replicas_strided():
    layout = ParallelLayout(world_size=4, ep=2, n_experts=8)
    assert layout.ep_groups() == [[0, 1], [2, 3]]
    assert layout.edp_groups() == [[0, 2], [1, 3]]
    assert list(layout.local_experts(3)) == [4, 5, 6, 7]
    assert layout.expert_replicas(1) == [0, 2]
    assert layout.edp == 2


def test_every_expert_is_held_by_exactly_edp_ranks():
    layout = ParallelLayout(world_size=8, ep=4, n_experts=16)
    for e in range(16):
        holders = [r for r in range(8) if e in layout.local_experts(r)]
        assert holders == layout.expert_replicas(e)
        assert len(holders) == layout.edp


@pytest.mark.parametrize(("world", "ep", "experts", "match"), [
    (4, 3, 6, "must divide the number of ranks"),
    (4, 4, 6, "must divide the expert count"),
    (2, 0, 4, "must divide the number of ranks"),
])
def test_invalid_ep_is_explained(world, ep, experts, match):
    with pytest.raises(ValueError, match=match):
        ParallelLayout(world, ep, experts)
