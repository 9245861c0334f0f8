from __future__ import annotations

import pytest
import torch

from moc.checkpoint.tokens import TokenLedger


def test_hand_computed_lost_tokens_and_plt():
    # 2 MoE layers x 3 experts. Save at "step 10" keeps only expert 0 of layer 0 and
    # expert 2 of layer 1 fresh; everything else was saved earlier.
    ledger = TokenLedger(2, 3)
    ledger.record(torch.tensor([[4, 2, 0], [1, 1, 4]]))  # steps 1-5
    ledger.sync(None)
    ledger.mark_saved([[0, 1, 2], [0, 1, 2]])             # full checkpoint at step 5
    ledger.record(torch.tensor([[3, 5, 2], [6, 0, 4]]))  # steps 6-10
    ledger.sync(None)
    ledger.mark_saved([[0], [2]])                         # partial checkpoint at step 10
    state = ledger.to_json()

    recovered = TokenLedger(2, 3)
    recovered.load_json(state)
    report = recovered.recover()
    # Lost: layer 0 experts 1 and 2 lose 5 + 2; layer 1 experts 0 and 1 lose 6 + 0.
    assert report.lost_per_layer == [7, 6]
    assert report.lost_tokens == 13
    # Every assignment so far: layer 0: 6 + 10 = 16, layer 1: 6 + 10 = 16.
    assert report.plt == pytest.approx((7 / 16 + 6 / 16) / 2)
    # A second recovery at the same point loses nothing more.
    assert recovered.recover().lost_tokens == 0


def test_full_saves_lose_nothing():
    ledger = TokenLedger(1, 4)
    ledger.record(torch.tensor([[3, 1, 4, 1]]))
    ledger.sync(None)
    ledger.mark_saved([[0, 1, 2, 3]])
    assert ledger.recover().lost_tokens == 0 and ledger.plt() == 0.0


def test_record_rejects_wrong_shape():
    with pytest.raises(ValueError, match="shape"):
        TokenLedger(2, 3).record(torch.zeros(3, 2, dtype=torch.int64))


def test_plt_since_a_base_counts_only_tokens_lost_after_it():
    ledger = TokenLedger(1, 2)
    ledger.record(torch.tensor([[500, 500]]))
    ledger.sync(None)
    ledger.lost += 50                     # fault 1: 50 of 1,000 -> 5%
    base = ledger.lost.clone()
    ledger.record(torch.tensor([[49_500, 49_500]]))
    ledger.sync(None)
    ledger.lost += 4_000                  # fault 2: 4,000 of 100,000 since then
    assert ledger.plt(base) == pytest.approx(0.04)
    assert ledger.plt() == pytest.approx(0.0405)
