"""Pieces of tensors (moc.checkpoint.shards) and reading any box from them
(`state.read_piece`): pure functions, checked on every grid hypothesis draws."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moc.checkpoint.errors import CorruptCheckpointError, IncompatibleCheckpointError
from moc.checkpoint.recovery import DictReader
from moc.checkpoint.shards import Box, extent, piece_index, split_key, tiles
from moc.checkpoint.state import read_piece


@st.composite
def partitions(draw, shape: tuple[int, ...]):
    """A partition of each dimension of `shape`: the pieces of a Shard layout."""
    cuts = []
    for n in shape:
        inner = draw(st.lists(st.integers(1, n - 1), unique=True, max_size=3)) if n > 1 else []
        cuts.append([0, *sorted(inner), n])
    return cuts


@st.composite
def grids(draw):
    """A tensor shape and a partition of it."""
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=3)))
    return shape, draw(partitions(shape))


def _pieces(cuts: list[list[int]]) -> list[Box]:
    spans = [list(itertools.pairwise(c)) for c in cuts]
    return [Box(tuple(a for a, _ in combo), tuple(b - a for a, b in combo))
            for combo in itertools.product(*spans)]


def _stored(t: torch.Tensor, boxes: list[Box]) -> DictReader:
    whole = Box.whole(t.shape)
    return DictReader({"param/w" + ("" if b == whole else b.suffix()): t[b.index()].clone()
                       for b in boxes})


def test_a_key_splits_into_its_stable_key_and_offsets():
    assert split_key("param/a.b@4,0") == ("param/a.b", (4, 0))
    assert split_key("optim/a.b/exp_avg@0") == ("optim/a.b/exp_avg", (0,))
    assert split_key("param/s/expert=3") == ("param/s/expert=3", None)
    assert Box((4, 0), (2, 8)).suffix() == "@4,0"


@settings(max_examples=60, deadline=None)
@given(grids())
def test_the_pieces_of_a_grid_tile_it_and_one_less_or_one_more_does_not(grid):
    shape, cuts = grid
    boxes = _pieces(cuts)
    assert tiles(shape, boxes) and extent(boxes) == shape
    if len(boxes) > 1:
        assert not tiles(shape, boxes[1:])
        assert not tiles(shape, [*boxes[:-1], boxes[0]])


@settings(max_examples=60, deadline=None)
@given(grids(), st.data())
def test_any_box_reads_back_as_the_slice_of_the_whole_whatever_wrote_the_pieces(
        written, data):
    shape, cuts = written
    t = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    reader = _stored(t, _pieces(cuts))
    # A piece of another layout of the same tensor.
    box = data.draw(st.sampled_from(_pieces(data.draw(partitions(shape)))))
    key = "param/w" + ("" if box == Box.whole(shape) else box.suffix())
    assert torch.equal(read_piece(reader, key, box.shape, shape), t[box.index()])


def test_a_missing_piece_overlapping_pieces_and_another_shape_are_refused():
    t = torch.arange(16.0).reshape(4, 4)
    halves = [Box((0, 0), (2, 4)), Box((2, 0), (2, 4))]
    with pytest.raises(CorruptCheckpointError, match="cover"):
        read_piece(_stored(t, [Box((0, 0), (2, 4)), Box((3, 0), (1, 4))]), "param/w",
                   (4, 4))
    overlapping = _stored(t, halves)
    overlapping.tensors["param/w@1,0"] = t[1:3].clone()
    with pytest.raises(CorruptCheckpointError, match="overlap"):
        read_piece(overlapping, "param/w", (4, 4))
    with pytest.raises(IncompatibleCheckpointError, match=r"\(4, 4\)"):
        read_piece(_stored(t, halves), "param/w@0,0", (3, 4), (6, 4))
    assert piece_index([("param/w@2,0", (2, 4)), ("param/x", (3,))]) == {
        "param/w": [("param/w@2,0", Box((2, 0), (2, 4)))],
        "param/x": [("param/x", Box((0,), (3,)))]}


def test_one_ranks_snapshot_reads_its_own_piece_without_the_others():
    """A rank's snapshot in memory holds its pieces only: rank 0 of an FSDP2 job holds
    rows 0-1 of 4, so the pieces' extent is (2, 4), not the whole (4, 4). Its own piece
    reads back; a piece it does not hold is missing, and a piece past the whole shape is
    another model. A checkpoint on storage (every rank's pieces) stays strict."""
    t = torch.arange(16.0).reshape(4, 4)
    mine = Box((0, 0), (2, 4))
    snapshot = _stored(t, [mine])
    snapshot.one_rank = True
    assert torch.equal(read_piece(snapshot, "param/w@0,0", (2, 4), (4, 4)), t[:2])
    with pytest.raises(CorruptCheckpointError, match="cover 0 of the 8"):
        read_piece(snapshot, "param/w@2,0", (2, 4), (4, 4))
    with pytest.raises(IncompatibleCheckpointError, match=r"\(2, 4\)"):
        read_piece(snapshot, "param/w@0,0", (2, 4), (2, 2))
    with pytest.raises(IncompatibleCheckpointError, match=r"\(2, 4\) does not fit"):
        read_piece(_stored(t, [mine]), "param/w@0,0", (2, 4), (4, 4))
