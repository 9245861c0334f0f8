"""Counting a run's checkpoints from its events (`moc.train.metrics.checkpoint_counts`),
as `moc bench overhead` does before it compares strategies."""

from __future__ import annotations

from moc.train.config import TrainConfig
from moc.train.metrics import checkpoint_counts


def test_every_save_counts_once_by_step_failed_ones_apart():
    events = [
        {"event": "step", "step": 5},
        {"event": "checkpoint", "step": 5},
        {"event": "checkpoint_failed", "step": 10, "error": "staging step 10 failed"},
        {"event": "checkpoint", "step": 15, "persist_skipped": True},
        {"event": "checkpoint_failed", "step": 20, "error": "disk full"},
        {"event": "checkpoint", "step": 20},  # failed, then written after a restart
        {"event": "checkpoint", "step": 15},  # written again after a restart: once
    ]
    counts = checkpoint_counts(events)
    assert (counts.written, counts.failed, counts.taken) == (3, 1, 4)
    assert counts.persist_skipped == 1
    assert counts.first_error == "staging step 10 failed"


def test_a_step_resumed_from_was_checkpointed_even_if_the_fault_ate_its_event():
    # An asynchronous checkpoint's event comes once it is persisted; the fault came
    # first, and the restart restored that step from memory: it was taken all the same.
    events = [{"event": "checkpoint", "step": 5},
              {"event": "fault", "step": 10, "rank": 0},
              {"event": "recovery", "resumed_from": 5, "source": "memory"},
              {"event": "checkpoint", "step": 10}]
    assert checkpoint_counts(events).written == 2
    events[0] = {"event": "step", "step": 5}  # its event never written
    assert checkpoint_counts(events).written == 2
    # An in-job recovery with nothing to restore starts over: no step 0 checkpoint.
    start = [{"event": "recovery", "resumed_from": 0, "source": "start"}]
    assert checkpoint_counts(start).written == 0
    assert checkpoint_counts([]).first_error is None


def test_the_checkpoints_due_are_the_interval_and_the_last_step():
    assert TrainConfig(steps=40, ckpt_interval=5).checkpoint_steps() == list(range(5, 41, 5))
    assert TrainConfig(steps=12, ckpt_interval=5).checkpoint_steps() == [5, 10, 12]
    assert TrainConfig(steps=12, ckpt_interval=1, ckpt_blocks=3).checkpoint_steps() == [
        3, 4, 5, 9, 10, 11, 12]
