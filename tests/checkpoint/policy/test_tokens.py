from __future__ import annotations

import warnings

import pytest
import torch

from moc.checkpoint.policy.tokens import (
    PLTOverBudgetWarning,
    RoutingNotRecordedWarning,
    TokenLedger,
    format_plt,
)


def _sync(ledger: TokenLedger) -> None:
    """What an engine does at a checkpoint of one process: fold the pending counts in."""
    ledger.add_synced(ledger.take_pending())


def _saved(ledger: TokenLedger, written: list[list[int]]) -> None:
    """What an engine does once a checkpoint saving `written` is committed."""
    ledger.committed({"at_save": ledger.at_save_after(written).tolist()})


def _recover(ledger: TokenLedger):
    """A recovery from storage: every expert from its newest persisted copy."""
    report = ledger.recover(ledger.at_save, {})
    ledger.all_saved()
    return report


def test_hand_computed_lost_tokens_and_plt():
    # 2 MoE layers x 3 experts. Save at "step 10" keeps only expert 0 of layer 0 and
    # expert 2 of layer 1 fresh; everything else was saved earlier.
    ledger = TokenLedger(2, 3)
    ledger.record(torch.tensor([[4, 2, 0], [1, 1, 4]]))  # steps 1-5
    _sync(ledger)
    _saved(ledger, [[0, 1, 2], [0, 1, 2]])               # full checkpoint at step 5
    ledger.record(torch.tensor([[3, 5, 2], [6, 0, 4]]))  # steps 6-10
    _sync(ledger)
    _saved(ledger, [[0], [2]])                           # partial checkpoint at step 10
    state = ledger.to_json()

    recovered = TokenLedger(2, 3)
    recovered.load_json(state)
    report = _recover(recovered)
    # Lost: layer 0 experts 1 and 2 lose 5 + 2; layer 1 experts 0 and 1 lose 6 + 0.
    assert report.lost_per_layer == [7, 6]
    assert report.lost_tokens == 13
    # Every assignment so far: layer 0: 6 + 10 = 16, layer 1: 6 + 10 = 16.
    assert report.plt == pytest.approx((7 / 16 + 6 / 16) / 2)
    # A second recovery at the same point loses nothing more.
    assert _recover(recovered).lost_tokens == 0


def test_full_saves_lose_nothing():
    ledger = TokenLedger(1, 4)
    ledger.record(torch.tensor([[3, 1, 4, 1]]))
    _sync(ledger)
    _saved(ledger, [[0, 1, 2, 3]])
    assert _recover(ledger).lost_tokens == 0 and ledger.plt() == 0.0


def test_record_rejects_wrong_shape():
    with pytest.raises(ValueError, match="shape"):
        TokenLedger(2, 3).record(torch.zeros(3, 2, dtype=torch.int64))


def test_plt_since_a_base_counts_only_tokens_lost_after_it():
    ledger = TokenLedger(1, 2)
    ledger.record(torch.tensor([[500, 500]]))
    _sync(ledger)
    ledger.lost += 50                     # fault 1: 50 of 1,000 -> 5%
    base = ledger.lost.clone()
    ledger.record(torch.tensor([[49_500, 49_500]]))
    _sync(ledger)
    ledger.lost += 4_000                  # fault 2: 4,000 of 100,000 since then
    assert ledger.plt(base) == pytest.approx(0.04)
    assert ledger.plt() == pytest.approx(0.0405)


def _lossy_ledger(k: int, threshold: float) -> TokenLedger:
    """A K=k ledger of 1 layer x 4 experts whose recovery loses 10% of all assignments."""
    ledger = TokenLedger(1, 4, k=k, dynamic_k=True, plt_threshold=threshold)
    ledger.record(torch.tensor([[25, 25, 25, 25]]))
    _sync(ledger)
    _saved(ledger, [[0, 1, 2, 3]])
    ledger.record(torch.tensor([[10, 0, 0, 0]]))  # expert 0's 10 of 110 are not saved
    _sync(ledger)
    return ledger


def test_dynamic_k_doubles_k_when_a_recovery_loses_more_than_the_threshold():
    ledger = _lossy_ledger(1, threshold=0.05)
    report = ledger.recover(ledger.at_save, {})
    assert report.lost_tokens == 10 and report.plt == pytest.approx(10 / 110)
    assert (report.k_before, report.k) == (1, 2) and ledger.k == 2
    assert ledger.lost_base.tolist() == [10]  # later faults are judged from here on


