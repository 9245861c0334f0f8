"""The two-level engine's one failure path (issue 31): whatever fails, in whichever process
or channel, becomes one agreed outcome per checkpoint (`EngineState.settle`, `.fail`) and
is raised the same way on every rank (`EngineState.raise_failure`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moc.checkpoint.errors import CheckpointError
from moc.checkpoint.failures import CheckpointFailedError, FailurePolicy
from moc.checkpoint.plan.chain import ChainState
from moc.checkpoint.policy.selection import PECPolicy
from moc.checkpoint.policy.tokens import TokenLedger
from moc.checkpoint.spec import ExpertSpec
from moc.checkpoint.twolevel.checkpointer import TwoLevelCheckpointer
from moc.checkpoint.twolevel.engine_state import EngineState
from moc.checkpoint.twolevel.memory.slots import N_SLOTS
from moc.model import Transformer
from tests.distributed import TINY, build_sharded, run_ranks


def _books(max_failures: int | None = 2, on_commit=None) -> EngineState:
    spec = ExpertSpec.infer(Transformer(TINY))
    chain = ChainState(spec, PECPolicy(k=1), 1, None)
    ledger = TokenLedger(spec.n_moe_layers, spec.n_experts, 1)
    return EngineState(chain, ledger, FailurePolicy(max_failures), k_snapshot=4,
                       on_commit=on_commit)


def test_failures_are_settled_per_checkpoint_and_raised_once():
    books = _books(max_failures=2)
    never = lambda: None  # noqa: E731  (the persist process is alive)
    books.settle(1, "OSError: disk full")
    books.raise_failure(never)  # one failure: logged, training goes on
    books.settle(2, None)  # a success resets the count
    books.settle(3, "OSError: disk full")
    books.settle(4, "OSError: disk full")
    with pytest.raises(CheckpointFailedError, match="2 checkpoints in a row failed"):
        books.raise_failure(never)
    books.raise_failure(never)  # raised once, not at every later call
    books.mark_final(5)
    books.settle(5, "the persist of step 4 did not finish")
    with pytest.raises(CheckpointFailedError, match=r"final checkpoint \(step 5\) failed: "
                                                   r".*; the persist process is gone$"):
        books.raise_failure(lambda: "the persist process is gone")


def test_an_error_of_rank_0s_background_work_is_shared_then_raised_once():
    def retention() -> None:
        raise CheckpointError("deleting old checkpoints failed")

    books = _books(on_commit=retention)
    manifest_like = type("M", (), {"tokens": None, "step": 3})
    # The chain's and the ledger's own rules are tested elsewhere.
    books.chain.advance = lambda m: None
    books.ledger.committed = lambda tokens: None
    books.committed(manifest_like)
    error = books.take_unshared()  # what rank 0 sends at the next exchange
    assert error == "deleting old checkpoints failed" and books.take_unshared() is None
    books.fail(error)  # as every rank learns it from the exchange
    with pytest.raises(CheckpointError, match="deleting old checkpoints failed"):
        books.raise_failure(lambda: None)
    books.raise_failure(lambda: None)


def test_slot_roles_never_hand_out_the_newest_or_the_persisted_snapshot():
    books = _books()
    first = books.free_slot()
    books.persist_started(1, first)  # step 1 is persisted from its slot ...
    books.snapshot_taken(first)
    second = books.free_slot()
    assert second != first
    books.snapshot_taken(second)  # ... while step 2 is snapshotted (its persist skipped)
    third = books.free_slot()
    assert {first, second, third} == set(range(N_SLOTS))
    books.persist_ended(1)  # step 1's persist is over: its slot is free again
    assert books.free_slot() != second and books.in_flight is None
    assert books.persist_lost("/dev/shm/x") is None
    books.persist_liveness(False)
    assert "kept in /dev/shm/x" in books.persist_lost("/dev/shm/x")


def _persists_keep_failing(rank: int, world: int, root: str) -> dict:
    from moc.checkpoint.store.steps import tmp_dir

    groups, model, opt = build_sharded(1)
    ckpt = TwoLevelCheckpointer(model, opt, root, groups=groups, policy=PECPolicy(k=1),
                                interval=1, persist_policy="wait", max_failures=2)
    if rank == 0:
        for step in range(2, 9):  # a file where each step's directory goes: every
            Path(tmp_dir(Path(root), step)).write_text("x")  # persist after 1 fails
    raised, results = None, []
    for step in range(1, 9):
        out = model(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))
        out.loss.backward()
        try:
            ckpt.wait_for_snapshot()
        except CheckpointFailedError as e:
            raised = (step, str(e))
            break
        opt.step()
        model.zero_grad()
        ckpt.save(step, {"step": step})
        results += [(r.step, r.error is None) for r in ckpt.drain_completed()]
    try:
        ckpt.close()
    except CheckpointError as e:
        closed = type(e).__name__
    else:
        closed = None
    return {"raised": raised, "results": results, "closed": closed}


@pytest.mark.integration  # real ranks, a real persist process
def test_persists_that_fail_in_the_persist_process_raise_on_every_rank_alike(tmp_path):
    """The failure arises in rank 0's persist process, which only rank 0 hears; the other
    rank learns it at the next exchange, and both raise the same error at the same step."""
    got = run_ranks(_persists_keep_failing, 2, str(tmp_path / "ckpt"))
    assert got[0]["raised"] is not None and got[0]["raised"] == got[1]["raised"], got
    _, message = got[0]["raised"]
    assert "2 checkpoints in a row failed" in message and "step-00000" in message
    assert got[0]["closed"] == got[1]["closed"] == "CheckpointFailedError"
    assert (1, True) in got[0]["results"]  # the first one was persisted
