"""The choice of the version a restore takes, and of each rank's copy (`KnownCopies`):
the exact copy wins (issue 47). Pure: what the ranks learned is given as they gather it."""

from __future__ import annotations

from moc.checkpoint.twolevel.recovery.copies import KnownCopies

W = "seg"  # the segment that wrote every version here
FULL, PART = 8, 2  # expert weight keys: a rank's all, and a partial copy's


def known(everyone, holdings=(), *, newest=None, storage_exact=False, prefer="exact"):
    return KnownCopies(2, newest, W if newest is not None else None, storage_exact,
                       prefer, list(everyone), list(holdings) or [{}, {}], [FULL, FULL])


def test_the_newest_step_exact_on_every_rank_is_taken_first_and_alone():
    k = known([{(10, W): FULL, (8, W): FULL}, {(10, W): FULL, (8, W): FULL}], newest=8)
    assert k.candidates() == [(10, W), (8, W)]
    assert k.passed_over((10, W)) is None


def test_an_older_exact_step_comes_before_a_newer_partial_one():
    # Rank 1 lost its memory; storage's step 10 is partial (K_persist < N); its sealed
    # replica of step 8 sits on rank 0's node.
    k = known([{(10, W): FULL, (8, W): FULL}, {}],
              [{1: {(8, W): ("replica", 0, FULL)}}, {}], newest=10)
    assert [k.source(1, v) for v in [(10, W), (8, W)]] == ["storage", "peer"]
    assert k.lossy((10, W)) == [1] and k.lossy((8, W)) == []
    assert k.candidates() == [(8, W), (10, W)]
    assert k.passed_over((8, W)) == (
        "step 10 is newer, but rank(s) [1] have only a partial copy of it (experts older "
        "than it: the tokens routed to them since would be lost); step 8 is exact on "
        "every rank, 2 step(s) to train again")
    # With storage's ledger known, the line says what the newer step would cost.
    k.storage_lost = 1234
    assert "(experts older than it: up to 1234 expert tokens would be lost)" in (
        k.passed_over((8, W)))
    # Asked for the newest: the partial step, and nothing older than storage's.
    assert known(k.everyone, k.holdings, newest=10, prefer="newest").candidates() == [
        (10, W)]


def test_a_partial_replica_is_not_exact_and_exact_storage_is_not_gone_back_from():
    k = known([{(8, W): FULL}, {}], [{1: {(8, W): ("replica", 0, PART)}}, {}], newest=10,
              storage_exact=True)
    assert k.lossy((8, W)) == [1]
    assert k.candidates() == []  # storage's step 10 holds every expert: restored there


def test_a_copy_that_fails_is_replaced_by_the_same_steps_copy_elsewhere_first():
    """Rank 1's own snapshot of step 10 does not read; its peer replica of step 10 does."""
    k = known([{(10, W): FULL, (8, W): FULL}, {(10, W): FULL, (8, W): FULL}],
              [{1: {(10, W): ("replica", 1, FULL), (8, W): ("replica", 0, FULL)}}, {}],
              newest=8)
    tried = []
    gathers = iter([[[], [(10, W)]], [[], []]])  # after each attempt: who failed
    for v in k.attempts(lambda mine: next(gathers)):
        tried.append((v, k.source(1, v)))
        if len(tried) == 2:
            break  # the second attempt succeeded: restore_loop stops here
    assert tried == [((10, W), "memory"), ((10, W), "peer")]