def test_dynamic_k_keeps_k_under_the_threshold_and_never_exceeds_n():
    calm = _lossy_ledger(1, threshold=0.5)
    assert calm.recover(calm.at_save, {}).k == 1
    full = _lossy_ledger(4, threshold=0.05)
    assert full.recover(full.at_save, {}).k == 4  # K = N: nothing left to raise


def test_a_k_raised_earlier_in_the_run_is_kept_and_judged_since_it_changed():
    ledger = _lossy_ledger(1, threshold=0.05)
    # The checkpoint says K was raised to 2 after 10 lost tokens: this recovery's 10 more
    # (10 of 110 since then) exceed the budget again.
    report = ledger.recover(ledger.at_save, {"k": 2, "lost_base": [0]})
    assert (report.k_before, report.k) == (2, 4)
    calm = _lossy_ledger(1, threshold=0.05)
    report = calm.recover(calm.at_save, {"k": 2, "lost_base": [10]})  # nothing new lost
    assert (report.k_before, report.k) == (2, 2)


def test_at_copy_decides_what_is_lost_and_all_saved_forgets_it():
    ledger = _lossy_ledger(1, threshold=0.5)
    at_copy = ledger.cumulative.clone()  # every expert restored at the newest step
    assert ledger.recover(at_copy, {}).lost_tokens == 0
    ledger.all_saved()
    assert ledger.unsaved().sum() == 0


def test_without_counts_a_lossy_recovery_is_unknown_and_a_lossless_one_is_zero():
    ledger = TokenLedger(2, 4, k=1)
    at_copy = torch.zeros(2, 4, dtype=torch.int64)
    unknown = ledger.recover(at_copy, {}, stale=True)  # older experts, nothing counted
    assert (unknown.plt, unknown.lost_tokens, unknown.lost_per_layer) == (None, None, None)
    exact = ledger.recover(at_copy, {}, stale=False)  # every expert at the step restored
    assert (exact.plt, exact.lost_tokens) == (0.0, 0)
    ledger.add_synced(torch.ones(2, 4, dtype=torch.int64))
    assert ledger.recover(at_copy, {}, stale=True).lost_tokens == 8  # counted: measured


def test_a_partial_policy_without_counts_warns_once_at_the_first_checkpoint():
    ledger = TokenLedger(2, 4, k=1)
    with pytest.warns(RoutingNotRecordedWarning, match="K=1 of 4"):
        ledger.warn_if_untracked(10, rank=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ledger.warn_if_untracked(20, rank=0)  # once per run
        TokenLedger(2, 4, k=4).warn_if_untracked(10, rank=0)  # K = N: nothing is lost


def test_plt_is_shown_one_way_a_percentage_against_the_budget():
    """Issue 50: the demo showed `PLT 0.00% (budget 3.75%)` and `moc train` `PLT 0.2340`."""
    assert format_plt(0.0, 0.0375) == "PLT 0.00% (budget 3.75%)"
    assert format_plt(0.234, 0.0375) == "PLT 23.40% (budget 3.75%, OVER)"
    assert format_plt(0.0375, 0.0375) == "PLT 3.75% (budget 3.75%)"  # at it, not past
    assert format_plt(None, 0.05) == "PLT unknown (no routing recorded; budget 5.00%)"


@pytest.mark.parametrize("dynamic_k, then", [
    (True, "Dynamic-K raised K from 1 to 2 experts per layer"),
    (False, r"K stays 1: pass PECPolicy\(dynamic_k=True\) to raise it, or a larger k")])
def test_a_recovery_past_the_budget_warns_on_the_rank_asked_to(dynamic_k, then):
    """A restore at 9% PLT against a 5% budget said nothing (issue 50): now the rank
    that reports (`warn`, rank 0's in the engines) warns, saying what follows."""
    ledger = _lossy_ledger(1, threshold=0.05)
    ledger.dynamic_k = dynamic_k
    with pytest.warns(PLTOverBudgetWarning,
                      match=r"^this recovery lost 10 routed tokens and left the run's PLT "
                            rf"9\.09% \(budget 5\.00%, OVER\): {then}$"):
        ledger.recover(ledger.at_save, {}, warn=True)
    quiet = _lossy_ledger(1, threshold=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet.recover(quiet.at_save, {})  # another rank's: no warning
        calm = _lossy_ledger(1, threshold=0.5)
        calm.recover(calm.at_save, {}, warn=True)  # under the budget: none either
