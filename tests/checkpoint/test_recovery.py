"""The one restore loop: candidates, agreement, fall back; on one rank and on real ranks."""

from __future__ import annotations

import logging

import pytest

from moc.checkpoint.dist import Dist
from moc.checkpoint.errors import CorruptCheckpointError, IncompatibleCheckpointError
from moc.checkpoint.recovery import restore_loop
from moc.topology import ParallelGroups
from tests.distributed import run_ranks

ONE = Dist(ParallelGroups.single(1))


def test_the_first_candidate_that_loads_wins_and_corrupt_ones_are_skipped_with_reasons():
    tried = []

    def attempt(step: int) -> str:
        tried.append(step)
        if step == 30:
            raise CorruptCheckpointError("step 30: checksum mismatch")
        return f"loaded {step}"

    value, skipped = restore_loop([30, 20, 10], attempt, ONE)
    assert value == "loaded 20" and tried == [30, 20]
    assert skipped == [(30, "step 30: checksum mismatch")]


def test_nothing_loads_nothing_is_returned_and_every_reason_is_kept():
    def attempt(step: int) -> None:
        raise CorruptCheckpointError(f"bad {step}")

    assert restore_loop([2, 1], attempt, ONE) == (None, [(2, "bad 2"), (1, "bad 1")])
    assert restore_loop([], attempt, ONE) == (None, [])


def test_an_incompatible_candidate_stops_the_loop_and_other_errors_propagate():
    def incompatible(step: int) -> None:
        raise IncompatibleCheckpointError("a different model")

    with pytest.raises(IncompatibleCheckpointError, match="a different model"):
        restore_loop([2, 1], incompatible, ONE)

    def bug(step: int) -> None:
        raise KeyError("a bug, not a bad checkpoint")

    with pytest.raises(KeyError):
        restore_loop([2, 1], bug, ONE)
    # ... unless the caller says that kind of error means "try the next one".
    assert restore_loop([2, 1], bug, ONE, skip=(KeyError,))[0] is None


def _one_rank_sees_corruption(rank: int, world: int) -> tuple:
    dist = Dist(ParallelGroups.from_world(1, 2))

    def attempt(step: int) -> int:
        if step == 3 and rank == 1:
            raise CorruptCheckpointError("flipped bit in step 3")
        if step == 2 and rank == 0:
            raise IncompatibleCheckpointError("step 2 is of another model")
        return step

    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("moc.checkpoint.recovery").addHandler(handler)
    first = restore_loop([3, 1], attempt, dist)
    logging.getLogger("moc.checkpoint.recovery").removeHandler(handler)
    try:
        restore_loop([2, 1], attempt, dist)
        second = None
    except IncompatibleCheckpointError as e:
        second = str(e)
    return first, second, logged


def test_ranks_agree_a_candidate_one_rank_cannot_load_is_skipped_by_all():
    results = run_ranks(_one_rank_sees_corruption, 2)
    for (value, skipped), incompatible, _ in results:
        assert value == 1 and skipped == [(3, "rank 1: flipped bit in step 3")]
        assert incompatible == "rank 0: step 2 is of another model"  # raised everywhere
    # The reason is agreed: rank 0 says it, once (every rank said it: issue 50).
    assert [logged for _, _, logged in results] == [
        ["3 is not usable (rank 1: flipped bit in step 3); trying an older one"], []]


def test_a_skipped_candidate_leaves_no_reference_cycle_behind():
    """Keeping a caught exception in the loop's frame made a cycle (its traceback, or
    that of the exception it was raised from, holds the frame) that kept the process
    groups alive until interpreter exit, where tearing gloo down aborted the process.
    Whatever the loop referenced must be freed as soon as it returns, without the GC."""
    import gc
    import weakref

    class Steps(list):  # weak-referenceable, and held by the loop's frame
        pass

    def attempt(step: int) -> None:
        try:
            raise OSError(5, "Input/output error")
        except OSError:
            raise CorruptCheckpointError(f"step {step}: unreadable") from None

    steps = Steps([2, 1])
    alive = weakref.ref(steps)
    gc.disable()
    try:
        assert restore_loop(steps, attempt, ONE)[0] is None
        del steps
        assert alive() is None
    finally:
        gc.enable()
