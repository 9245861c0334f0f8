from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moc.checkpoint.policy.selection import PECPolicy, SelectionContext, select_experts, sequential


def _ctx(c: int, n: int = 8, layers: int = 4, k: int = 1, **kw) -> SelectionContext:
    return SelectionContext(c, n, layers, k, **kw)


def test_sequential_k1_matches_the_paper_rule():
    # 4 MoE layers, N = 3: checkpoint c saves (0,1,2,0) shifted by c.
    assert sequential(_ctx(0, n=3)) == [[0], [1], [2], [0]]
    assert sequential(_ctx(1, n=3)) == [[1], [2], [0], [1]]


@pytest.mark.parametrize(("n", "k"), [(8, 1), (8, 2), (8, 4), (16, 4), (6, 3)])
@pytest.mark.parametrize("start", [0, 5])
def test_sequential_saves_every_expert_once_per_cycle(n, k, start):
    layers = 4
    counts = [[0] * n for _ in range(layers)]
    for c in range(start, start + n // k):
        for m, chosen in enumerate(select_experts("sequential", _ctx(c, n, layers, k))):
            assert len(chosen) == k
            for e in chosen:
                counts[m][e] += 1
    assert counts == [[1] * n for _ in range(layers)]


def test_sequential_spreads_the_chosen_experts_over_ep_ranks():
    # N = 8 over ep = 4 ranks (2 experts each); K = 4 must touch every rank once.
    for c in range(4):
        for chosen in sequential(_ctx(c, n=8, k=4, ep=4)):
            assert sorted(e // 2 for e in chosen) == [0, 1, 2, 3]
    # K = 1, N = 16 over ep = 2: the layers of one checkpoint alternate between ranks.
    for c in range(16):
        ranks = [chosen[0] // 8 for chosen in sequential(_ctx(c, n=16, layers=4, ep=2))]
        assert sorted(ranks) == [0, 0, 1, 1]


@pytest.mark.parametrize("ep", [1, 2, 4, 8])
def test_sequential_with_ep_still_saves_every_expert_once_per_cycle(ep):
    counts = [[0] * 8 for _ in range(3)]
    for c in range(8):
        for m, chosen in enumerate(sequential(_ctx(c, n=8, layers=3, ep=ep))):
            counts[m][chosen[0]] += 1
    assert counts == [[1] * 8] * 3


@given(st.integers(1, 16), st.integers(1, 16), st.integers(0, 100))
def test_sequential_when_k_does_not_divide_n_still_covers_all(n, k, c0):
    k = min(k, n)
    cycle = -(-n // k)  # ceil
    seen = set()
    for c in range(c0, c0 + cycle):
        for chosen in sequential(_ctx(c, n, 1, k)):
            assert len(set(chosen)) == k
            seen.update(chosen)
    assert seen == set(range(n))


def test_load_aware_picks_most_unsaved_tokens_then_stalest():
    tokens = ((5, 9, 9, 1), (0, 0, 0, 0))
    stale = ((0, 1, 3, 0), (2, 7, 1, 7))
    got = select_experts("load-aware", _ctx(0, n=4, layers=2, k=2, unsaved_tokens=tokens,
                                              staleness=stale))
    assert got == [[1, 2], [1, 3]]


def test_load_aware_without_counts_is_a_clear_error():
    with pytest.raises(ValueError, match="record_routing"):
        select_experts("load-aware", _ctx(0))


def test_full_and_k_at_least_n_save_everything():
    assert select_experts("full", _ctx(3, n=4, layers=1)) == [[0, 1, 2, 3]]
    assert select_experts("sequential", _ctx(3, n=4, layers=1, k=9)) == [[0, 1, 2, 3]]


@pytest.mark.parametrize(("kw", "match"), [
    ({"selection": "random"}, "selection"), ({"apply_to": "all"}, "apply_to"),
    ({"k": 0}, "k must be"), ({"plt_threshold": 1.5}, "plt_threshold"),
])
def test_policy_validation_names_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        PECPolicy(**kw)
