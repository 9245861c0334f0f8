"""The contract: an engine missing a call cannot be built; results read the same for
every engine."""

from __future__ import annotations

import pytest

from moc.checkpoint.api import CheckpointEngine, CheckpointResult


def test_an_engine_that_misses_part_of_the_contract_cannot_be_built():
    class Incomplete(CheckpointEngine):
        interval = 1

        def save(self, step, extra_state=None):
            pass

    with pytest.raises(TypeError, match="abstract"):
        Incomplete()


def test_maybe_save_saves_on_multiples_of_the_interval_only():
    saved = []

    class Recorder(CheckpointEngine):
        interval = 5
        pending = False
        restore = record_routing = wait_for_snapshot = None
        drain_completed = flush = host_memory = close = None

        def save(self, step, extra_state=None, *, final=False):
            saved.append((step, extra_state, final))

    engine = Recorder()
    assert [engine.maybe_save(s, {"s": s}) for s in (4, 5, 10)] == [False, True, True]
    assert engine.maybe_save(12, {"s": 12}, final=True)  # the run's last step, off-interval
    assert saved == [(5, {"s": 5}, False), (10, {"s": 10}, False), (12, {"s": 12}, True)]


def test_a_result_reports_stall_bytes_and_balance_the_same_for_every_engine():
    persisted = CheckpointResult(10, "moc", 1, [[0], [1]], save_s=0.001, wait_s=0.002,
                                 bytes_per_rank=[300, 100], snapshot_s=0.5, persist_s=1.0)
    assert persisted.stall_s == pytest.approx(0.003) and persisted.ok
    assert persisted.bytes == 400 and persisted.imbalance == pytest.approx(1.5)
    assert persisted.n_experts_saved == 2
    skipped = CheckpointResult(11, "moc", 1, [[2], [3]], 0.001, persist_skipped=True)
    assert skipped.bytes == 0 and skipped.imbalance is None  # nothing reached storage
    failed = CheckpointResult(12, "pec", 1, [[], []], 0.1, bytes_per_rank=[0, 0],
                              error="rank 1 could not write")
    assert not failed.ok
    # One event schema for every mode: fields that do not apply are null.
    assert failed.event().keys() == persisted.event().keys()
    assert failed.event()["snapshot_s"] is None and failed.event()["experts_saved"] == 0
