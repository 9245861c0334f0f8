"""`moc bench dtensor` runs on real gloo ranks and accounts what it measures: every rank's
local state, the growth of each save, and the bytes of the PEC step against the formula
(exactly, for the tensor data)."""

from __future__ import annotations

import pytest

from moc.bench.dtensor import report, run

pytestmark = pytest.mark.integration  # real processes: see README, Tests


def test_the_benchmark_measures_both_engines_on_every_rank_and_the_bytes_match_the_formula():
    results = run(ranks=2, mb=1, k=1)
    assert len(results["per_rank"]) == 2
    for measured in results["per_rank"]:
        for name in ("Checkpointer", "TwoLevelCheckpointer"):
            m = measured[name]
            assert m["local_bytes"] > 0 and len(m["growth"]) == 2
    for name, b in results["step2"].items():
        assert b["written"] * b["n"] == b["dense"] * b["n"] + b["experts"] * 1, name
    text = report(results)
    assert "TwoLevelCheckpointer" in text and "= 1.000" in text
