"""`moc bench accuracy`'s bookkeeping on synthetic metrics (the runs themselves are a
benchmark, not a test)."""

from __future__ import annotations

import pytest

from moc.bench.accuracy import LAST_STEPS, markdown, plot, summarize


def _events() -> list[dict]:
    ev = [{"event": "step", "step": s, "loss": 10.0 - s, "time": 100.0 + s}
          for s in range(1, 31)]
    # Fault at 25, resume from 20: steps 21-24 run again with other losses.
    ev.append({"event": "fault", "step": 25, "time": 126.0})
    ev.append({"event": "recovery", "step": 24, "resumed_from": 20, "source": "storage",
               "plt": 0.05, "lost_tokens": 7, "time": 130.0})
    ev += [{"event": "step", "step": s, "loss": 1.0, "time": 130.0 + s} for s in range(21, 25)]
    ev.append({"event": "dynamic_k", "step": 20, "k": 2, "k_before": 1, "time": 130.0})
    ev.append({"event": "summary", "steps": 30, "val_loss": 2.5, "time": 200.0})
    return ev


def test_summary_counts_replayed_steps_once_with_their_last_loss():
    r = summarize(_events())
    assert r["faults"] == 1 and r["fault_steps"] == [25]
    assert r["lost_tokens"] == 7 and r["plt"] == 0.05 and r["k_final"] == 2
    assert r["recovery_sources"] == ["storage"] and r["val_loss"] == 2.5
    assert r["wall_s"] == pytest.approx(99.0)
    losses = {int(k): v for k, v in r["losses"].items()}
    assert losses[22] == 1.0 and losses[30] == -20.0 and len(losses) == 30
    last = [losses[s] for s in range(31 - LAST_STEPS, 31)]
    assert r["final_train_loss"] == pytest.approx(sum(last) / len(last))


def test_an_unfinished_run_is_an_error():
    with pytest.raises(RuntimeError, match="did not finish"):
        summarize([e for e in _events() if e["event"] != "summary"])


def test_table_and_picture(tmp_path):
    steps = [e for e in _events() if e["event"] == "step"][:30]
    runs = {"no-fault": summarize([*steps, {"event": "summary", "val_loss": 2.0, "time": 1.0}]),
            "pec-k1": summarize(_events())}
    text = markdown(runs)
    assert "| pec-k1 | 1 | storage |" in text and "+25.00%" in text
    plot(runs, tmp_path / "acc.png")
    assert (tmp_path / "acc.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
