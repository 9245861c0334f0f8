from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moc.checkpoint.plan.writes import (
    DENSE,
    EXPERT,
    FIXED,
    WriteUnit,
    greedy_bound,
    imbalance,
    plan_writes,
)


@st.composite
def scenarios(draw):
    world = draw(st.integers(1, 8))
    ep = draw(st.sampled_from([d for d in range(1, world + 1) if world % d == 0]))
    units = []
    for r in range(world):  # sharded optimizer state and RNG: one holder
        units.append(WriteUnit(f"fixed{r}", draw(st.integers(0, 10_000)), (r,), FIXED))
    for e in range(draw(st.integers(0, 12))):  # experts: their EDP replicas
        ep_rank = e % ep
        units.append(WriteUnit(f"expert{e}", draw(st.integers(0, 5_000)),
                               tuple(range(ep_rank, world, ep)), EXPERT))
    for m in range(draw(st.integers(0, 30))):  # dense modules: everyone
        units.append(WriteUnit(f"dense{m}", draw(st.integers(0, 3_000)),
                               tuple(range(world)), DENSE))
    return world, units


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_every_unit_is_written_exactly_once_by_a_holder_within_the_greedy_bound(scenario):
    world, units = scenario
    plan = plan_writes(units, world)
    assert set(plan.writer) == {u.name for u in units}
    for u in units:
        assert plan.writer[u.name] in u.holders
    assert sum(plan.load) == sum(u.nbytes for u in units)
    for r in range(world):
        assert plan.load[r] == sum(u.nbytes for u in units if plan.writer[u.name] == r)
    assert max(plan.load) <= greedy_bound(units, world)


@settings(max_examples=100, deadline=None)
@given(scenarios())
def test_the_plan_is_the_same_whatever_order_the_units_come_in(scenario):
    world, units = scenario
    assert plan_writes(units, world) == plan_writes(list(reversed(units)), world)


def test_dense_modules_fill_around_uneven_expert_work():
    # K*N_moe mod D_ep != 0: three experts over two EP ranks; dense modules even it out.
    units = [WriteUnit("e0", 100, (0, 2), EXPERT), WriteUnit("e1", 100, (1, 3), EXPERT),
             WriteUnit("e2", 100, (0, 2), EXPERT)]
    units += [WriteUnit(f"d{i}", 25, (0, 1, 2, 3)) for i in range(4)]
    plan = plan_writes(units, 4)
    assert plan.load == (100, 100, 100, 100)
    assert plan.imbalance == 1.0


def test_bad_units_are_rejected():
    with pytest.raises(ValueError, match="no holder"):
        WriteUnit("x", 1, ())
    with pytest.raises(ValueError, match="outside"):
        plan_writes([WriteUnit("x", 1, (3,))], 2)
    with pytest.raises(ValueError, match="unique"):
        plan_writes([WriteUnit("x", 1, (0,)), WriteUnit("x", 2, (0,))], 1)


def test_imbalance_is_max_over_mean():
    assert imbalance([10, 30]) == 1.5
    assert imbalance([0, 0]) == 1.0
