"""Lineage: which line of training a checkpoint belongs to, and the order saves keep."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moc.checkpoint.lineage import MAX_SEGMENTS, Lineage, SaveOrder, segment_id


def test_a_line_descends_from_its_own_earlier_checkpoints_and_the_one_it_restored():
    a = Lineage.fresh(segment_id())
    b = a.continued(10, segment_id())  # restored a's step 10
    assert b.descends_from(50, b, 20)  # b's own step 20
    assert b.descends_from(50, a, 10)  # the step b restored
    assert b.descends_from(50, a, 5)  # an older step of a
    assert not b.descends_from(50, a, 30)  # a's work after b forked: another line
    assert b.descends_from(50, b, 10)  # b's own save of the step it restored
    assert not b.descends_from(15, b, 20)  # the future is no ancestor


def test_two_lines_resumed_from_the_same_step_are_not_each_others():
    """The issue's jobs A (its memory snapshots 30..50) and B (resumed from A's 10,
    committed 20..50): neither is an ancestor of the other's steps."""
    base = Lineage.fresh(segment_id())
    a, b = base.continued(0, segment_id()), base.continued(10, segment_id())
    assert not a.descends_from(50, b, 50)
    assert not b.descends_from(50, a, 50)
    assert a.descends_from(50, base, 0) and b.descends_from(50, base, 10)


def test_a_chain_of_restores_keeps_every_ancestor():
    lines = [Lineage.fresh(segment_id())]
    for start in (10, 20, 30, 40):
        lines.append(lines[-1].continued(start, segment_id()))
    newest = lines[-1]
    for line, step in zip(lines, (10, 20, 30, 40), strict=False):
        assert newest.descends_from(45, line, step)
    assert not newest.descends_from(45, lines[1], 25)  # after line 1 was left at 20


def test_an_unknown_lineage_is_an_ancestor_only_of_a_line_that_began_at_its_step():
    legacy = Lineage.unknown()
    started_there = legacy.continued(60, segment_id())
    assert started_there.descends_from(70, legacy, 60)
    assert not started_there.descends_from(70, legacy, 50)
    assert not Lineage.fresh(segment_id()).descends_from(70, legacy, 60)


def test_a_lineage_forgets_only_its_oldest_segments():
    line = Lineage.fresh(segment_id())
    first = line
    for start in range(1, MAX_SEGMENTS + 5):
        line = line.continued(start, segment_id())
    assert len(line.segments) == MAX_SEGMENTS
    assert not line.descends_from(10**6, first, 0)  # forgotten: never invented
    assert Lineage.from_json(line.to_json(), "x") == line


@pytest.mark.parametrize("bad", [
    "x", [["a"]], [["a", -1]], [["a", 1.0]], [["", 1]], [["a", None], ["a", 3]],
    [["a", True]], [[1, 2]]])
def test_a_malformed_lineage_is_refused(bad):
    with pytest.raises(ValueError, match="line"):
        Lineage.from_json(bad, "run.line")


@given(st.lists(st.integers(0, 1000), min_size=1, max_size=12), st.data())
def test_descent_follows_the_restore_points(starts, data):
    """A random history of restores: the checkpoint of segment i at step q is an
    ancestor of the newest state exactly when q is in segment i's stretch."""
    starts = sorted(starts)
    lines = [Lineage.fresh(segment_id())]
    for s in starts:
        lines.append(lines[-1].continued(s, segment_id()))
    newest, top = lines[-1], starts[-1] + 100
    i = data.draw(st.integers(0, len(lines) - 1))
    q = data.draw(st.integers(0, top))
    begin = None if i == 0 else starts[i - 1]
    end = top if i == len(lines) - 1 else starts[i]
    expected = (begin is None or q >= begin) and q <= end
    assert newest.descends_from(top, lines[i], q) == expected


def test_saves_must_follow_the_directory_newest_until_a_restore():
    order = SaveOrder(newest=60, segment=segment_id())
    for step in (10, 30, 60):
        with pytest.raises(ValueError, match=r"newest checkpoint in D: .*restore\(\)"):
            order.check(step, "D")
    order.check(61, "D")
    order.saved(61)
    order.check(61, "D")  # the line's own newest, saved again (a final save)
    with pytest.raises(ValueError, match="steps must increase"):
        order.check(5, "D")


def test_a_restore_sets_where_the_line_continues():
    order = SaveOrder(newest=60, segment=segment_id())
    order.restored(30, Lineage.fresh(segment_id()), segment_id())  # a rollback to 30
    order.check(30, "D")  # saving the restored step again
    order.check(31, "D")
    with pytest.raises(ValueError, match="steps must increase"):
        order.check(29, "D")
    assert order.lineage.segments[-1][1] == 30


def test_an_empty_directory_takes_any_first_step():
    order = SaveOrder(newest=None, segment=segment_id())
    order.check(0, "D")
    order.saved(5)
    with pytest.raises(ValueError, match="before step 5"):
        order.check(3, "D")
